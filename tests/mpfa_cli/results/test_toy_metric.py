"""A metric declared through the registry alone reaches every report: a toy metric, registered for the test, is
summarised by `mpfa bench` on the simulator and found in `mpfa metrics --explain`, compare's table, the gate (a
baseline written, then judged: kept, and a regression when the baseline was better) and the export."""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.metrics import registry
from mpfa.mpfa_cli.results.metrics.registry import Report, RunValue

TOY = "toy_tokens_per_request"
OUTPUT_LEN = 8  # every simulated request produces this many tokens: the toy's value


@pytest.fixture
def toy_metric() -> Iterator[RunValue]:
    metric = registry.register(RunValue(
        name=TOY, header="toy", unit="tok/req", better="higher", shown=Report.COMPARE | Report.GATE,
        explanation="Toy: output tokens per successful request.",
        value=lambda run: sum(r.output_tokens for r in run.ok) / len(run.ok) if run.ok else None))
    yield metric
    del registry.METRICS[TOY]


def mpfa(*args: str | Path) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def db(tmp_path: Path, toy_metric: RunValue) -> Path:
    """Two backends at one point, one repeat each, on the simulator, with the toy metric declared."""
    scenario = tmp_path / "toy.toml"
    scenario.write_text(f'model = "llama-3.1-8b"\ninput_len = 256\noutput_len = {OUTPUT_LEN}\nnum_requests = 4\n'
                        "warmup_requests = 0\nconcurrency = [2]\nrepeats = 1\nseed = 3\n")
    path = tmp_path / "results.db"
    mpfa("bench", "--scenario", scenario, "--engine", "sim", "--backend", "fa4-bf16,mpfa", "--db", path)
    return path


def remeasure(db: Path) -> None:
    """The same bench again: the pass a gate judges against a baseline written from the first."""
    mpfa("bench", "--scenario", db.parent / "toy.toml", "--engine", "sim", "--backend", "fa4-bf16,mpfa", "--db", db)


def test_a_toy_metric_reaches_explain_compare_gate_and_export(db: Path, tmp_path: Path) -> None:
    assert f"{TOY} (tok/req; higher is better): Toy: output tokens per successful request." in mpfa(
        "metrics", "--explain")

    assert "toy (tok/req)" in mpfa("compare", "--db", db)
    compared = json.loads(mpfa("compare", "--db", db, "--format", "json"))
    assert {(r["backend"], r["mean"], r["speedup"]) for r in compared if r["metric"] == TOY} == {
        ("fa4-bf16", OUTPUT_LEN, None), ("mpfa", OUTPUT_LEN, 1.0)}

    baseline = tmp_path / "baseline.json"
    mpfa("gate", "--write-baseline", "--baseline", baseline, "--db", db)
    entries = [e for e in json.loads(baseline.read_text())["entries"] if e["metric"] == TOY]
    assert [(e["backend"], e["mean"], e["higher_is_better"]) for e in entries] == [
        ("fa4-bf16", OUTPUT_LEN, True), ("mpfa", OUTPUT_LEN, True)]
    remeasure(db)
    kept = mpfa("gate", "--baseline", baseline, "--db", db, "--verbose")
    assert kept.count("toy (tok/req)") == 2 and kept.startswith("Gate passed")

    doc = json.loads(baseline.read_text())
    for entry in doc["entries"]:
        if entry["metric"] == TOY:
            entry["mean"] = 2.0 * OUTPUT_LEN  # the baseline did twice better: the toy regressed by 50%
    baseline.write_text(json.dumps(doc))
    judged = CliRunner().invoke(app, ["gate", "--baseline", str(baseline), "--db", str(db)], env={"COLUMNS": "250"})
    assert judged.exit_code == 1 and judged.stdout.startswith("Gate FAILED: 2 of 2 point(s): 2 regression(s)")
    assert sum("toy (tok/req)" in line and "regression" in line for line in judged.stdout.splitlines()) == 2

    ids = [str(run["id"]) for run in json.loads(mpfa("runs", "--db", db, "--format", "json"))][:2]
    exported = json.loads(mpfa("export", "--db", db, "--requests", *ids))["runs"]
    assert [run["summary"][TOY] for run in exported] == [OUTPUT_LEN, OUTPUT_LEN]
    rows = list(csv.DictReader(io.StringIO(mpfa("export", "--db", db, "--format", "csv", *ids))))
    assert [float(row[TOY]) for row in rows] == [OUTPUT_LEN, OUTPUT_LEN]
