"""One bad record does not break the database's commands: names with Rich markup or terminal escape sequences are
shown as written, a `kernels` that is not a mapping shows as unreadable, CSV cells that a spreadsheet would run as
formulas are made inert, a scenario file `smoke[v2].toml` is listed by its name, and `mpfa export | head -c 100`
ends quietly."""
from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.store import ResultStore

HOSTILE = ("paper[/x]", "[bold]loud", "esc\x1b[2Jcleared", "=HYPERLINK(\"http://evil\",\"x\")")


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


@pytest.fixture
def hostile_db(tmp_path, make_run) -> Path:
    """Runs whose scenario (and error) are hostile strings, each a run that finished ok."""
    db = tmp_path / "r.db"
    with ResultStore(db) as store:
        store.import_runs([make_run("mpfa", 0, {"otps": 1.0}, scenario=name, error=name, started_at=1.7e9 + i)
                           for i, name in enumerate(HOSTILE)])
    return db


def test_runs_show_and_compare_print_hostile_names_as_written(hostile_db):
    listed = mpfa("runs", "--db", hostile_db)
    assert listed.exit_code == 0, listed.output
    assert "paper[/x]" in listed.stdout and "[bold]loud" in listed.stdout and "\x1b" not in listed.stdout
    assert "esc\\x1b[2Jcleared" in listed.stdout
    for run_id, name in enumerate(HOSTILE, start=1):
        shown = mpfa("show", str(run_id), "--db", hostile_db)
        assert shown.exit_code == 0 and "\x1b" not in shown.stdout, shown.output
        assert name.replace("\x1b", "\\x1b") in shown.stdout
        compared = mpfa("compare", str(run_id), "--db", hostile_db)
        assert compared.exit_code == 0 and name.replace("\x1b", "\\x1b") in compared.stdout, compared.output
    assert mpfa("runs", "--db", hostile_db).exit_code == 0  # and every later call still works


def test_a_kernels_value_that_is_not_a_mapping_does_not_break_show(hostile_db):
    with sqlite3.connect(hostile_db) as conn:
        conn.execute("UPDATE runs SET kernels = ? WHERE id = 1", (json.dumps("fa3"),))
    shown = mpfa("show", "1", "--db", hostile_db)
    assert shown.exit_code == 0 and 'unreadable ("fa3")' in shown.stdout, shown.output
    assert mpfa("show", "1", "--format", "json", "--db", hostile_db).exit_code == 0


def test_csv_cells_that_would_run_as_formulas_are_inert(hostile_db):
    for command in (("export", "--format", "csv"), ("runs", "--format", "csv")):
        result = mpfa(*command, "--db", hostile_db)
        assert result.exit_code == 0, result.output
        cells = [cell for row in csv.reader(io.StringIO(result.stdout)) for cell in row]
        assert "'=HYPERLINK(\"http://evil\",\"x\")" in cells, command
        assert not any(cell[:1] in "=+@" for cell in cells if cell), command
        assert not any(cell.startswith("-") and not cell[1:2].isdigit() for cell in cells), command


def test_a_scenario_file_with_brackets_is_listed_by_its_name(tmp_path, monkeypatch):
    from mpfa.mpfa_cli.harness import scenario

    bundled = Path(scenario.SCENARIO_DIR)
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "smoke[v2].toml").write_text((bundled / "smoke.toml").read_text())
    monkeypatch.setattr(scenario, "SCENARIO_DIR", folder)
    listed = mpfa("scenarios")
    assert listed.exit_code == 0 and "smoke[v2]" in listed.stdout, listed.output


def test_export_into_a_closed_pipe_ends_quietly(hostile_db, tmp_path, make_run):
    """`mpfa export | head -c 100`: the reader leaves after 100 bytes; mpfa stops with the shell's SIGPIPE status
    (141) and nothing on stderr, never a BrokenPipe traceback."""
    with ResultStore(hostile_db) as store:
        store.import_runs([make_run("fa4-bf16", 0, {"otps": float(i)}, started_at=1.8e9 + i) for i in range(300)])
    every = " ".join(map(str, range(1, 305)))  # ~300 KB: more than a pipe's buffer
    command = (f"{sys.executable} -m mpfa.mpfa_cli export {every} --db {hostile_db} | head -c 100 >/dev/null; "
               "echo \"${PIPESTATUS[0]}\"")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.stderr == "" and done.stdout.strip() == "141", done


def test_a_kernels_value_that_is_not_a_mapping_does_not_break_a_csv_export(hostile_db):
    with sqlite3.connect(hostile_db) as conn:
        conn.execute("UPDATE runs SET kernels = ? WHERE id = 1", (json.dumps("fa3"),))
    result = mpfa("export", "1", "--format", "csv", "--db", hostile_db)
    assert result.exit_code == 0, result.output
    assert next(csv.DictReader(io.StringIO(result.stdout)))["kernels"] == 'unreadable ("fa3")'
