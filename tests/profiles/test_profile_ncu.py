"""Nsight Compute: command line, `--csv --page raw` parsing of real H200 captures, and the failure modes."""
import subprocess
import sys
from pathlib import Path

import pytest

from mpfa.mpfa_cli.errors import ToolError
from mpfa.profiles import ncu
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.registry import adapter_for

FIXTURES = Path(__file__).parents[1] / "fixtures" / "profiles"
# Real `ncu --csv --page raw --print-units base` output from the H200 (mpfa profile ... --ncu).
PREFILL_FA4 = FIXTURES / "ncu_h200_prefill64k_fa4.csv"
PREFILL_MPFA = FIXTURES / "ncu_h200_prefill64k_mpfa_mma_sync_unstaged.csv"  # the mma.sync prefill, per-warp loads
PREFILL_FLASHINFER = FIXTURES / "ncu_h200_prefill64k_flashinfer_fp8.csv"
DECODE_FA4 = FIXTURES / "ncu_h200_decode128k_b8_fa4.csv"
DECODE_FLASHINFER = FIXTURES / "ncu_h200_decode128k_b8_flashinfer_fp8.csv"
DECODE_MPFA = FIXTURES / "ncu_h200_decode128k_b8_mpfa.csv"  # the sm90 split-KV decode
PREFILL_MPFA_STAGED = FIXTURES / "ncu_h200_prefill64k_mpfa_mma_sync.csv"  # the mma.sync prefill, staged in smem
TENSOR_PIPE = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
WORKLOAD = AttentionWorkload("decode", 131072, 8, 32, 8, 128)


def test_command_line():
    command = ncu.ncu_command("/opt/ncu", "A|B", 3, ("m1.sum", "m2.avg"), ["python", "-m", "x"])
    assert command[0] == "/opt/ncu"
    joined = " ".join(command)
    for part in ("--clock-control none", "--target-processes all", "--kernel-name-base demangled",
                 "--kernel-name regex:A|B", "--launch-skip 3", "--launch-count 1", "--csv", "--page raw",
                 "--print-units base", "--metrics m1.sum,m2.avg"):
        assert part in joined
    assert command[-3:] == ["python", "-m", "x"]  # the target comes last, after every ncu option


def test_metric_lists_cover_the_issue():
    wanted = {"gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
              "dram__bytes_write.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
              "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
              "launch__shared_mem_per_block_static", "launch__shared_mem_per_block_dynamic"}
    assert wanted <= set(ncu.CORE_METRICS)
    assert all("tensor" in metric for metric in ncu.TENSOR_METRICS)


# (file, kernel name part, ns, registers, DRAM bytes read, DRAM bytes written, SM %, tensor pipe %, DRAM %,
#  occupancy %, dynamic shared memory bytes, grid size, block size), read off the captures.
REAL_CAPTURES = [
    (PREFILL_FA4, "FlashAttentionForwardSm90", 52_605_408, 168, 1_586_091_264, 523_258_880, 77.65, 77.69, 0.83,
     14.04, 164_864, 16_384, 384),
    (PREFILL_FLASHINFER, "BatchPrefillWithPagedKVCacheKernel<KernelTraits<1, 128,", 184_256_832, 255, 691_663_616,
     543_836_160, 56.56, 30.40, 0.14, 12.40, 49_184, 16_384, 128),
    (DECODE_FA4, "FlashAttentionForwardSm90", 1_515_872, 168, 4_295_168_512, 2_373_376, 37.39, 77.54, 58.92, 14.07,
     164_864, 64, 384),
    (DECODE_FLASHINFER, "BatchPrefillWithPagedKVCacheKernel<KernelTraits<0, 16,", 859_296, 255, 2_151_865_856,
     2_149_888, 48.93, 13.16, 52.10, 12.11, 69_664, 256, 128),
    (PREFILL_MPFA, "PrefillSm90", 288_092_512, 255, 6_536_506_368, 519_262_720, 39.38, 18.87, 0.51, 12.5, 0,
     32_768, 128),
    (DECODE_MPFA, "SplitKVDecodeSm90Pipelined", 676_128, 164, 2_215_038_208, 4_650_496, 39.61, 12.77, 68.22, 17.49,
     15_360, 1_536, 32),
    (PREFILL_MPFA_STAGED, "PrefillSm90Staged", 200_069_344, 255, 126_634_674_944, 517_498_112, 47.76, 26.91, 13.21, 12.52,
     43_008, 32_768, 128),
]


@pytest.mark.parametrize("path,name,ns,regs,read,written,sm,tensor,dram,occupancy,smem,grid,block", REAL_CAPTURES,
                         ids=lambda value: value.stem if isinstance(value, Path) else None)
def test_parse_real_h200_captures(path, name, ns, regs, read, written, sm, tensor, dram, occupancy, smem, grid,
                                  block):
    text = path.read_text()
    assert text.startswith("==WARNING==") and "==PROF== Disconnected" in text  # ncu's own lines come first
    [kernel] = ncu.parse_raw_csv(text)
    assert name in kernel.name
    m = kernel.metrics
    assert m["gpu__time_duration.sum"] == ns and kernel.units["gpu__time_duration.sum"] == "ns"
    assert m["launch__registers_per_thread"] == regs
    assert m["dram__bytes_read.sum"] == read and m["dram__bytes_write.sum"] == written
    assert m["sm__throughput.avg.pct_of_peak_sustained_elapsed"] == pytest.approx(sm)
    assert m[TENSOR_PIPE] == pytest.approx(tensor)
    assert m["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == pytest.approx(dram)
    assert m["sm__warps_active.avg.pct_of_peak_sustained_active"] == pytest.approx(occupancy)
    assert m["launch__shared_mem_per_block_dynamic"] == smem and m["launch__shared_mem_per_block_static"] == 0
    assert (m["launch__grid_size"], m["launch__block_size"]) == (grid, block)
    # Identity columns are not metrics; every metric this profiler asks for is in the capture.
    assert "Grid Size" not in m and "Kernel Name" not in m
    assert set(ncu.CORE_METRICS + ncu.TENSOR_METRICS) <= set(m)


def test_real_capture_texts_become_none_not_numbers():
    """Text-valued metrics in a real capture (the display name, the cluster policy) parse as None."""
    [kernel] = ncu.parse_raw_csv(PREFILL_FA4.read_text())
    assert kernel.metrics["device__attribute_display_name"] is None
    assert kernel.metrics["launch__cluster_scheduling_policy"] is None


def test_parse_converts_scaled_units_to_base():
    text = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","launch__shared_mem_per_block_static"\n'
            '"","","usecond","Mbyte","Kbyte/block"\n'
            '"0","k","1,500.5","2.5","3"\n')
    metrics = ncu.parse_raw_csv(text)[0]
    assert metrics.metrics == {"gpu__time_duration.sum": 1_500_500.0, "dram__bytes_read.sum": 2_500_000.0,
                               "launch__shared_mem_per_block_static": 3000.0}
    assert metrics.units["launch__shared_mem_per_block_static"] == "byte/block"


def test_parse_without_header_is_a_tool_error():
    with pytest.raises(ToolError, match="no CSV header"):
        ncu.parse_raw_csv("==PROF== Disconnected from process 1\n")


def _fake_ncu(monkeypatch, outputs):
    """Make ncu 'found' and answer each run with the next (stdout, stderr, returncode)."""
    calls = []
    monkeypatch.setattr(ncu, "find_tool", lambda name: f"/fake/{name}")

    def run(command, timeout_s):
        calls.append(command)
        stdout, stderr, returncode = outputs[len(calls) - 1]
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    monkeypatch.setattr(ncu, "run_tool", run)
    return calls


def test_profile_runs_launch_one_under_ncu_and_keeps_the_raw_output(monkeypatch, tmp_path):
    capture = DECODE_FLASHINFER.read_text()
    calls = _fake_ncu(monkeypatch, [(capture, "", 0)])
    result = ncu.profile_with_ncu(adapter_for("flashinfer-fp8"), WORKLOAD, tmp_path)
    assert result.error is None and [k.metrics["gpu__time_duration.sum"] for k in result.kernels] == [859_296]
    command = calls[0]
    target = command[command.index(sys.executable):]
    assert target[1:3] == ["-m", "mpfa.profiles.launch_one"]
    assert "--backend" in target and target[target.index("--backend") + 1] == "flashinfer-fp8"
    assert target[target.index("--warmup") + 1] == str(ncu.WARMUP_LAUNCHES)
    assert command[command.index("--launch-skip") + 1] == str(ncu.WARMUP_LAUNCHES)
    assert (tmp_path / "ncu-flashinfer-fp8.csv").read_text() == capture


def test_permission_error_is_named(monkeypatch, tmp_path):
    _fake_ncu(monkeypatch, [("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
                             "Performance Counters on the target device 0.", "", 1)])
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert "ERR_NVGPUCTRPERM" in result.error and "NVreg_RestrictProfilingToAdminUsers" in result.error
    assert result.kernels == []


def test_unknown_tensor_metric_retries_with_core_metrics(monkeypatch, tmp_path):
    calls = _fake_ncu(monkeypatch, [("", f"==ERROR== Failed to find metric {TENSOR_PIPE}", 1),
                                    (DECODE_FA4.read_text(), "", 0)])
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert result.error is None and len(calls) == 2
    retried_metrics = calls[1][calls[1].index("--metrics") + 1].split(",")
    assert retried_metrics == list(ncu.CORE_METRICS)
    assert result.dropped_metrics == list(ncu.TENSOR_METRICS)
    assert result.kernels[0].metrics["dram__bytes_read.sum"] == 4_295_168_512


def test_no_matching_kernel_and_crashes_are_errors(monkeypatch, tmp_path):
    _fake_ncu(monkeypatch, [("==WARNING== No kernels were profiled.", "", 0)])
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert "no kernel matching regex 'FlashAttentionForward'" in result.error
    _fake_ncu(monkeypatch, [("", "Traceback (most recent call last):\nImportError: no flash_attn", 1)])
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert result.error.startswith("ncu produced no report") and "ImportError: no flash_attn" in result.error


def test_missing_ncu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert result.error.startswith("ncu not found on PATH") and "Nsight Compute" in result.error


RESULTS = Path(__file__).resolve().parents[2] / "profiles" / "results"


@pytest.mark.parametrize(("capture", "kernel", "expected"), [
    ("ncu-decode-32k-b1-mpfa-h100.csv", "SplitKVDecodeSm90",
     {"gpu__time_duration.sum": 25408.0, "dram__throughput.avg.pct_of_peak_sustained_elapsed": 66.91,
      "launch__grid_size": 752.0, "launch__block_size": 32.0,
      "sm__warps_active.avg.pct_of_peak_sustained_active": 8.01}),
    ("ncu-prefill-64k-mpfa-exact-h100.csv", "prefill_exactPrefillSm90",
     {"gpu__time_duration.sum": 78348928.0, "launch__registers_per_thread": 128.0,
      "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": 48.27}),
    ("ncu-prefill-64k-fa3-fp8-contiguous-h100.csv", "FlashAttnFwdSm90",
     {"gpu__time_duration.sum": 35135712.0, "launch__registers_per_thread": 168.0, "launch__grid_size": 132.0,
      "launch__block_size": 384.0, "sm__warps_active.avg.pct_of_peak_sustained_active": 18.75,
      "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": 51.8}),
])
def test_parses_the_captured_h100_profiles_docs_cite(capture, kernel, expected):
    """The raw pages ncu printed on the H100 (its warning lines before the CSV included) give the numbers
    docs/kernels.md quotes: one kernel, every metric in base units."""
    (profiled,) = ncu.parse_raw_csv((RESULTS / capture).read_text())
    assert kernel in profiled.name
    assert {name: profiled.metrics[name] for name in expected} == expected
    assert profiled.units["gpu__time_duration.sum"] == "ns"  # this ncu's base unit (older ones: nsecond)
