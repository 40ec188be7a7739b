"""`mpfa compare --accuracy` and `mpfa plot --accuracy`: stored `mpfa accuracy task` results as a table and a figure."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.accuracy.plot import ACCURACY_PANEL_SIZE
from mpfa.mpfa_cli.reports.plot import DPI
from mpfa.mpfa_cli.results.store import ResultStore
from mpfa.mpfa_cli.accuracy.tasks.task_report import TaskAccuracyReport, TaskScores

VARIANTS = ("bf16", "fp8", "qk4-pv8-direct", "mpfa")


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def _report(model: str, squad: tuple[float, ...], siqa: tuple[float, ...]) -> TaskAccuracyReport:
    tasks = []
    for name, primary, scores in (("squad", "f1", squad), ("social_iqa", "grade", siqa)):
        task = TaskScores(name, primary, 200)
        for variant, score in zip(VARIANTS, scores):
            task.metrics[variant] = {primary: score, "same_as_bf16": 1.0 if variant == "bf16" else 0.5}
        tasks.append(task)
    return TaskAccuracyReport(model, "cuda", {"variants": list(VARIANTS), "tasks": ["squad", "social_iqa"]}, tasks)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Results 1 (older) and 2 (newest) are accuracy-task results, 3 a profile of another kind."""
    path = tmp_path / "r.db"
    with ResultStore(path) as store:
        for report in (_report("older", (0.8, 0.78, 0.1, 0.7), (0.5, 0.5, 0.3, 0.5)),
                       _report("tiny", (0.829, 0.781, 0.074, 0.809), (0.535, 0.51, 0.315, 0.56))):
            store.add_profile("accuracy-task", report.device, {**report.params, "model": report.model},
                              report.to_json())
        store.add_profile("prefill", "H200", {"seq": 65536}, {"rows": []})
    return path


def test_compare_accuracy_prints_the_newest_result_by_default(db):
    result = mpfa("compare", "--accuracy", "--db", db)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Task accuracy (tiny, cuda" in out and "older" not in out
    assert "82.9" in out and "7.4 (-75.5)" in out and "80.9 (-2.0)" in out and "97.4%" in out  # squad
    assert "56.0 (+2.5)" in out and "111.4%" in out  # social_iqa: recovery above 100% is shown as it is


def test_compare_accuracy_prints_each_result_named(db):
    result = mpfa("compare", "--accuracy", "1", "2", "--db", db)
    assert result.exit_code == 0, result.output
    assert "Task accuracy (older" in result.output and "Task accuracy (tiny" in result.output
    assert "85.7%" in result.output  # older squad: (0.7 - 0.1) / 0.7 of the direct loss recovered


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_accuracy_writes_one_panel_per_task(db, tmp_path):
    out = tmp_path / "figs" / "acc.png"
    result = mpfa("plot", "--accuracy", "2", "-o", out, "--db", db)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output.replace("\n", "")
    assert out.stat().st_size > 10_000
    width, height = ACCURACY_PANEL_SIZE
    assert _png_size(out) == (round(2 * width * DPI), round(height * DPI))  # two tasks side by side


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("compare", "--accuracy", "9"), "no profile with id 9"),
        (("plot", "--accuracy", "9"), "no profile with id 9"),
        (("compare", "--accuracy", "3"), "not accuracy-task or accuracy-serve results: 3 (a prefill result)"),
        (("plot", "--accuracy", "3"), "not accuracy-task or accuracy-serve results: 3 (a prefill result)"),
        (("plot", "--accuracy", "1", "2"), "one result at a time"),
        (("compare", "--accuracy", "--scenario", "smoke"), "--scenario"),
    ],
)
def test_accuracy_errors_are_one_line(db, tmp_path, args, message):
    output = ["-o", tmp_path / "x.png"] if args[0] == "plot" else []
    result = mpfa(*args, *output, "--db", db)
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("command", ["compare", "plot"])
def test_accuracy_without_results_says_so(tmp_path, command):
    empty = tmp_path / "empty.db"
    output = ["-o", tmp_path / "x.png"] if command == "plot" else []
    result = mpfa(command, "--accuracy", *output, "--db", empty)
    assert result.exit_code == 2
    assert "no accuracy-task or accuracy-serve results in" in result.output and "mpfa accuracy serve" in result.output
    assert len(result.output.strip().splitlines()) == 1
