"""The gate's verdict: one summary line first, then only the regressions and missing points (every row with
--verbose), no cell cut at 80 or 100 columns, --format md|json, and SIMULATED where the runs are."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.store import ResultStore

LOAD = {"rate": 2.5, "burstiness": 1.0}
METRICS = {"otps": 1000.0, "ttft_ms_median": 1234.5, "tpot_ms_median": 12.25}


def mpfa(*args: str | Path, columns: int = 250):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns)})


def one_pass(make_run, backend: str, offset: float, scale: float = 1.0, **overrides) -> list:
    """Three repeats; `scale` < 1 slows them: OTPS times it, latencies divided by it."""
    slowed = {k: v * scale if k == "otps" else v / scale for k, v in METRICS.items()}
    return [make_run(backend, i, {k: v * (1 + 0.001 * i) for k, v in slowed.items()}, scenario="long128k",
                     input_len=131072, load=LOAD, started_at=1_700_000_000.0 + offset + i, **overrides)
            for i in range(3)]


@pytest.fixture
def judged(tmp_path, make_run):
    """A baseline of three backends, then a new pass: flashinfer-fp8 slowed (OTPS down, latencies up), fa4-bf16's
    runs failed, mpfa unchanged."""
    def write(simulated: bool) -> tuple[Path, Path]:
        db, baseline = tmp_path / f"r{simulated}.db", tmp_path / f"baseline{simulated}.json"
        backends = ("flashinfer-fp8", "fa4-bf16", "mpfa")
        with ResultStore(db) as store:
            store.import_runs([r for b in backends for r in one_pass(make_run, b, 0, simulated=simulated)])
        assert mpfa("gate", "--write-baseline", "--baseline", baseline, "--db", db).exit_code == 0
        with ResultStore(db) as store:
            store.import_runs(one_pass(make_run, "mpfa", 100, simulated=simulated)
                              + one_pass(make_run, "flashinfer-fp8", 100, scale=0.7, simulated=simulated)
                              + one_pass(make_run, "fa4-bf16", 100, status="failed", error="server died",
                                         simulated=simulated))
        return db, baseline
    return write


def test_the_summary_comes_first_and_only_failing_rows_follow(judged):
    db, baseline = judged(False)
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.exit_code == 1 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == ("Gate FAILED: 2 of 3 point(s): 3 regression(s) beyond 5.0%; 3 baseline entr(y/ies) missing, "
                        "failed or not re-measured (--allow-missing accepts that)")
    assert lines[1] == "long128k 128K rate=2.5/s · fa4-bf16" and lines[2].split() == [
        "metric", "baseline", "current", "change", "status", "why"]
    assert "· flashinfer-fp8" in result.stdout and "server died" in result.stdout and "· mpfa" not in result.stdout
    verbose = mpfa("gate", "--baseline", baseline, "--db", db, "--verbose")
    assert "· mpfa" in verbose.stdout and verbose.stdout.count(" ok ") == 3


def test_a_passing_gate_says_so_in_one_line(judged, make_run, tmp_path):
    db, baseline = judged(False)
    with ResultStore(db) as store:
        store.import_runs([r for b in ("flashinfer-fp8", "fa4-bf16") for r in one_pass(make_run, b, 200)])
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.exit_code == 0 and result.stdout == "Gate passed: 3 point(s), 9 metric(s) within 5.0% (95% CIs)\n"


def test_simulated_runs_are_labelled(judged):
    db, baseline = judged(True)
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.stdout.splitlines()[0].endswith("; SIMULATED")
    doc = json.loads(mpfa("gate", "--baseline", baseline, "--db", db, "--format", "json").stdout)
    assert doc["simulated"] is True and "SIMULATED" in doc["summary"]


@pytest.mark.parametrize("columns", [80, 100])
def test_no_cell_is_cut_at_80_or_100_columns(judged, columns):
    db, baseline = judged(True)
    result = mpfa("gate", "--baseline", baseline, "--db", db, "--verbose", columns=columns)
    body = result.stdout.splitlines()[1:]
    assert body and all(len(line) <= columns for line in body), result.stdout
    assert "…" not in result.stdout
    # Every word of every cell is whole on one line: what a cell holds, split only at its spaces.
    words = {word for line in body for word in line.split()}
    for expected in ("long128k", "128K", "rate=2.5/s", "flashinfer-fp8", "fa4-bf16", "regression", "failed",
                     "(tok/s)", "TTFT", "-30.0%", "+42.9%", "died", "1001", "1236", "12.26", "0.0304"):
        assert expected in words, (expected, result.stdout)


def test_format_md_and_json(judged):
    db, baseline = judged(False)
    md = mpfa("gate", "--baseline", baseline, "--db", db, "--format", "md")
    assert md.exit_code == 1 and md.stdout.startswith("**Gate FAILED: 2 of 3 point(s)")
    table = [line for line in md.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| scenario | context | load | backend | metric |") and len(table) == 1 + 6
    result = mpfa("gate", "--baseline", baseline, "--db", db, "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["passed"] is False and doc["summary"].startswith("Gate FAILED") and len(doc["checks"]) == 9
    assert {c["status"] for c in doc["checks"]} == {"ok", "regression", "failed"}
    bad = mpfa("gate", "--baseline", baseline, "--db", db, "--format", "csv")
    assert bad.exit_code == 2 and bad.stderr.strip() == "error: --format: 'csv' is not one of table, md, json"
