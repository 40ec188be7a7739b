"""`compare`, `runs` and `show` print per-point tables, or --wide the flat one, or --format json|csv|md."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.store import ResultStore


def mpfa(db: Path, *args: str):
    return CliRunner().invoke(app, [*args, "--db", str(db)], env={"COLUMNS": "100"})


@pytest.fixture
def db(tmp_path, make_run) -> Path:
    path = tmp_path / "r.db"
    runs = [make_run(b, rep, {"otps": otps + rep, "ttft_ms_median": 100.0 - rep})
            for b, otps in (("fa4-bf16", 1000.0), ("mpfa", 1500.0)) for rep in range(2)]
    with ResultStore(path) as store:
        store.import_runs(runs)
    return path


def test_compare_prints_one_table_per_point_and_wide_the_flat_one(db):
    narrow, wide = mpfa(db, "compare", "1", "2", "3", "4"), mpfa(db, "compare", "1", "2", "3", "4", "--wide")
    assert narrow.exit_code == 0 and wide.exit_code == 0, narrow.output + wide.output
    assert "paper · 16K input · c=8" in narrow.output and "OTPS (tok/s)" in narrow.output
    assert "mpfa speedup" in wide.output


@pytest.mark.parametrize("command", [["compare", "1", "2", "3", "4"], ["runs"], ["show", "1"]])
def test_json_and_csv_parse_and_md_is_a_table(db, command):
    as_json = mpfa(db, *command, "--format", "json")
    as_csv = mpfa(db, *command, "--format", "csv")
    as_md = mpfa(db, *command, "--format", "md")
    assert json.loads(as_json.stdout)
    assert list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert "|---" in as_md.output


def test_compare_json_holds_speedups(db):
    records = json.loads(mpfa(db, "compare", "1", "2", "3", "4", "--format", "json").stdout)
    otps = next(r for r in records if r["backend"] == "mpfa" and r["metric"] == "otps")
    assert otps["speedup"] == pytest.approx(1500.5 / 1000.5)


@pytest.mark.parametrize("command", [["compare"], ["runs"], ["show", "1"]])
def test_an_unknown_format_is_one_line(db, command):
    result = mpfa(db, *command, "--format", "xml")
    assert result.exit_code == 2 and "--format: 'xml' is not one of table, json, csv, md" in result.output
