"""Recovery files: what a bench measured but the results database could not take (locked past its busy timeout,
removed mid-run, full), kept in a JSON-lines file that `mpfa import` loads like an export.

Lines, each one JSON object: first `{"mpfa_recovery": 1}`; then `{"run": {...}}` (a run as exports write it,
without requests; a later one for the same id replaces it), `{"run_id": N, "request": {...}}` and
`{"run_id": N, "end": {"status", "error", "summary", "finished_at"}}`. Each line is flushed as it is written, so a
bench killed meanwhile leaves every request it had; a run without an end is read back `interrupted`. Importing a
run whose unfinished copy is in the database adds the requests it lacks (`ResultStore.import_runs`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import UserError
from ..harness.records import RequestRecord, RunRecord
from ..harness.safe_files import append_private
from .export import read_export, run_from_dict, run_to_dict
from .store import StoredRun

FORMAT_LINE = {"mpfa_recovery": 1}
UNCLOSED_REASON = "the bench ended before the run was closed (recovered from a recovery file)"


class RecoveryFile:
    """A bench's recovery file, created (owner-only, never through a link) in the first of `folders` that takes it
    when its first line is written; `path` is None until then."""

    def __init__(self, folders: Sequence[Path], stem: str) -> None:
        self.path: Path | None = None
        self._folders = folders
        self._name = f"{stem}-recovered-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
        self._stream: BinaryIO | None = None

    def add_run(self, run: RunRecord) -> None:
        """The run's record (its requests are added apart)."""
        self._write({"run": run_to_dict(_stored(run))})

    def add_requests(self, run_id: int, requests: Iterable[RequestRecord]) -> None:
        for request in requests:
            self._write({"run_id": run_id, "request": dataclasses.asdict(request)})

    def end_run(self, run_id: int, status: str, error: str | None, summary: dict[str, float] | None) -> None:
        self._write({"run_id": run_id, "end": {"status": status, "error": error, "summary": _finite(summary or {}),
                                               "finished_at": time.time()}})
        os.fsync(self._stream.fileno())

    def add_stored(self, runs: Iterable[StoredRun]) -> None:
        """Runs as the store holds them, their requests with them."""
        for run in runs:
            self.add_run(run)
            self.add_requests(run.id, run.requests)
            if run.status != "running":
                self._write({"run_id": run.id, "end": {"status": run.status, "error": run.error,
                                                       "summary": _finite(run.summary),
                                                       "finished_at": run.finished_at}})
        if self._stream is not None:
            os.fsync(self._stream.fileno())

    def discard(self) -> None:
        """Remove the file: everything in it is in the database."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
            self.path.unlink(missing_ok=True)
            self.path = None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def _write(self, line: dict[str, Any]) -> None:
        if self._stream is None:
            self._stream = self._create()
            self._stream.write(json.dumps(FORMAT_LINE).encode() + b"\n")
        self._stream.write(json.dumps(line).encode() + b"\n")
        self._stream.flush()

    def _create(self) -> BinaryIO:
        reasons = []
        for folder in self._folders:
            if not folder.is_dir():
                continue
            try:
                stream = append_private(folder / self._name, "recovery file", exclusive=True)
            except UserError as exc:
                reasons.append(str(exc))
                continue
            self.path = folder / self._name
            return stream
        raise UserError(f"no recovery file could be written ({'; '.join(reasons) or 'no folder left'})", exit_code=1)


def is_recovery_file(path: Path) -> bool:
    """Whether `path` begins with a recovery file's first line."""
    try:
        with path.open("rb") as stream:
            return _json_line(stream.readline(200)) == FORMAT_LINE
    except OSError:
        return False


def read_runs_file(path: Path) -> list[StoredRun]:
    """The runs of a JSON export or of a recovery file (both are what `mpfa import` takes)."""
    return read_recovery(path) if is_recovery_file(path) else read_export(path)


def read_recovery(path: Path) -> list[StoredRun]:
    """The runs of a recovery file (ids as written), each with the requests and end it holds, checked as an export's
    are; a line that is not what `RecoveryFile` writes is a UserError naming the file and the line."""
    runs: dict[int, dict[str, Any]] = {}
    requests: dict[int, dict[int, dict[str, Any]]] = {}
    ends: dict[int, dict[str, Any]] = {}
    try:
        with path.open("rb") as stream:
            stream.readline()
            for number, raw in enumerate(stream, start=2):
                line = _json_line(raw)
                try:
                    if "run" in line and isinstance(line["run"], dict):
                        runs[line["run"]["id"]] = line["run"]
                    elif "request" in line:
                        requests.setdefault(line["run_id"], {})[line["request"]["index"]] = line["request"]
                    elif "end" in line and isinstance(line["end"], dict):
                        ends[line["run_id"]] = line["end"]
                    else:
                        raise TypeError
                except (TypeError, KeyError):
                    raise UserError(f"{path} line {number} is not a recovery line") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    if unknown := sorted((set(requests) | set(ends)) - set(runs), key=str):
        raise UserError(f"{path} holds requests or ends of run(s) {unknown} without their run")
    try:
        return [run_from_dict(_closed(data, requests.get(run_id, {}), ends.get(run_id)))
                for run_id, data in runs.items()]
    except ValueError as exc:
        raise UserError(f"{path} is not a valid recovery file: {exc}") from None


def _closed(run: dict[str, Any], requests: dict[int, dict[str, Any]], end: dict[str, Any] | None) -> dict[str, Any]:
    """A run dict with its requests and its end; a run never ended is `interrupted`."""
    if end is None:
        end = {"status": "interrupted", "error": UNCLOSED_REASON, "summary": {}, "finished_at": run.get("finished_at")}
    return {**run, **end, "requests": list(requests.values())}


def _json_line(raw: bytes) -> Any:
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return line if isinstance(line, dict) else None


def _stored(run: RunRecord) -> StoredRun:
    if isinstance(run, StoredRun):
        return run
    return StoredRun(**{f.name: getattr(run, f.name) for f in dataclasses.fields(RunRecord) if f.name != "requests"})


def _finite(summary: dict[str, float]) -> dict[str, float | None]:
    """A summary as JSON holds it: a non-finite metric is null (read back as NaN)."""
    return {k: v if math.isfinite(v) else None for k, v in summary.items()}
