"""`mpfa profile prefill|decode --ncu-full`: one `--set full` run exported to a report, then its details and source
pages printed from it; a faked ncu answering with a real H200 capture, the bound summaries side by side, the hot
loops, and per-backend failures (a failed source page keeps the bound summary)."""
import io
import sys
from pathlib import Path

from rich.console import Console

from mpfa.profiles import ncu
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.ncu_details import profile_full_with_ncu
from mpfa.profiles.profile_sections import LOG_WIDTH, ncu_full_section, ncu_source_section, render_sections
from mpfa.profiles.registry import adapter_for
from mpfa.profiles.profile_result import NcuFullResult, Peaks, ProfileResult

PERMISSION = ("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
              "Counters on the target device 0.")
WORKLOAD = AttentionWorkload("prefill", 16384, 1, 32, 8, 128)


def _rendered(results: list[NcuFullResult]) -> str:
    result = ProfileResult(WORKLOAD, "fa4-bf16", "Fake GPU", {}, Peaks(), [], ncu_full=results)
    console = Console(record=True, width=LOG_WIDTH, file=io.StringIO())
    render_sections([ncu_full_section(result), ncu_source_section(results)], console)
    return console.export_text()


def test_export_command_line():
    command = ncu.export_command("/opt/ncu", "A|B", 3, Path("/out/ncu-full-mpfa"), ["python", "-m", "x"])
    joined = " ".join(command)
    for part in ("--clock-control none", "--target-processes all", "--kernel-name-base demangled",
                 "--kernel-name regex:A|B", "--launch-skip 3", "--launch-count 1", "--set full", "--import-source no",
                 "--export /out/ncu-full-mpfa", "--force-overwrite"):
        assert part in joined
    assert not {"--metrics", "--csv", "--page", "raw"} & set(command)
    assert command[0] == "/opt/ncu" and command[-3:] == ["python", "-m", "x"]


def test_import_command_lines():
    report = Path("/out/ncu-full-mpfa.ncu-rep")
    assert ncu.import_command("/opt/ncu", report, ncu.DETAILS_PAGE) == [
        "/opt/ncu", "--import", str(report), "--csv", "--page", "details", "--print-units", "base"]
    assert ncu.import_command("/opt/ncu", report, ncu.SOURCE_PAGE) == [
        "/opt/ncu", "--import", str(report), "--csv", "--page", "source", "--print-source", "sass"]


def test_full_run_keeps_both_pages_and_summarises_the_kernel(fake_ncu_full, producer_pages, tmp_path):
    calls = fake_ncu_full({"mpfa": {"export": "==PROF== Disconnected from process 885", **producer_pages}})
    adapter = adapter_for("mpfa")
    result = profile_full_with_ncu(adapter, WORKLOAD, tmp_path)
    assert result.error is None and result.loops_error is None
    profiled, details, source = calls
    assert result.command == profiled
    assert profiled[profiled.index("--kernel-name") + 1] == f"regex:{adapter.kernel_regex}"
    assert profiled[profiled.index("--launch-skip") + 1] == str(ncu.WARMUP_LAUNCHES)
    assert profiled[profiled.index("--export") + 1] == str(tmp_path / "ncu-full-mpfa")
    assert "--metrics" not in profiled and "--page" not in profiled and {"--set", "full"} <= set(profiled)
    target = profiled[profiled.index(sys.executable):]
    assert target[1:3] == ["-m", "mpfa.profiles.launch_one"] and "--set" not in target
    report = str(tmp_path / "ncu-full-mpfa.ncu-rep")
    assert details == ["/fake/ncu", "--import", report, "--csv", *ncu.DETAILS_PAGE]
    assert source == ["/fake/ncu", "--import", report, "--csv", *ncu.SOURCE_PAGE]
    assert (tmp_path / "ncu-full-mpfa.csv").read_text() == producer_pages["details"]
    assert (tmp_path / "ncu-source-mpfa.csv").read_text() == producer_pages["source"]

    [summary] = result.kernels
    assert "PrefillSm90WgmmaWs" in summary.kernel
    facts = dict(summary.rows)
    assert facts["issue slots busy"] == "58.77%" and facts["eligible warps per scheduler"] == "1.00"
    [kernel] = result.loops
    assert kernel.kernel == summary.kernel
    assert [loop.rows for loop in kernel.loops] == [(1439, 1872), (2955, 3366)]


def test_a_failed_source_page_keeps_the_bound_summary(fake_ncu_full, producer_pages, tmp_path):
    fake_ncu_full({"mpfa": {"export": "", "details": producer_pages["details"]}})
    result = profile_full_with_ncu(adapter_for("mpfa"), WORKLOAD, tmp_path)
    assert result.error is None and dict(result.kernels[0].rows)["issue slots busy"] == "58.77%"
    assert result.loops == [] and "\n" not in result.loops_error
    assert result.loops_error.startswith("ncu could not print the source page of ncu-full-mpfa.ncu-rep: ")
    assert "the fake report has no source page" in result.loops_error

    fake_ncu_full({"mpfa": {"export": "", "details": producer_pages["details"], "source": producer_pages["details"]}})
    result = profile_full_with_ncu(adapter_for("mpfa"), WORKLOAD, tmp_path)
    assert result.kernels and result.loops == []
    assert result.loops_error == ("the source page of ncu-full-mpfa.ncu-rep: not an ncu source page: it does not "
                                  'start with a "Kernel Name" row')
    text = _rendered([result])
    assert "58.77%" in text and "error: the source page of ncu-full-mpfa.ncu-rep" in text


def test_a_failed_run_leaves_no_old_report_to_read(fake_ncu_full, producer_pages, tmp_path):
    (tmp_path / "ncu-full-mpfa.ncu-rep").write_bytes(b"an earlier report")
    failed = "==ERROR== The application returned an error code (1)."
    calls = fake_ncu_full({"mpfa": {"export": failed, **producer_pages}})
    result = profile_full_with_ncu(adapter_for("mpfa"), WORKLOAD, tmp_path)
    assert len(calls) == 1 and result.kernels == [] and result.loops == []
    assert result.error == "ncu produced no report: ==ERROR== The application returned an error code (1)."
    assert not (tmp_path / "ncu-full-mpfa.ncu-rep").exists()


def test_side_by_side_tables_with_one_backend_failing(fake_ncu_full, producer_pages, tmp_path):
    fake_ncu_full({"fa4-bf16": {"export": PERMISSION}, "mpfa": {"export": "", **producer_pages}})
    results = [profile_full_with_ncu(adapter_for(name), WORKLOAD, tmp_path) for name in ("fa4-bf16", "mpfa")]
    failed, filled = results
    assert "ERR_NVGPUCTRPERM" in failed.error and failed.kernels == [] and failed.loops == []
    assert filled.error is None and not (tmp_path / "ncu-full-fa4-bf16.csv").exists()

    section = ncu_full_section(ProfileResult(WORKLOAD, "fa4-bf16", "Fake GPU", {}, Peaks(), [], ncu_full=results))
    assert section.headers == ["fact", "fa4-bf16", "mpfa"]
    first, *facts = section.rows
    assert first[0] == "kernel" and first[1].startswith("error: ncu may not read the GPU performance counters")
    assert "PrefillSm90WgmmaWs" in first[2]
    assert [row[0] for row in facts][:3] == ["launch", "duration", "SM (compute) throughput"]
    assert all(row[1] == "-" for row in facts) and all(row[2] not in ("-", "n/a") for row in facts)

    loops = ncu_source_section(results)
    assert loops.headers == ["backend", "loop", "instructions", "executions", "% of samples", "top stall reasons",
                             "scoreboard waits on", "hottest instructions"]
    error, producer, consumer, rest = loops.rows
    assert error == ["fa4-bf16", f"error: {failed.error}", "-", "-", "-", "-", "-", "-"]
    assert producer[:5] == ["mpfa", "rows 1439-1872 (+0x59f0..+0x7500)", "434", "2,088,960", "32.2"]
    assert consumer[:5] == ["mpfa", "rows 2955-3366 (+0xb8b0..+0xd260)", "412", "4,177,920", "63.6"]
    assert consumer[5] == "selected 20%, barrier 16%, not_selected 15%, wait 15%"
    assert consumer[6] == "SYNCS.PHASECHK 8%, LDS.U16 2%, SHFL.BFLY 1%"  # the stages' mbarrier tests
    assert consumer[7].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0 (8.2% barrier); ")
    assert rest[:5] == ["mpfa", "rest", "2,866", "-", "4.2"]

    text = _rendered(results)
    assert "what bounds each kernel" in text and "ERR_NVGPUCTRPERM" in text
    assert "registers and shared memory: 1 blocks per SM" in text and "14.4-way" in text
    assert text.index("where each kernel's warps wait") > text.index("what bounds each kernel")
    assert "short_sb 32%" in text and "552,379 warp samples" in text


def test_missing_ncu_is_a_per_backend_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    result = profile_full_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert result.error.startswith("ncu not found on PATH") and "\n" not in result.error
    assert result.command == [] and "ncu not found" in _rendered([result])
