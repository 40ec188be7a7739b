"""A run whose bench was killed (SIGKILL: it cannot close its run) is closed `interrupted` by the next store opened
for writing on its machine; a run whose bench lives, or that began on another machine, is left running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from mpfa.mpfa_cli.harness.environment import machine_id
from mpfa.mpfa_cli.results.run_owner import KILLED_REASON, Holder, holder, status_label
from mpfa.mpfa_cli.results.store import ResultStore

_WRITER = """
import sys, time
from mpfa.mpfa_cli.harness.records import RequestRecord, RunRecord
from mpfa.mpfa_cli.results.store import ResultStore
store = ResultStore(sys.argv[1])
run = RunRecord("smoke", "mpfa", "sim", True, {"concurrency": 1}, 0, 512, 4, 16, 0, "h", 1.0,
                environment={"machine": sys.argv[2]})
run_id = store.begin_run(run)
for i in range(3):
    store.add_request(run_id, RequestRecord(i, 512, 4, 0.1 * i, chunk_s=[0.1 * i + 0.05 + 0.01 * k for k in range(4)],
                                            chunk_tokens=[1] * 4, completion_s=0.1 * i + 0.08, output_tokens=4))
print(run_id, flush=True)
time.sleep(60)
"""


def _start_writer(db, machine: str) -> tuple[subprocess.Popen, int]:
    """A process that begins a run, stores 3 requests, prints the run id and sleeps holding the run open."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_WRITER), str(db), machine],
                            stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def test_a_run_whose_bench_was_killed_is_closed_interrupted_with_its_requests(tmp_path):
    db = tmp_path / "r.db"
    proc, run_id = _start_writer(db, machine_id())
    try:
        with ResultStore(db) as store:  # the writer lives: its run is left alone
            assert store.get_run(run_id).status == "running"
            assert holder(store.get_run(run_id).environment) is Holder.ALIVE
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    with ResultStore(db) as store:
        run = store.get_run(run_id)
    assert run.status == "interrupted" and run.error == KILLED_REASON
    assert [r.index for r in run.requests] == [0, 1, 2]
    assert run.summary["n_ok"] == 3 and run.finished_at is not None


def test_a_killed_but_unreaped_bench_counts_as_ended(tmp_path):
    db = tmp_path / "r.db"
    proc, run_id = _start_writer(db, machine_id())
    proc.send_signal(signal.SIGKILL)
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, but still a zombie: not waited for
        with ResultStore(db) as store:
            assert store.get_run(run_id).status == "interrupted"
    finally:
        proc.wait(timeout=10)


def test_a_run_of_another_machine_is_left_running_and_listed_as_elsewhere(tmp_path):
    db = tmp_path / "r.db"
    proc, run_id = _start_writer(db, "another-boot-id/12345")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    with ResultStore(db) as store:
        run = store.get_run(run_id)
    assert run.status == "running" and run.error is None
    assert status_label(run.status, run.environment) == "running (elsewhere)"


def test_a_reused_pid_is_not_the_bench():
    """Same pid, another start time: the bench that began the run is gone."""
    env = {"machine": machine_id(), "process": {"pid": os.getpid(), "started": 0.0}}
    assert holder(env) is Holder.GONE
    assert status_label("running", env) == "running (killed)"  # as listed where the store cannot be written
    assert status_label("ok", env) == "ok"


def test_runs_that_recorded_no_process_or_machine_are_left_alone():
    """Runs stored before runs recorded their process, and runs of a machine without an id."""
    assert holder({"machine": machine_id()}) is Holder.UNKNOWN
    assert holder({"process": {"pid": os.getpid(), "started": 0.0}}) is Holder.UNKNOWN
    assert status_label("running", {}) == "running"
