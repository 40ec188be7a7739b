"""`mpfa gate --benchmark-json PREFIX`: the gated metrics of the runs as github-action-benchmark files, one per
direction, beside the gate's verdict (or the baseline it writes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.store import ResultStore


def gate(*args: str | Path):
    return CliRunner().invoke(app, ["gate", *map(str, args)], env={"COLUMNS": "200"})


def test_benchmark_json_writes_bigger_and_smaller_is_better_files(tmp_path, make_run):
    db, baseline, prefix = tmp_path / "r.db", tmp_path / "baseline.json", tmp_path / "bench" / "h200"
    def one_pass(offset: float) -> list:
        return [make_run("mpfa", i, {"otps": otps, "ttft_ms_median": ttft}, started_at=1_700_000_000.0 + offset + i)
                for i, (otps, ttft) in enumerate([(1000, 50), (1002, 52), (998, 48)])]

    with ResultStore(db) as store:
        store.import_runs(one_pass(0))
    written = gate("--write-baseline", "--baseline", baseline, "--db", db, "--benchmark-json", prefix)
    assert written.exit_code == 0, written.output
    with ResultStore(db) as store:
        store.import_runs(one_pass(100))  # the re-measurement the gate judges
    judged = gate("--baseline", baseline, "--db", db, "--benchmark-json", f"{prefix}-again")
    assert judged.exit_code == 0, judged.output
    for name in ("h200", "h200-again"):
        bigger = json.loads((prefix.parent / f"{name}-bigger.json").read_text())
        smaller = json.loads((prefix.parent / f"{name}-smaller.json").read_text())
        assert [(e["name"].rsplit("/", 2)[1:], e["value"]) for e in bigger] == [(["mpfa", "otps"], pytest.approx(1000))]
        assert [(e["name"].rsplit("/", 2)[1:], e["value"]) for e in smaller] == [
            (["mpfa", "ttft_ms_median"], pytest.approx(50))]
        assert all(e["extra"].startswith("mean of 3 repeat(s)") and e["range"].startswith("± ") and e["unit"]
                   for e in bigger + smaller)
