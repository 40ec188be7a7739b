"""No acknowledged request is lost: a database another process keeps locked, or one removed or replaced mid-bench,
ends the bench with one line naming a recovery file that `mpfa import` loads; a run never stays `running`."""
from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.bench import recorder as recording
from mpfa.mpfa_cli.bench import runner as bench
from mpfa.mpfa_cli.bench.runner import BenchOptions, run_bench
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness import client
from mpfa.mpfa_cli.harness.engines import resolve_backends
from mpfa.mpfa_cli.harness.scenario import load_scenario
from mpfa.mpfa_cli.results.store import ResultStore

REQUESTS = 16
_LOCK_HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def _scenario(repeats: int = 1):
    return load_scenario("smoke", {"num_requests": REQUESTS, "warmup_requests": 0, "concurrency": [4], "repeats": repeats,
                                   "input_len": [64], "output_len": 4})


def _hold_lock(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the database's write lock for `seconds`, once this returns."""
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(db), str(seconds)], stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _before_loads(monkeypatch, action) -> None:
    """Call `action(n)` before the n-th load (1, 2, ...) of the bench starts."""
    real_run_load, calls = client.run_load, []

    async def run_load(*args, **kwargs):
        calls.append(1)
        action(len(calls))
        return await real_run_load(*args, **kwargs)

    monkeypatch.setattr(bench.client, "run_load", run_load)


def _bench(sim, store: ResultStore, run_dir: Path, repeats: int = 1) -> list[int]:
    opts = BenchOptions(engine="url", run_dir=run_dir, url=sim.url)
    return run_bench(_scenario(repeats), resolve_backends("fa4-bf16", "url"), opts, store, Console(quiet=True))


def _import(path: Path, db: Path) -> None:
    result = CliRunner().invoke(app, ["import", str(path), "--db", str(db)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output


def _kept_in(message: str) -> Path:
    return Path(re.search(r"kept in (\S+\.jsonl): `mpfa import", message).group(1))


def test_a_lock_held_by_another_process_delays_the_writes_and_loses_no_request(sim, tmp_path, monkeypatch):
    """Requests that finish while another process holds the lock are kept (and flushed to a recovery file) and
    stored once it is released; the file is removed then."""
    db, journaled = tmp_path / "r.db", []
    holders: list[subprocess.Popen] = []
    _before_loads(monkeypatch, lambda n: holders.append(_hold_lock(db, 2.0)))
    real_add_requests = recording.RecoveryFile.add_requests
    monkeypatch.setattr(recording.RecoveryFile, "add_requests",
                        lambda self, run_id, requests: journaled.extend(requests) or real_add_requests(
                            self, run_id, requests))
    with ResultStore(db, busy_timeout_s=10) as store:
        (run_id,) = _bench(sim, store, tmp_path / "runs")
        run = store.get_run(run_id)
    holders[0].wait(timeout=10)
    assert run.status == "ok" and len(run.requests) == REQUESTS and all(r.ok for r in run.requests)
    assert journaled  # the lock was held while requests finished: they went to the recovery file meanwhile
    assert not list(tmp_path.glob("*.jsonl")) and not list((tmp_path / "runs").glob("*.jsonl"))


def test_a_lock_held_past_the_busy_timeout_ends_in_one_line_and_a_recovery_file_that_import_loads(
        sim, tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    holders: list[subprocess.Popen] = []
    _before_loads(monkeypatch, lambda n: holders.append(_hold_lock(db, 60.0)))
    try:
        with ResultStore(db, busy_timeout_s=0.3) as store, pytest.raises(UserError) as failed:
            _bench(sim, store, tmp_path / "runs")
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(timeout=10)
    message = str(failed.value)
    assert failed.value.exit_code == 1 and "\n" not in message
    assert "locked by another process" in message and f"run 1 ({REQUESTS} requests)" in message
    recovery = _kept_in(message)
    assert recovery.parent == tmp_path and recovery.stat().st_mode & 0o777 == 0o600
    with ResultStore(db) as store:
        assert store.get_run(1).status == "running" and not store.get_run(1).requests  # this process still lives
    _import(recovery, db)
    with ResultStore(db) as store:
        (run,) = store.list_runs(with_requests=True)
    assert (run.id, run.status, len(run.requests)) == (1, "ok", REQUESTS)
    assert run.summary["n_ok"] == REQUESTS


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_database_removed_or_replaced_mid_bench_is_said_and_every_run_is_recovered(sim, tmp_path, monkeypatch,
                                                                                       how):
    folder = tmp_path / "data"
    folder.mkdir()
    db = folder / "r.db"

    def remove(n: int) -> None:
        if n != 2:
            return
        if how == "removed":
            shutil.rmtree(folder)
        else:
            other = tmp_path / "other.db"
            sqlite3.connect(other).close()
            other.replace(db)

    _before_loads(monkeypatch, remove)
    monkeypatch.chdir(tmp_path)  # where the file goes when the database's folder is gone (no server log folder here)
    with ResultStore(db) as store, pytest.raises(UserError) as failed:
        _bench(sim, store, tmp_path / "runs", repeats=2)
    message = str(failed.value)
    assert failed.value.exit_code == 1 and "\n" not in message
    assert f"results database {db} was removed or replaced" in message and "run(s) 1, 2 kept in" in message
    recovery = _kept_in(message)
    assert recovery.parent == (folder if how == "replaced" else tmp_path)
    fresh = tmp_path / "fresh.db"
    _import(recovery, fresh)
    with ResultStore(fresh) as store:
        runs = store.list_runs(with_requests=True)
    assert [(r.repeat, r.status, len(r.requests)) for r in runs] == [(1, "ok", REQUESTS), (0, "ok", REQUESTS)]


def test_a_sim_load_timeout_fails_the_run(tmp_path, monkeypatch):
    """The load hint is sent once the run has begun: its failure ends the run failed, not running."""
    real_fetch = bench.fetch_json

    def fetch(url: str, body=None):
        if url.endswith("/sim_load"):
            raise UserError(f"cannot read {url}: no complete reply within 10 s", exit_code=1)
        return real_fetch(url, body)

    monkeypatch.setattr(bench, "fetch_json", fetch)
    opts = BenchOptions(engine="sim", run_dir=tmp_path / "runs", time_scale=0.01)
    with ResultStore(tmp_path / "r.db") as store:
        with pytest.raises(UserError, match=r"run 1 failed: UserError: cannot read \S+/sim_load: no complete reply"):
            run_bench(_scenario(), resolve_backends("fa4-bf16", "sim"), opts, store, Console(quiet=True))
        run = store.get_run(1)
    assert run.status == "failed" and "no complete reply within 10 s" in run.error and run.finished_at
