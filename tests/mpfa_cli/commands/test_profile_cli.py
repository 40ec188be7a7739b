"""`mpfa profile` argument errors are one line and exit 2; without a GPU it says so instead of crashing; `--ncu-full`
reaches the profiler and its tables are shown and stored."""
import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["profile", "histogram"], "unknown profile kind 'histogram'; valid: prefill, decode, serving"),
        (["profile", "prefill", "--heads", "3:2"], "must be a multiple of KV heads"),
        (["profile", "prefill", "--head-dim", "100"], "head-dim must be a multiple of 16, got 100"),
        (["profile", "decode", "--seq", "lots"], "lots"),
        (["profile", "serving", "--backend", "fa4-bf16,mpfa"], "profile serving takes one backend"),
        (["profile", "serving", "--backend", "fa9"], "unknown backend 'fa9'; valid:"),
    ],
)
def test_bad_profile_arguments(mpfa, args: list[str], message: str) -> None:
    result = mpfa(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_kernel_profile_without_gpu_is_a_clear_error(mpfa) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = mpfa("profile", "decode", "--seq", "1k")
    assert result.returncode == 2 and "no CUDA device" in result.stderr


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
