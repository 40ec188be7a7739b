"""Every error is one line and a non-zero exit; `mpfa --debug` adds the Python traceback, and keeps the exit code."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.reports import tables as run_tables


def _registered_commands():
    yield from app.registered_commands
    for group in app.registered_groups:
        yield from group.typer_instance.registered_commands


@pytest.fixture
def broken_runs_table(monkeypatch):
    """`mpfa runs` raises what no code path expects."""

    def boom(runs, more=0):
        raise ZeroDivisionError("the table broke\nand said more")

    monkeypatch.setattr(run_tables, "runs_table", boom)


def _invoke(tmp_path, *args):
    return CliRunner().invoke(app, [*args, "runs", "--db", str(tmp_path / "results.db")], env={"COLUMNS": "200"})


def test_an_unexpected_exception_is_one_line_naming_it_and_suggesting_debug(tmp_path, broken_runs_table):
    result = _invoke(tmp_path)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error: unexpected ZeroDivisionError: the table broke (run `mpfa --debug ...` for the traceback)"]
    assert "Traceback" not in result.output


def test_debug_prints_the_traceback_then_the_line(tmp_path, broken_runs_table):
    result = _invoke(tmp_path, "--debug")
    assert result.exit_code == 1
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert "in boom" in result.stderr  # where it was raised
    assert result.stderr.strip().splitlines()[-1] == "error: unexpected ZeroDivisionError: the table broke"


def test_debug_shows_a_user_errors_traceback_with_its_exit_code(tmp_path):
    args = ["show", "7", "--db", str(tmp_path / "results.db")]
    plain = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    debug = CliRunner().invoke(app, ["--debug", *args], env={"COLUMNS": "200"})
    assert plain.exit_code == debug.exit_code == 2
    assert plain.stderr.strip().splitlines() == [debug.stderr.strip().splitlines()[-1]]
    assert "no run with id 7" in plain.stderr and "Traceback" not in plain.stderr
    assert "Traceback" in debug.stderr and "StoreError" in debug.stderr


def test_every_command_turns_errors_into_one_line():
    """Each command is wrapped by `common.cli_errors`, the one place errors become exit codes."""
    assert not [c.callback.__name__ for c in _registered_commands() if not hasattr(c.callback, "__wrapped__")]
