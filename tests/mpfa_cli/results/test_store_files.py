"""The results database is created owner-only and never opened through a symbolic link; only its default location's
folder is created, so a mistyped --db is an error, not a new database nobody looks for."""
from __future__ import annotations

import stat

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.records import RequestRecord, RunRecord
from mpfa.mpfa_cli.results.store import ResultStore


def mpfa(*args, **env: str):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250", **env})


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _one_line_error(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert all(word in result.output for word in words), result.output


def test_a_new_database_and_its_wal_files_are_owner_only(tmp_path):
    db = tmp_path / "r.db"
    with ResultStore(db) as store:
        run_id = store.begin_run(RunRecord("smoke", "mpfa", "sim", True, {"concurrency": 1}, 0, 64, 4, 1, 0, "h", 1.0))
        store.add_request(run_id, RequestRecord(0, 64, 4, 0.0, chunk_s=[0.1], chunk_tokens=[4], completion_s=0.2,
                                                output_tokens=4))
        assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {"r.db": 0o600, "r.db-wal": 0o600, "r.db-shm": 0o600}


def test_the_default_location_is_created_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv("MPFA_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    with ResultStore() as store:
        assert store.path == tmp_path / "data" / "mpfa" / "results.db"
    assert _mode(tmp_path / "data" / "mpfa") == 0o700 and _mode(store.path) == 0o600


@pytest.mark.parametrize("given_as", ["--db", "MPFA_DB"])
def test_a_database_in_a_folder_that_does_not_exist_is_one_line(tmp_path, given_as):
    db = tmp_path / "typo" / "results.db"
    result = mpfa("runs", "--db", db) if given_as == "--db" else mpfa("runs", MPFA_DB=str(db))
    _one_line_error(result, f"cannot open results database {db}: its folder {db.parent} does not exist")
    assert not db.parent.exists()


@pytest.mark.parametrize("dangling", [False, True], ids=["link to a file", "dangling link"])
def test_a_database_path_that_is_a_symbolic_link_is_refused(tmp_path, dangling):
    target = tmp_path / "victim"
    if not dangling:
        target.write_text("not yours to overwrite")
    link = tmp_path / "results.db"
    link.symlink_to(target)
    for command in (["runs"], ["show", "1"], ["export"]):
        _one_line_error(mpfa(*command, "--db", link), f"results database {link} is a symbolic link")
    assert target.read_text() == "not yours to overwrite" if not dangling else not target.exists()
    with pytest.raises(UserError, match="symbolic link"):
        ResultStore(link)
