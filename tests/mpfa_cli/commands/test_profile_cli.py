"""`mpfa profile`: argument errors are one line and exit 2; without a GPU it says so instead of crashing; the
options reach the profilers (run_profile, run_bench faked) and `--ncu-full`'s tables are shown and stored; the
Nsight Compute pages read back; the load client's overhead against the simulator."""
import gzip
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app

FIXTURES = Path(__file__).parents[2] / "fixtures"
# Real ncu output from the H200 (`--set full`, then `--import R --csv --page details` or `--page source`).
ONE_WARPGROUP = FIXTURES / "profiles" / "ncu-details-prefill-16k-mpfa-one-warpgroup-h200.csv"
PRODUCER_SOURCE = FIXTURES / "ncu-source-prefill-16k-mpfa-producer-warpgroup-h200.csv.gz"
PRODUCER_DETAILS = FIXTURES / "ncu-details-prefill-16k-mpfa-producer-warpgroup-h200.csv"
LANE_MAJOR_V_SOURCE = FIXTURES / "ncu-source-decode-128k-b8-mpfa-split-kv-lane-major-v-h200.csv.gz"
RAW_PAGE = FIXTURES / "profiles" / "ncu_h200_prefill64k_fa4.csv"  # `mpfa profile prefill --ncu`'s raw page


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["profile", "histogram"], "No such command 'histogram'"),
        (["profile", "prefill", "--heads", "3:2"], "must be a multiple of KV heads"),
        (["profile", "prefill", "--head-dim", "100"], "head-dim must be a multiple of 16, got 100"),
        (["profile", "prefill", "--heads", "32-8"], "bad heads '32-8'"),
        (["profile", "prefill", "--backend", "fa4"], "unknown backend 'fa4'"),
        (["profile", "decode", "--seq", "lots"], "lots"),
        (["profile", "decode", "--head-dim", "100"], "head-dim must be a multiple of 16, got 100"),
        (["profile", "characterize", "--head-dim", "64"], "No such option: --head-dim"),
        (["profile", "sweep", "train"], "unknown sweep kind 'train'; valid: prefill, decode"),
        (["profile", "sweep", "decode", "--batch", "1,0"], "--batch: batch sizes must be positive, got 1,0"),
        (["profile", "sweep", "decode", "--batch", "one"], "--batch: expected comma-separated int values"),
        (["profile", "sweep", "prefill", "--seq", "16k,lots"], "bad sequence length 'lots'"),
        (["profile", "sweep", "prefill", "--backend", "fa9"], "unknown backend 'fa9'"),
        (["profile", "serving"], "Missing option '--backend'"),
        (["profile", "serving", "--backend", "fa4-bf16,mpfa"], "profile serving takes one backend"),
        (["profile", "serving", "--backend", "fa9"], "unknown backend 'fa9'; valid:"),
        (["profile", "serving", "--backend", "fa4-bf16", "--trim-events", "-1"], "--trim-events must be >= 0, got -1"),
        (["profile", "client-overhead", "--streams", "8", "--requests", "4"],
         "--requests (4) must be at least --streams (8)"),
        (["profile", "client-overhead", "--runs", "0"], "--runs must be >= 1, got 0"),
        (["profile", "client-overhead", "--backend", "fa9"], "unknown backend 'fa9'; valid:"),
        (["profile", "ncu-details"], "Missing argument 'FILE'"),
    ],
)
def test_bad_profile_arguments(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stdout == ""


def test_kernel_profile_without_gpu_is_a_clear_error(mpfa) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = mpfa("profile", "decode", "--seq", "1k")
    assert result.returncode == 2 and "no CUDA device" in result.stderr


def test_sweep_without_gpu_is_a_clear_error(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("profile", "sweep", "prefill", "--seq", "1k")
    assert result.exit_code == 2 and result.stderr == "error: no CUDA device: the kernel benchmark runs on a GPU\n"


def test_ncu_full_flag_reaches_run_profile_and_its_table_is_shown_and_stored(monkeypatch, tmp_path) -> None:
    """`--ncu-full` without `--ncu`, run_profile faked (no GPU): the flag reaches it, the side-by-side table and the
    hot loops are printed and both are stored with the profile."""
    from typer.testing import CliRunner

    from mpfa.mpfa_cli.app import app
    from mpfa.mpfa_cli.results.store import ResultStore
    from mpfa.profiles import microbench
    from mpfa.profiles.attention_workload import AttentionWorkload
    from mpfa.profiles.profile_result import (NcuBoundSummary, NcuFullResult, NcuHotInstruction, NcuKernelLoops,
                                              NcuLoop, Peaks, ProfileResult)

    calls = []

    def run_profile(kind, seq, batch, heads, head_dim, backends, ncu, nsys, out_dir, progress=None, ncu_full=False):
        calls.append({"ncu": ncu, "ncu_full": ncu_full, "backends": backends})
        hot = NcuHotInstruction("WARPGROUP.DEPBAR.LE gsb0, 0x0", 8.2, "barrier")
        loops = NcuKernelLoops("PrefillSm90Wgmma", 1000, [
            NcuLoop((2955, 3366), (0xb8b0, 0xd260), 412, 4_177_920, 63.6, [("selected", 19.8)], [hot])],
            NcuLoop(None, None, 3300, None, 36.4, [("long_sb", 22.0)], []))
        full = [NcuFullResult("fa4-bf16", [], error="ncu not found on PATH or in $CUDA_HOME/bin"),
                NcuFullResult("mpfa", [], [NcuBoundSummary("PrefillSm90Wgmma", [("issue slots busy", "45.45%")])],
                              loops=[loops])]
        return ProfileResult(AttentionWorkload(kind, seq, batch, *heads, head_dim), "fa4-bf16", "Fake GPU", {},
                             Peaks(), [], ncu_full=full)

    monkeypatch.setattr(microbench, "run_profile", run_profile)
    db = tmp_path / "r.db"
    result = CliRunner().invoke(app, ["profile", "prefill", "--seq", "1k", "--backend", "fa4-bf16,mpfa",
                                      "--ncu-full", "--db", str(db), "--out", str(tmp_path)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert calls == [{"ncu": False, "ncu_full": True, "backends": ["fa4-bf16", "mpfa"]}]
    assert "what bounds each kernel" in result.output and "45.45%" in result.output
    assert "error: ncu not found on PATH" in result.output
    assert "where each kernel's warps wait" in result.output and "rows 2955-3366" in result.output
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0 (8.2% barrier)" in result.output
    with ResultStore(db) as store:
        [stored] = store.list_profiles("prefill")
    assert stored.result["ncu_full"][1]["kernels"][0]["rows"] == [["issue slots busy", "45.45%"]]
    [stored_loops] = stored.result["ncu_full"][1]["loops"]
    assert stored_loops["loops"][0]["rows"] == [2955, 3366] and stored_loops["loops"][0]["executions"] == 4_177_920
    assert stored_loops["loops"][0]["hottest"][0]["reason"] == "barrier" and stored_loops["rest"]["rows"] is None


@pytest.mark.parametrize(("args", "expected"), [
    (["prefill"], {"kind": "prefill", "seq": 65536, "batch": 1, "heads": (32, 8), "head_dim": 128,
                   "backends": ["fa3-fp8", "fa4-bf16", "flashinfer-fp8", "mpfa"]}),
    (["decode", "--seq", "32k", "--batch", "8", "--heads", "40:8", "--head-dim", "64", "-b", "fa4-bf16,fa3-fp8"],
     {"kind": "decode", "seq": 32768, "batch": 8, "heads": (40, 8), "head_dim": 64,
      "backends": ["fa4-bf16", "fa3-fp8"]}),
], ids=["defaults", "options"])
def test_kernel_profile_options_reach_run_profile(monkeypatch, tmp_path, args, expected) -> None:
    """`--head-dim` among them: the shape every backend's inputs are built with."""
    from mpfa.profiles import microbench
    from mpfa.profiles.attention_workload import AttentionWorkload
    from mpfa.profiles.profile_result import Peaks, ProfileResult

    calls = []

    def run_profile(kind, seq, batch, heads, head_dim, backends, ncu, nsys, out_dir, progress=None, ncu_full=False):
        calls.append({"kind": kind, "seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim,
                      "backends": backends})
        return ProfileResult(AttentionWorkload(kind, seq, batch, *heads, head_dim), backends[0], "Fake GPU", {},
                             Peaks(), [])

    monkeypatch.setattr(microbench, "run_profile", run_profile)
    result = invoke("profile", *args, "--db", str(tmp_path / "r.db"), "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert calls == [expected] and "stored profile 1" in result.stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["decode"], ("decode", [8192, 32768, 131072], [1, 8], (32, 8), ["mpfa", "fa3-fp8", "flashinfer-fp8", "fa4-bf16"])),
    (["prefill"], ("prefill", [16384, 65536], [1], (32, 8), ["mpfa", "fa3-fp8", "flashinfer-fp8", "fa4-bf16"])),
    (["prefill", "--seq", "4k,1m", "--batch", "2,4", "--heads", "40:8", "-b", "fa4-bf16,mpfa-exact,fa4-bf16"],
     ("prefill", [4096, 1 << 20], [2, 4], (40, 8), ["fa4-bf16", "mpfa-exact"])),
], ids=["decode-defaults", "prefill-defaults", "options"])
def test_sweep_options_reach_the_benchmark_and_its_table_is_printed(monkeypatch, args, expected) -> None:
    from mpfa.profiles import bench_kernels

    calls = []

    def run_bench(kind, seqs, batches, heads, backends, say):
        calls.append((kind, seqs, batches, heads, backends))
        say("--- progress")
        return "the sweep's table"

    monkeypatch.setattr(bench_kernels, "run_bench", run_bench)
    result = invoke("profile", "sweep", *args)
    assert result.exit_code == 0, result.output
    assert calls == [expected]
    assert result.stdout == "the sweep's table\n" and result.stderr == "--- progress\n"


def test_ncu_details_prints_what_bounds_each_kernel_and_fails_in_one_line(tmp_path) -> None:
    done = invoke("profile", "ncu-details", str(ONE_WARPGROUP))
    assert done.exit_code == 0, done.output
    assert "kernel_cutlass_kernel_mpfakernelssm90prefill_wgmmaPrefillSm90Wgmma_object_at_..." in done.stdout
    assert "shared memory: 2 blocks per SM" in done.stdout and "10.2-way" in done.stdout
    missing = invoke("profile", "ncu-details", str(ONE_WARPGROUP), str(tmp_path / "absent.csv"))
    assert missing.exit_code == 2 and missing.stdout == ""
    assert missing.stderr == f"error: cannot read {tmp_path / 'absent.csv'}: No such file or directory\n"
    malformed = invoke("profile", "ncu-details", str(RAW_PAGE))
    assert malformed.exit_code == 2 and malformed.stderr.count("\n") == 1
    assert malformed.stderr.startswith(f"error: {RAW_PAGE}: not an ncu details page")


def test_ncu_source_prints_the_loops_of_plain_and_gzipped_pages(tmp_path) -> None:
    plain = tmp_path / "decode-source.csv"
    plain.write_text(gzip.decompress(LANE_MAJOR_V_SOURCE.read_bytes()).decode())
    done = invoke("profile", "ncu-source", str(PRODUCER_SOURCE), str(plain))
    assert done.exit_code == 0, done.output
    assert "where each kernel's warps wait" in done.stdout
    for text in ("rows 1439-1872", "rows 2955-3366", "4,177,920", "rows 1044-1689", "260,608", "552,379 warp samples",
                 "61,365 warp samples"):
        assert text in done.stdout


def test_ncu_source_fails_in_one_line(tmp_path) -> None:
    missing = invoke("profile", "ncu-source", str(PRODUCER_SOURCE), str(tmp_path / "absent.csv"))
    assert missing.exit_code == 2 and missing.stdout == ""
    assert missing.stderr == f"error: cannot read {tmp_path / 'absent.csv'}: No such file or directory\n"
    truncated = tmp_path / "cut.csv.gz"
    truncated.write_bytes(PRODUCER_SOURCE.read_bytes()[:1000])
    cut = invoke("profile", "ncu-source", str(truncated))
    assert cut.exit_code == 2 and cut.stderr.startswith(f"error: cannot read {truncated}: ")
    assert cut.stderr.count("\n") == 1
    malformed = invoke("profile", "ncu-source", str(PRODUCER_DETAILS))
    assert malformed.exit_code == 2
    assert malformed.stderr == (f'error: {PRODUCER_DETAILS}: not an ncu source page: it does not start with a '
                                f'"Kernel Name" row\n')


def test_client_overhead_against_the_simulator() -> None:
    """A small load, both clients, two runs: each run's table, the targets line and the p99s over runs."""
    done = invoke("profile", "client-overhead", "--streams", "4", "--requests", "8", "--input-len", "16",
                  "--output-len", "4", "--time-scale", "0.01", "--runs", "2", "--reference", "--incremental")
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("8 requests, 4 concurrent streams, 16 in / 4 out, sim fa4-bf16 x0.01, incremental")
    for run in (1, 2):
        assert f"run {run}, mpfa client:" in done.stdout and f"run {run}, reference client:" in done.stdout
    assert done.stdout.count("targets: TTFT: first-token client lag p99") == 2
    assert "p99 (ms) over 2 runs: best / median / worst" in done.stdout
