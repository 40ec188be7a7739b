"""ResultStore: round trip, durability of completed requests, clear errors on locked/unusable databases."""
from __future__ import annotations

import dataclasses
import math
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.harness.records import RunRecord
from mpfa.mpfa_cli.results.store import SCHEMA_VERSION, ResultStore, StoreError, default_db_path


def _record(make_run, backend: str = "mpfa", **overrides) -> RunRecord:
    stored = make_run(backend, **overrides)
    fields = {f.name: getattr(stored, f.name) for f in dataclasses.fields(RunRecord)}
    fields.update(status="running", id=None)
    return RunRecord(**fields)


def test_round_trip_keeps_every_field(tmp_path, make_run, random_requests):
    run = _record(make_run, simulated=True, engine="sim", load={"rate": 1.5, "burstiness": 0.5},
                  server_info={"attention_backend": "fa3", "nested": {"x": [1, 2]}},
                  backend_flags=["--attention-backend", "fa3"], environment={"torch": "2.13"},
                  kernels={"attention_backend": "fa3", "source": "simulated"})
    requests = random_requests(7)
    summary = summarize(requests)
    with ResultStore(tmp_path / "r.db") as store:
        run_id = store.begin_run(run)
        assert run.id == run_id
        for rec in requests:
            store.add_request(run_id, rec)
        store.finish_run(run_id, "ok", summary=summary)
    with ResultStore(tmp_path / "r.db") as store:
        back = store.get_run(run_id)
    assert back.requests == requests
    assert back.summary == summary
    assert back.status == "ok" and back.finished_at >= back.started_at
    for f in dataclasses.fields(RunRecord):
        if f.name not in ("requests", "status"):
            assert getattr(back, f.name) == getattr(run, f.name), f.name


def test_non_finite_summary_values_come_back_as_nan(tmp_path, make_run):
    with ResultStore(tmp_path / "r.db") as store:
        run_id = store.begin_run(_record(make_run))
        store.finish_run(run_id, "failed", error="server died", summary={"otps": math.nan, "n_ok": 0.0})
        back = store.get_run(run_id)
    assert math.isnan(back.summary["otps"]) and back.summary["n_ok"] == 0.0
    assert back.error == "server died"


def test_killed_process_keeps_completed_requests(tmp_path):
    """A writer that dies without finishing or closing leaves its committed requests and status 'running'."""
    db = tmp_path / "r.db"
    writer = textwrap.dedent(f"""
        import os
        from mpfa.mpfa_cli.harness.records import RequestRecord, RunRecord
        from mpfa.mpfa_cli.results.store import ResultStore
        store = ResultStore({str(db)!r})
        run = RunRecord("smoke", "mpfa", "sim", True, {{"concurrency": 1}}, 0, 512, 32, 16, 0, "h", 1.0)
        run_id = store.begin_run(run)
        for i in range(3):
            store.add_request(run_id, RequestRecord(i, 512, 32, 0.1 * i, chunk_s=[0.1 * i + 0.05],
                                                    chunk_tokens=[1], completion_s=0.1 * i + 0.06, output_tokens=1))
        os._exit(1)
    """)
    proc = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    with ResultStore(db) as store:
        (run,) = store.list_runs(with_requests=True)
    assert run.status == "running"
    assert [r.index for r in run.requests] == [0, 1, 2]
    assert run.summary == {} and run.finished_at is None


def test_locked_database_gives_one_line_error_naming_the_file(tmp_path, make_run):
    db = tmp_path / "r.db"
    ResultStore(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with ResultStore(db, busy_timeout_s=0.05) as store:
            with pytest.raises(StoreError) as err:
                store.begin_run(_record(make_run))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    message = str(err.value)
    assert str(db) in message and "locked" in message and "\n" not in message


def test_locked_new_database_fails_at_open(tmp_path):
    db = tmp_path / "r.db"
    holder = sqlite3.connect(db, isolation_level=None)  # rollback journal: an exclusive lock blocks readers too
    holder.execute("CREATE TABLE other (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match="locked"):
            ResultStore(db, busy_timeout_s=0.05)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_unwritable_location_gives_store_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(StoreError) as err:
        ResultStore(blocker / "results.db")
    assert str(blocker / "results.db") in str(err.value) and "\n" not in str(err.value)


def test_foreign_or_newer_database_is_refused(tmp_path):
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE runs (x)")
    with pytest.raises(StoreError, match="not an mpfa results database"):
        ResultStore(foreign)
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="upgrade mpfa"):
        ResultStore(newer)


def test_unknown_run_and_bad_status_are_clear_errors(tmp_path, make_run, random_requests):
    with ResultStore(tmp_path / "r.db") as store:
        with pytest.raises(StoreError, match="no run with id 42"):
            store.get_run(42)
        with pytest.raises(StoreError, match="no run with id 42"):
            store.add_request(42, random_requests(2)[0])
        run_id = store.begin_run(_record(make_run))
        with pytest.raises(ValueError, match="status"):
            store.finish_run(run_id, "done")
        with pytest.raises(StoreError, match="no run with id 7, 8"):
            store.get_runs([run_id, 7, 8])


def test_duplicate_request_index_rolls_back_the_whole_batch(tmp_path, make_run, random_requests):
    requests = random_requests(4)
    with ResultStore(tmp_path / "r.db") as store:
        run_id = store.begin_run(_record(make_run))
        store.add_requests(run_id, requests[:2])
        with pytest.raises(StoreError):
            store.add_requests(run_id, requests[2:] + requests[:1])
        assert store.get_run(run_id).requests == requests[:2]


def test_list_and_latest_runs_filter_and_pick_newest_ok(tmp_path, make_run):
    with ResultStore(tmp_path / "r.db") as store:
        ids = {}
        for name, backend, repeat, status in [
            ("old", "mpfa", 0, "ok"), ("new", "mpfa", 0, "ok"), ("broken", "mpfa", 0, "failed"),
            ("other-repeat", "mpfa", 1, "ok"), ("ref", "fa4-bf16", 0, "ok"),
        ]:
            ids[name] = store.begin_run(_record(make_run, backend=backend, repeat=repeat))
            store.finish_run(ids[name], status)
        store.begin_run(_record(make_run, backend="mpfa", scenario="smoke", simulated=True, engine="sim"))
        latest = {r.id for r in store.latest_runs(scenario="paper")}
        assert latest == {ids["new"], ids["other-repeat"], ids["ref"]}
        assert [r.id for r in store.list_runs(backend="mpfa", status="ok", limit=2)] == [
            ids["other-repeat"], ids["new"]]
        assert [r.scenario for r in store.list_runs(simulated=True)] == ["smoke"]
        assert [r.id for r in store.get_runs([ids["ref"], ids["old"]])] == [ids["ref"], ids["old"]]


def test_default_path_respects_mpfa_db(monkeypatch, tmp_path):
    monkeypatch.setenv("MPFA_DB", str(tmp_path / "custom.db"))
    assert default_db_path() == tmp_path / "custom.db"
    monkeypatch.delenv("MPFA_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "mpfa" / "results.db"
