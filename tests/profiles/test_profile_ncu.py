"""Nsight Compute: command line, `--csv --page raw` parsing and the failure modes, with ncu faked."""
import subprocess
import sys
from pathlib import Path

import pytest

from mpfa.profiles import ncu
from mpfa.profiles.errors import ToolError
from mpfa.profiles.registry import adapter_for
from mpfa.profiles.workload import AttentionWorkload

FIXTURE = Path(__file__).parent / "fixtures" / "ncu_raw_example.csv"
WORKLOAD = AttentionWorkload("decode", 131072, 8, 32, 8, 128)


def test_command_line():
    command = ncu.ncu_command("/opt/ncu", "A|B", 3, ("m1.sum", "m2.avg"), ["python", "-m", "x"])
    assert command[0] == "/opt/ncu"
    joined = " ".join(command)
    for part in ("--clock-control none", "--target-processes all", "--kernel-name regex:A|B", "--launch-skip 3",
                 "--launch-count 1", "--csv", "--page raw", "--print-units base", "--metrics m1.sum,m2.avg"):
        assert part in joined
    assert command[-3:] == ["python", "-m", "x"]  # the target comes last, after every ncu option


def test_metric_lists_cover_the_issue():
    wanted = {"gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
              "dram__bytes_write.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
              "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
              "launch__shared_mem_per_block_static", "launch__shared_mem_per_block_dynamic"}
    assert wanted <= set(ncu.CORE_METRICS)
    assert all("tensor" in metric for metric in ncu.TENSOR_METRICS)


def test_parse_hand_made_fixture():
    kernels = ncu.parse_raw_csv(FIXTURE.read_text())
    assert [kernel.name for kernel in kernels] == ["BatchPrefillWithPagedKVCacheKernel", "MergeStatesKernel"]
    main = kernels[0].metrics
    assert main["dram__bytes_read.sum"] == 2_147_483_648  # thousands separators removed
    assert main["gpu__time_duration.sum"] == 1_234_567
    assert main["sm__throughput.avg.pct_of_peak_sustained_elapsed"] == 43.75
    assert main["launch__shared_mem_per_block_dynamic"] == 98_304
    assert main["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"] is None  # "n/a"
    assert kernels[0].units["gpu__time_duration.sum"] == "nsecond"
    assert kernels[1].metrics["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"] is None
    assert kernels[1].metrics["launch__shared_mem_per_block_static"] == 1024
    # Identity columns are not metrics.
    assert "Grid Size" not in kernels[0].metrics and "Kernel Name" not in kernels[0].metrics


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
    calls = _fake_ncu(monkeypatch, [(FIXTURE.read_text(), "", 0)])
    result = ncu.profile_with_ncu(adapter_for("flashinfer-fp8"), WORKLOAD, tmp_path)
    assert result.error is None and len(result.kernels) == 2
    command = calls[0]
    target = command[command.index(sys.executable):]
    assert target[1:3] == ["-m", "mpfa.profiles.launch_one"]
    assert "--backend" in target and target[target.index("--backend") + 1] == "flashinfer-fp8"
    assert target[target.index("--warmup") + 1] == str(ncu.WARMUP_LAUNCHES)
    assert command[command.index("--launch-skip") + 1] == str(ncu.WARMUP_LAUNCHES)
    assert (tmp_path / "ncu-flashinfer-fp8.csv").read_text() == FIXTURE.read_text()


def test_permission_error_is_named(monkeypatch, tmp_path):
    _fake_ncu(monkeypatch, [("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
                             "Performance Counters on the target device 0.", "", 1)])
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert "ERR_NVGPUCTRPERM" in result.error and "NVreg_RestrictProfilingToAdminUsers" in result.error
    assert result.kernels == []


def test_unknown_tensor_metric_retries_with_core_metrics(monkeypatch, tmp_path):
    calls = _fake_ncu(monkeypatch, [("", "==ERROR== Failed to find metric sm__pipe_tensor_op_gmma_cycles_active", 1),
                                    (FIXTURE.read_text(), "", 0)])
    result = ncu.profile_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert result.error is None and len(calls) == 2
    retried_metrics = calls[1][calls[1].index("--metrics") + 1].split(",")
    assert retried_metrics == list(ncu.CORE_METRICS)
    assert result.dropped_metrics == list(ncu.TENSOR_METRICS)


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
