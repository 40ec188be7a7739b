"""Where a bench's runs and requests go: the results database, and whatever it cannot take, a recovery file.

A finished request is written at once without waiting on the database's lock for long (the client's event loop
must not stall, or the streams in flight are stamped late): if another process holds the lock, the request is kept
and retried with the next one, and from then on the run's requests are also flushed to a recovery file
(`results.recovery`), so none exists only in memory. Closing a run waits the store's busy timeout for what is left.
If the database still cannot take it, or was removed meanwhile (SQLite goes on writing into the removed file),
the bench stops with one line naming the recovery file, which holds every request and the run's end;
`mpfa import FILE` loads it. A run stored whole leaves no recovery file.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ..errors import UserError
from ..harness.records import RequestRecord, RunRecord
from ..results.recovery import RecoveryFile
from ..results.store import ResultStore, StoreError, StoreVanished

REQUEST_WAIT_S = 0.02  # the longest a finished request waits for the database's lock (SQLite retries within it)


class RunRecorder:
    """The store of one bench: `begin` a run, `add` its finished requests, `finish` it; `require_present` once
    every run is done. A failure to store anything is a UserError (exit 1) naming the recovery file."""

    def __init__(self, store: ResultStore, run_dir: Path) -> None:
        self.store = store
        self.run_ids: list[int] = []
        folders = [store.path.parent, run_dir, Path.cwd(), Path(tempfile.gettempdir())]
        self.recovery = RecoveryFile(folders, store.path.stem)
        self._run: RunRecord | None = None
        self._requests: list[RequestRecord] = []  # the run's finished requests, in the order they finished
        self._unstored: list[RequestRecord] = []  # those the database has not taken yet
        self._in_recovery = False  # the run's requests go to the recovery file too

    def begin(self, run: RunRecord) -> int:
        """Store `run` as running; returns its id."""
        self.require_present()
        run_id = self.store.begin_run(run)
        self.run_ids.append(run_id)
        self._run, self._requests, self._unstored, self._in_recovery = run, [], [], False
        return run_id

    def add(self, request: RequestRecord) -> None:
        """Keep a finished request: in the database if it takes it now, else in the recovery file until it does."""
        self._requests.append(request)
        self._unstored.append(request)
        if self._in_recovery:
            self.recovery.add_requests(self._run.id, [request])
        try:  # once the lock was found taken, later tries do not wait at all: the streams in flight come first
            self.store.add_requests(self._run.id, self._unstored, wait_s=0 if self._in_recovery else REQUEST_WAIT_S)
        except StoreError:
            if not self._in_recovery:
                self.recovery.add_run(self._run)
                self.recovery.add_requests(self._run.id, self._requests)
                self._in_recovery = True
            return
        self._unstored = []

    def finish(self, status: str, error: str | None, summary: dict[str, float]) -> None:
        """Close the run with what is left of its requests, waiting the busy timeout for the database's lock."""
        run_id = self._run.id
        try:
            if self._unstored:
                self.store.add_requests(run_id, self._unstored)
                self._unstored = []
            self.store.finish_run(run_id, status, error=error, summary=summary)
            self.store.require_present()
        except StoreVanished as exc:
            self._save_everything(exc)
        except StoreError as exc:
            if not self._in_recovery:
                self.recovery.add_run(self._run)
                self.recovery.add_requests(run_id, self._requests)
            self.recovery.end_run(run_id, status, error, summary)
            raise _saved(exc, f"run {run_id} ({len(self._requests)} requests)", self.recovery.path,
                         " once the database is free") from None
        if self._in_recovery:
            self.recovery.discard()

    def close(self) -> None:
        self.recovery.close()

    def require_present(self) -> None:
        """Stop the bench if the database was removed or replaced: the runs stored so far went with it."""
        try:
            self.store.require_present()
        except StoreVanished as exc:
            self._save_everything(exc)

    def _save_everything(self, exc: StoreVanished) -> None:
        """Every run of this bench, read back from the removed file SQLite still holds open, to the recovery file."""
        if not self.run_ids:
            raise UserError(str(exc), exit_code=1) from None
        try:
            runs = self.store.get_runs(self.run_ids, with_requests=True)
        except StoreError:  # the removed file cannot be read either: this run as far as it got
            runs = []
        if runs:
            self.recovery.add_stored(runs)
        else:
            self.recovery.add_run(self._run)
            self.recovery.add_requests(self._run.id, self._requests)
        what = f"run(s) {', '.join(map(str, self.run_ids))}" if runs else f"run {self._run.id}"
        raise _saved(exc, what, self.recovery.path) from None


def _saved(exc: StoreError, what: str, path: Path, when: str = "") -> UserError:
    """The one-line error of a run the database could not take: why, and where it is kept."""
    return UserError(f"{exc}; {what} kept in {path}: `mpfa import {path}` loads it{when}", exit_code=1)
