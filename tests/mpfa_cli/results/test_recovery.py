"""Recovery files: what a bench could not store, read back by `mpfa import`, which completes the unfinished copy of
a run in the database with the requests it lacks."""
from __future__ import annotations

import dataclasses
import json
import stat

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.records import RunRecord
from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.results.recovery import UNCLOSED_REASON, RecoveryFile, read_recovery, read_runs_file
from mpfa.mpfa_cli.results.run_owner import KILLED_REASON
from mpfa.mpfa_cli.results.store import ResultStore


def mpfa(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def _run(make_run, num_requests: int = 16) -> RunRecord:
    """A running fa4-bf16 run of `num_requests` measured requests (an ok one must hold them all)."""
    stored = make_run("fa4-bf16", num_requests=num_requests)
    return RunRecord(**{f.name: getattr(stored, f.name) for f in dataclasses.fields(RunRecord)} | {"status": "running"})


def _recovery(tmp_path, run: RunRecord, requests, end: str | None = "ok") -> RecoveryFile:
    recovery = RecoveryFile([tmp_path / "gone", tmp_path], "results")
    recovery.add_run(run)
    recovery.add_requests(run.id, requests)
    if end:
        recovery.end_run(run.id, end, None, summarize(requests))
    recovery.close()
    return recovery


def test_a_recovery_file_is_owner_only_in_the_first_folder_there_and_reads_back(tmp_path, make_run, random_requests):
    run, requests = _run(make_run, num_requests=5), random_requests(7)[:6]
    run.id = 7
    recovery = _recovery(tmp_path, run, requests + requests[:2])  # a request written twice is one request
    assert recovery.path.parent == tmp_path and stat.S_IMODE(recovery.path.stat().st_mode) == 0o600
    (back,) = read_runs_file(recovery.path)
    assert (back.id, back.status, back.requests) == (7, "ok", requests)
    assert back.started_at == run.started_at


def test_a_run_without_its_end_reads_back_interrupted(tmp_path, make_run, random_requests):
    run = _run(make_run)
    run.id = 1
    (back,) = read_recovery(_recovery(tmp_path, run, random_requests(3), end=None).path)
    assert (back.status, back.error, len(back.requests)) == ("interrupted", UNCLOSED_REASON, 3)


@pytest.mark.parametrize(("line", "words"), [
    ('["not", "an", "object"]', "line 3 is not a recovery line"),
    ('{"request": {"index": 0}}', "line 3 is not a recovery line"),
    ('{"run_id": 99, "end": {"status": "ok"}}', "holds requests or ends of run(s) [99] without their run"),
    ('{"run_id": 1, "request": {"index": 0, "dispatch_s": "soon"}}', "is not a valid recovery file"),
])
def test_a_bad_recovery_line_is_one_line_naming_the_file(tmp_path, make_run, line, words):
    run = _run(make_run)
    run.id = 1
    path = _recovery(tmp_path, run, [], end=None).path
    with path.open("a") as stream:
        stream.write(line + "\n")
    with pytest.raises(UserError, match=r"\S+\.jsonl") as refused:
        read_recovery(path)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    result = mpfa("import", path, "--db", tmp_path / "r.db")
    assert result.exit_code == 2 and result.output.count("\n") == 1


def test_import_completes_the_unfinished_copy_of_a_run_and_leaves_a_finished_one(tmp_path, make_run, random_requests):
    db, requests = tmp_path / "r.db", random_requests(9)[:8]
    run = _run(make_run, num_requests=7)
    with ResultStore(db) as store:
        run_id = store.begin_run(run)
        store.add_requests(run_id, requests[:3])
        store.finish_run(run_id, "interrupted", error=KILLED_REASON)  # as the next store closes a killed bench's
    recovery = _recovery(tmp_path, run, requests)
    result = mpfa("import", recovery.path, "--db", db)
    assert result.exit_code == 0 and f"imported 1 run(s) as runs {run_id}" in result.output, result.output
    with ResultStore(db) as store:
        (back,) = store.list_runs(with_requests=True)
    assert (back.id, back.status, back.error, back.requests) == (run_id, "ok", None, requests)
    assert back.summary == summarize(requests)
    again = mpfa("import", recovery.path, "--db", db)
    assert again.exit_code == 0 and "skipped 1 already stored" in again.output


def test_import_never_changes_a_run_that_finished_ok(tmp_path, make_run, random_requests):
    db, requests = tmp_path / "r.db", random_requests(5)[:4]
    run = _run(make_run, num_requests=3)
    with ResultStore(db) as store:
        run_id = store.begin_run(run)
        store.add_requests(run_id, requests[:2])
        store.finish_run(run_id, "ok", summary={"n_ok": 2.0})
    result = mpfa("import", _recovery(tmp_path, run, requests).path, "--db", db)
    assert result.exit_code == 0 and "skipped 1 already stored" in result.output
    with ResultStore(db) as store:
        back = store.get_run(run_id)
    assert back.requests == requests[:2] and back.summary == {"n_ok": 2.0}


def test_the_first_line_says_what_the_file_is(tmp_path, make_run):
    run = _run(make_run)
    run.id = 1
    path = _recovery(tmp_path, run, [], end=None).path
    assert json.loads(path.read_text().splitlines()[0]) == {"mpfa_recovery": 1}
