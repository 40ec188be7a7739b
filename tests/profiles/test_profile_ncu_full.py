"""`mpfa profile --ncu-full`: the `--set full --page details` command line, a faked ncu answering with a real H200
capture, the side-by-side table of bound summaries, and per-backend failures."""
import io
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from mpfa.profiles import ncu
from mpfa.profiles.ncu_details import profile_full_with_ncu
from mpfa.profiles.registry import adapter_for
from mpfa.profiles.report import LOG_WIDTH, ncu_full_section, render_sections
from mpfa.profiles.results import NcuFullResult, Peaks, ProfileResult
from mpfa.profiles.workload import AttentionWorkload

FIXTURES = Path(__file__).parent / "fixtures"
DETAILS = FIXTURES / "ncu-details-prefill-v3-16k-h200.csv"  # real `--set full --csv --page details`, prefill v3
PERMISSION = ("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
              "Counters on the target device 0.")
WORKLOAD = AttentionWorkload("prefill", 16384, 1, 32, 8, 128)


def _fake_ncu(monkeypatch, answers: dict[str, tuple[str, str, int]]) -> list[list[str]]:
    """Make ncu 'found'; each run answers (stdout, stderr, returncode) by the backend it launches."""
    calls = []
    monkeypatch.setattr(ncu, "find_tool", lambda name: f"/fake/{name}")

    def run(command, timeout_s):
        calls.append(command)
        stdout, stderr, returncode = answers[command[command.index("--backend") + 1]]
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    monkeypatch.setattr(ncu, "run_tool", run)
    return calls


def _rendered(results: list[NcuFullResult]) -> str:
    result = ProfileResult(WORKLOAD, "fa4-bf16", "Fake GPU", {}, Peaks(), [], ncu_full=results)
    console = Console(record=True, width=LOG_WIDTH, file=io.StringIO())
    render_sections([ncu_full_section(result)], console)
    return console.export_text()


def test_details_command_line():
    command = ncu.ncu_command("/opt/ncu", "A|B", 3, None, ["python", "-m", "x"])
    joined = " ".join(command)
    for part in ("--clock-control none", "--target-processes all", "--kernel-name regex:A|B", "--launch-skip 3",
                 "--launch-count 1", "--csv", "--set full", "--page details"):
        assert part in joined
    assert "--metrics" not in command and "raw" not in command
    assert command[-3:] == ["python", "-m", "x"]


def test_full_run_keeps_the_csv_and_summarises_the_kernel(monkeypatch, tmp_path):
    capture = DETAILS.read_text()
    calls = _fake_ncu(monkeypatch, {"mpfa": (capture, "", 0)})
    adapter = adapter_for("mpfa")
    result = profile_full_with_ncu(adapter, WORKLOAD, tmp_path)
    assert result.error is None and result.command == calls[0]
    [command] = calls
    assert command[command.index("--kernel-name") + 1] == f"regex:{adapter.kernel_regex}"
    assert command[command.index("--launch-skip") + 1] == str(ncu.WARMUP_LAUNCHES)
    assert "--metrics" not in command and {"--set", "full", "--page", "details", "--csv"} <= set(command)
    target = command[command.index(sys.executable):]
    assert target[1:3] == ["-m", "mpfa.profiles.launch_one"] and "--set" not in target
    assert (tmp_path / "ncu-full-mpfa.csv").read_text() == capture
    [summary] = result.kernels
    assert "PrefillSm90Wgmma" in summary.kernel
    facts = dict(summary.rows)
    assert facts["issue slots busy"] == "45.45%" and facts["eligible warps per scheduler"] == "0.61"


def test_side_by_side_table_with_one_backend_failing(monkeypatch, tmp_path):
    _fake_ncu(monkeypatch, {"fa4-bf16": (PERMISSION, "", 1), "mpfa": (DETAILS.read_text(), "", 0)})
    results = [profile_full_with_ncu(adapter_for(name), WORKLOAD, tmp_path) for name in ("fa4-bf16", "mpfa")]
    failed, filled = results
    assert "ERR_NVGPUCTRPERM" in failed.error and failed.kernels == []
    assert filled.error is None and (tmp_path / "ncu-full-fa4-bf16.csv").read_text() == PERMISSION

    section = ncu_full_section(ProfileResult(WORKLOAD, "fa4-bf16", "Fake GPU", {}, Peaks(), [], ncu_full=results))
    assert section.headers == ["fact", "fa4-bf16", "mpfa"]
    first, *facts = section.rows
    assert first[0] == "kernel" and first[1].startswith("error: ncu may not read the GPU performance counters")
    assert "PrefillSm90Wgmma" in first[2]
    assert [row[0] for row in facts][:3] == ["launch", "duration", "SM (compute) throughput"]
    assert all(row[1] == "-" for row in facts) and all(row[2] not in ("-", "n/a") for row in facts)

    text = _rendered(results)
    assert "what bounds each kernel" in text and "ERR_NVGPUCTRPERM" in text
    assert "shared memory: 2 blocks per SM" in text and "10.2-way" in text


def test_missing_ncu_is_a_per_backend_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    result = profile_full_with_ncu(adapter_for("fa4-bf16"), WORKLOAD, tmp_path)
    assert result.error.startswith("ncu not found on PATH") and "\n" not in result.error
    assert result.command == [] and "ncu not found" in _rendered([result])
