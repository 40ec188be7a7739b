"""SQLite store for benchmark runs and their per-request records, and for kernel/serving profiles.

Every write is its own transaction and is committed at once, so a run that is interrupted keeps every
request that completed before the interruption. The database runs in WAL mode (readers never block the
writer); a write waits up to a busy timeout for another writer's lock, and a database that stays locked or
cannot be opened raises `StoreError` with a one-line message naming the file. A database removed or replaced
while open is detected (`require_present`): SQLite would go on writing into the removed file.

The file is never opened through a symbolic link, and is created owner-only (0600; SQLite gives its -wal and -shm
files the same mode). Only the default location's folder is created (0700): a `--db` or `$MPFA_DB` in a folder
that does not exist is an error, as a mistyped path would otherwise make a database nobody looks for.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...backends.specs import PLUGIN_PREFILL_CAVEAT
from . import run_owner
from .metrics.summary import summarize
from ..errors import UserError
from ..harness.records import RequestRecord, RunRecord
from ..harness.safe_files import private_dir, refuse_link, touch_private

SCHEMA_VERSION = 6
FINAL_STATUSES = ("ok", "failed", "interrupted")
_UNFINISHED = ("running", "interrupted")  # a run an import may complete with the requests it lacks
_ABANDONED_WAIT_S = 1.0  # closing another bench's abandoned run waits no longer: the next store opened retries
DEFAULT_BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's write lock

_SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    scenario TEXT NOT NULL,
    backend TEXT NOT NULL,
    engine TEXT NOT NULL,
    simulated INTEGER NOT NULL,
    load JSON NOT NULL,
    repeat INTEGER NOT NULL,
    input_len INTEGER NOT NULL,
    output_len INTEGER NOT NULL,
    num_requests INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    workload_hash TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    status TEXT NOT NULL,
    error TEXT,
    model TEXT NOT NULL,
    gpu TEXT NOT NULL,
    server_info JSON NOT NULL,
    backend_flags JSON NOT NULL,
    environment JSON NOT NULL,
    summary JSON
);
CREATE INDEX runs_by_config ON runs (scenario, backend, started_at);
CREATE TABLE requests (
    run_id INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    "index" INTEGER NOT NULL,
    warmup INTEGER NOT NULL,
    input_len INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    dispatch_s REAL NOT NULL,
    chunk_s JSON NOT NULL,
    chunk_tokens JSON NOT NULL,
    completion_s REAL,
    output_tokens INTEGER NOT NULL,
    prompt_tokens INTEGER,
    error TEXT,
    PRIMARY KEY (run_id, "index")
);
"""

# Version 2: profile results (`mpfa profile`), one row per profile, its figures as JSON.
_PROFILES_SCHEMA = """
CREATE TABLE profiles (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL,
    gpu TEXT NOT NULL,
    params JSON NOT NULL,
    result JSON NOT NULL,
    simulated INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX profiles_by_kind ON profiles (kind, created_at);
"""


def _add_run_caveats(conn: sqlite3.Connection) -> None:
    """Version 3: `runs.caveat`, the backend's caveat on a measured run's numbers (`BackendSpec.caveat`).

    Runs stored before it are labelled too: every measured (not simulated) run of mpfa / mpfa-direct in an
    older database was served by the SGLang plugin with its reference-path prefill, which the caveat is about.
    """
    conn.execute("ALTER TABLE runs ADD COLUMN caveat TEXT")
    conn.execute(
        "UPDATE runs SET caveat = ? WHERE simulated = 0 AND backend IN ('mpfa', 'mpfa-direct')",
        (PLUGIN_PREFILL_CAVEAT,),
    )


# Version 4: `runs.kernels`, the attention kernels the run's server ran (`RunRecord.kernels`); {} for older runs.
_RUN_KERNELS = "ALTER TABLE runs ADD COLUMN kernels JSON NOT NULL DEFAULT '{}'"

# Version 5: `requests.cached_tokens`, the prompt tokens the server's prefix cache held (NULL where not reported).
_REQUEST_CACHED_TOKENS = "ALTER TABLE requests ADD COLUMN cached_tokens INTEGER"

# Version 6: `runs.invocation`, the `mpfa bench` call that measured the run (`RunRecord.invocation`); NULL before.
_RUN_INVOCATION = "ALTER TABLE runs ADD COLUMN invocation TEXT"

# What brings a database from version N - 1 to version N: SQL statements, or a function of the connection.
_UPGRADES: dict[int, str | Callable[[sqlite3.Connection], None]] = {
    1: _SCHEMA, 2: _PROFILES_SCHEMA, 3: _add_run_caveats, 4: _RUN_KERNELS, 5: _REQUEST_CACHED_TOKENS,
    6: _RUN_INVOCATION,
}

_RUN_COLUMNS = (
    "scenario", "backend", "engine", "simulated", "load", "repeat", "input_len", "output_len",
    "num_requests", "seed", "workload_hash", "started_at", "status", "error", "caveat", "model", "gpu",
    "server_info", "backend_flags", "kernels", "environment", "invocation",
)
_REQUEST_COLUMNS = (
    "run_id", '"index"', "warmup", "input_len", "max_new_tokens", "dispatch_s", "chunk_s",
    "chunk_tokens", "completion_s", "output_tokens", "prompt_tokens", "error", "cached_tokens",
)


class StoreError(UserError):
    """The results database cannot be used; the message is one line and names the file."""


class StoreVanished(StoreError):
    """The database file was removed or replaced while open: what was written since is in no file at its path."""


@dataclass
class StoredRun(RunRecord):
    """A run as read back from the store: the record plus what the store adds when the run ends."""

    finished_at: float | None = None
    summary: dict[str, float] = field(default_factory=dict)


@dataclass
class StoredProfile:
    """A profile result as stored: `params` say what was profiled, `result` holds the figures."""

    id: int
    kind: str  # "prefill", "decode", "serving", ...
    created_at: float
    gpu: str
    params: dict[str, Any]
    result: dict[str, Any]
    simulated: bool = False


def default_db_path() -> Path:
    """`$MPFA_DB`, else `$XDG_DATA_HOME/mpfa/results.db`, else `~/.local/share/mpfa/results.db`."""
    if env := os.environ.get("MPFA_DB"):
        return Path(env).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "mpfa" / "results.db"


def load_key(load: dict[str, Any]) -> str:
    """Canonical JSON of a load point, so equal loads compare and group equal (in Python and in SQL)."""
    return json.dumps(load, sort_keys=True)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float inside it replaced by None (SQLite's JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json(value: Any) -> str:
    """JSON as SQLite (and every export) reads it: a non-finite number anywhere (a server's report may hold one)
    becomes null."""
    return json.dumps(_finite(value), allow_nan=False)


def _json_or_none(value: dict[str, float] | None) -> str | None:
    # NaN/inf are legal in a summary (e.g. a percentile of no samples); store them as null.
    return None if value is None else _json(value)


class ResultStore:
    """Runs and requests in one SQLite file. Use as a context manager or call `close()`."""

    def __init__(self, path: str | Path | None = None, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S):
        """The database at `path`, else at `default_db_path()`, whose folder is created only when it is the default
        location (not `$MPFA_DB`)."""
        create_folder = path is None and not os.environ.get("MPFA_DB")
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        refuse_link(self.path, "results database")
        # A file this process may not write is opened read-only: listing and comparing its runs still work.
        self.read_only = self.path.is_file() and not _may_write(self.path)
        if create_folder:
            private_dir(self.path.parent, "results database")
        elif not self.path.parent.is_dir():
            raise StoreError(f"cannot open results database {self.path}: its folder {self.path.parent} does not "
                             "exist (create it, or give another --db)")
        if not self.read_only:
            touch_private(self.path, "results database")
        try:
            # Autocommit mode: transactions are opened explicitly (BEGIN IMMEDIATE) in `_transaction`.
            self._conn = sqlite3.connect(self._uri(), timeout=busy_timeout_s, isolation_level=None, uri=True)
            if self.read_only and not self._readable():
                # A WAL database whose directory we cannot write either (no -shm file can be made): read the
                # file as it is, as nothing here can change it.
                self._conn.close()
                self._conn = sqlite3.connect(self._uri() + "&immutable=1", isolation_level=None, uri=True)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open results database {self.path}: {_reason(exc)}") from None
        self._conn.row_factory = sqlite3.Row
        self.busy_timeout_s = busy_timeout_s
        with self._errors("open"):
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self._refuse_foreign()  # before anything below writes to the file
            self._conn.execute("PRAGMA foreign_keys = ON")
            if self.read_only:
                self._require_current_schema()
                return
            self._conn.execute("PRAGMA journal_mode = WAL")
            # In WAL mode NORMAL loses no committed transaction when the process dies (only on power loss).
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._ensure_schema()
        self._identity = _file_identity(self.path)
        self._close_abandoned_runs()

    def _readable(self) -> bool:
        try:
            self._conn.execute("PRAGMA user_version")
        except sqlite3.OperationalError:
            return False
        return True

    def _uri(self) -> str:
        return f"{self.path.resolve().as_uri()}?mode={'ro' if self.read_only else 'rwc'}"

    def close(self) -> None:
        self._conn.close()

    def require_present(self) -> None:
        """Raise `StoreVanished` when the file opened is no longer at the store's path (removed with its folder, or
        replaced): SQLite goes on writing into the open file, which nothing can open once it is closed."""
        if self.read_only:
            return
        try:
            present = _file_identity(self.path) == self._identity
        except OSError:
            present = False
        if not present:
            raise StoreVanished(f"results database {self.path} was removed or replaced while mpfa wrote to it")

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writing -----------------------------------------------------------------------------------

    def begin_run(self, run: RunRecord) -> int:
        """Insert `run` with status "running" (plus any requests it already holds); sets and returns its id. The
        run records this process in `environment["process"]`: if it is killed, the run is closed later."""
        run.environment = {**run.environment, "process": run_owner.this_process()}
        with self._transaction("record a new run"):
            run_id = self._insert_run(run, "running")
        run.id = run_id
        run.status = "running"
        return run_id

    def import_runs(self, runs: Iterable[StoredRun]) -> list[tuple[int, bool]]:
        """Store runs read from exports as they are (status, summary, finished_at, requests) under new ids, in one
        transaction: all of them or, on any error, none.

        A run the store already holds — same scenario, backend, engine, context, load, repeat and `started_at`
        (the wall-clock start, to the float) — is not stored again, unless the stored one never finished (running,
        interrupted) and the import holds requests it lacks: those are added and the run takes the import's status,
        error and summary (a recovery file completes the run its bench could not close). Returns (its id here,
        whether anything was added) per run; the runs themselves are left unchanged.
        """
        with self._transaction("import runs"):
            return [self._import_run(run) for run in runs]

    def _import_run(self, run: StoredRun) -> tuple[int, bool]:
        key = (run.scenario, run.backend, run.engine, run.input_len, load_key(run.load), run.repeat, run.started_at)
        existing = self._conn.execute(
            "SELECT id, status FROM runs WHERE scenario = ? AND backend = ? AND engine = ? AND input_len = ? "
            "AND load = ? AND repeat = ? AND started_at = ?", key,
        ).fetchone()
        if existing is None:
            return self._insert_run(run, run.status, run.finished_at, run.summary or None), True
        run_id = int(existing["id"])
        if existing["status"] not in _UNFINISHED:
            return run_id, False
        stored = {row[0] for row in self._conn.execute('SELECT "index" FROM requests WHERE run_id = ?', (run_id,))}
        if not (lacking := [r for r in run.requests if r.index not in stored]):
            return run_id, False
        self._insert_requests(run_id, lacking)
        self._conn.execute("UPDATE runs SET status = ?, error = ?, summary = ?, finished_at = ? WHERE id = ?",
                           (run.status, run.error, _json_or_none(run.summary or None), run.finished_at, run_id))
        return run_id, True

    def add_request(self, run_id: int, rec: RequestRecord) -> None:
        """Record one finished request, committed at once."""
        self.add_requests(run_id, [rec])

    def add_requests(self, run_id: int, recs: Iterable[RequestRecord], wait_s: float | None = None) -> None:
        """Record several finished requests in one transaction (all or none), waiting up to `wait_s` (default: the
        busy timeout) for another writer's lock."""
        with self._transaction(f"record requests of run {run_id}", wait_s):
            self._require_run(run_id)
            self._insert_requests(run_id, recs)

    def finish_run(self, run_id: int, status: str, error: str | None = None,
                   summary: dict[str, float] | None = None, wait_s: float | None = None) -> None:
        """Close a run: status is one of ok | failed | interrupted; summary is the metrics dict, if any."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"run status must be one of {', '.join(FINAL_STATUSES)}, not {status!r}")
        with self._transaction(f"finish run {run_id}", wait_s):
            self._require_run(run_id)
            self._conn.execute(
                "UPDATE runs SET status = ?, error = ?, summary = ?, finished_at = ? WHERE id = ?",
                (status, error, _json_or_none(summary), time.time(), run_id),
            )

    def add_profile(self, kind: str, gpu: str, params: dict[str, Any], result: dict[str, Any],
                    simulated: bool = False, created_at: float | None = None) -> int:
        """Store one profile result (committed at once); returns its id. Non-finite numbers become null."""
        with self._transaction(f"record a {kind} profile"):
            cursor = self._conn.execute(
                "INSERT INTO profiles (kind, created_at, gpu, params, result, simulated) VALUES (?, ?, ?, ?, ?, ?)",
                (kind, time.time() if created_at is None else created_at, gpu, json.dumps(_finite(params)),
                 json.dumps(_finite(result)), int(simulated)),
            )
            return int(cursor.lastrowid)

    # --- reading -----------------------------------------------------------------------------------

    def get_profile(self, profile_id: int) -> StoredProfile:
        with self._errors(f"read profile {profile_id}"):
            row = self._conn.execute("SELECT * FROM profiles WHERE id = ?", (_row_id(profile_id),)).fetchone()
        if row is None:
            raise StoreError(f"no profile with id {profile_id} in {self.path}")
        return _profile_from_row(row)

    def list_profiles(self, kind: str | None = None, limit: int | None = None) -> list[StoredProfile]:
        """Profiles (of `kind`, if given), newest first."""
        sql, params = "SELECT * FROM profiles", []
        if kind is not None:
            sql += " WHERE kind = ?"
            params.append(kind)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._errors("read profiles"):
            return [_profile_from_row(row) for row in self._conn.execute(sql, params)]

    def get_run(self, run_id: int) -> StoredRun:
        """The run with its requests (in request index order)."""
        with self._errors(f"read run {run_id}"):
            row = self._conn.execute("SELECT * FROM runs WHERE id = ?", (_row_id(run_id),)).fetchone()
            if row is None:
                raise StoreError(f"no run with id {run_id} in {self.path}")
            return self._with_requests([_run_from_row(row)])[0]

    def get_runs(self, run_ids: Iterable[int], with_requests: bool = False) -> list[StoredRun]:
        """The runs with these ids, in the order given; an unknown id is an error."""
        ids = list(run_ids)
        by_id = {r.id: r for r in self._select("id IN (SELECT value FROM json_each(?))",
                                               [json.dumps([_row_id(i) for i in ids])])}
        if missing := [i for i in ids if i not in by_id]:
            raise StoreError(f"no run with id {', '.join(map(str, missing))} in {self.path}")
        runs = [by_id[i] for i in ids]
        return self._with_requests(runs) if with_requests else runs

    def list_runs(
        self,
        scenario: str | None = None,
        backend: str | None = None,
        engine: str | None = None,
        status: str | None = None,
        simulated: bool | None = None,
        since: float | None = None,
        limit: int | None = None,
        with_requests: bool = False,
    ) -> list[StoredRun]:
        """Runs matching every filter given, newest first; `since` is a wall-clock epoch time."""
        where, params = _filters(scenario, backend, engine, status, simulated, since)
        runs = self._select(where, params, limit=limit)
        return self._with_requests(runs) if with_requests else runs

    def latest_runs(
        self,
        scenario: str | None = None,
        backend: str | None = None,
        engine: str | None = None,
        simulated: bool | None = None,
        with_requests: bool = False,
    ) -> list[StoredRun]:
        """For each backend and point (scenario, backend, engine, input_len, load) the runs that finished ok of the
        newest bench invocation that has one, the newest of each repeat; newest first.

        This is the current result set of every configuration measured, the natural input of compare/plot: a bench
        interrupted after some repeats of a point gives those repeats alone, never mixed with an older bench's.
        Runs stored before invocations were recorded count as one invocation.
        """
        where, params = _filters(scenario, backend, engine, "ok", simulated, None)
        invocation_of: dict[tuple[Any, ...], str | None] = {}
        chosen: dict[tuple[Any, ...], StoredRun] = {}
        for run in self._select(where, params):
            point = (run.scenario, run.backend, run.engine, run.input_len, load_key(run.load))
            if run.invocation == invocation_of.setdefault(point, run.invocation):
                chosen.setdefault((*point, run.repeat), run)
        runs = list(chosen.values())
        return self._with_requests(runs) if with_requests else runs

    def interrupted_invocations(self, invocations: Iterable[str | None]) -> set[str]:
        """Those of `invocations` (bench calls) with a run that was interrupted (Ctrl-C, a signal, a killed bench)."""
        named = json.dumps(sorted({i for i in invocations if i is not None}))
        with self._errors("read runs"):
            rows = self._conn.execute(
                "SELECT DISTINCT invocation FROM runs WHERE status = 'interrupted' "
                "AND invocation IN (SELECT value FROM json_each(?))", (named,)).fetchall()
        return {row[0] for row in rows}

    # --- internals ---------------------------------------------------------------------------------

    def _close_abandoned_runs(self) -> None:
        """Close `interrupted` each running run of this machine whose process is gone: a bench that was killed
        could not close it. Its summary is its stored requests'. Runs of other machines are left as they are."""
        with self._errors("read running runs"):
            rows = self._conn.execute("SELECT id, environment FROM runs WHERE status = 'running'").fetchall()
        for row in rows:
            if run_owner.holder(json.loads(row["environment"])) is not run_owner.Holder.GONE:
                continue
            try:
                requests = self.get_run(row["id"]).requests
                self.finish_run(row["id"], "interrupted", error=run_owner.KILLED_REASON,
                                summary=summarize(requests), wait_s=_ABANDONED_WAIT_S)
            except StoreError:  # locked by a writer: the next store opened closes it; this one still reads
                return

    def _ensure_schema(self) -> None:
        if self._schema_version() == SCHEMA_VERSION:
            return
        with self._transaction("create the schema"):
            # Re-read under the write lock: another process may have created the schema meanwhile.
            version = self._schema_version()
            if version == SCHEMA_VERSION:
                return
            self._upgrade_schema(version)

    def _schema_version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def _refuse_foreign(self) -> None:
        """An SQLite file with tables but no mpfa schema version belongs to something else: never touch it."""
        if self._schema_version() == 0 and self._conn.execute(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'"
        ).fetchone()[0]:
            raise StoreError(f"{self.path} is not an mpfa results database (it holds other tables); "
                             "give another --db")

    def _require_current_schema(self) -> None:
        version = self._schema_version()
        if version != SCHEMA_VERSION:
            raise StoreError(f"results database {self.path} is read-only and has schema version {version}, not "
                             f"{SCHEMA_VERSION}: open it writable once (any mpfa command) to upgrade it")

    def _upgrade_schema(self, version: int) -> None:
        """Create the schema (version 0) or add what later versions brought, in order."""
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"results database {self.path} has schema version {version}; this mpfa reads up to "
                f"{SCHEMA_VERSION} (upgrade mpfa)"
            )
        self._refuse_foreign()  # re-checked under the write lock
        for step in range(version + 1, SCHEMA_VERSION + 1):
            upgrade = _UPGRADES[step]
            if callable(upgrade):
                upgrade(self._conn)
                continue
            for statement in upgrade.split(";"):
                if statement.strip():
                    self._conn.execute(statement)
        self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _require_run(self, run_id: int) -> None:
        if self._conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
            raise StoreError(f"no run with id {run_id} in {self.path}")

    def _insert_run(self, run: RunRecord, status: str, finished_at: float | None = None,
                    summary: dict[str, float] | None = None) -> int:
        """Insert `run` and its requests with this status (inside the caller's transaction); returns the id."""
        values = {c: getattr(run, c) for c in _RUN_COLUMNS}
        values.update(
            status=status,
            simulated=int(run.simulated),
            load=load_key(run.load),
            server_info=_json(run.server_info),
            backend_flags=_json(run.backend_flags),
            kernels=_json(run.kernels),
            environment=_json(run.environment),
            finished_at=finished_at,
            summary=_json_or_none(summary),
        )
        cursor = self._conn.execute(
            f"INSERT INTO runs ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
            list(values.values()),
        )
        run_id = int(cursor.lastrowid)
        self._insert_requests(run_id, run.requests)
        return run_id

    def _insert_requests(self, run_id: int, recs: Iterable[RequestRecord]) -> None:
        rows = [
            (
                run_id, r.index, int(r.warmup), r.input_len, r.max_new_tokens, r.dispatch_s,
                json.dumps(r.chunk_s), json.dumps(r.chunk_tokens), r.completion_s, r.output_tokens,
                r.prompt_tokens, r.error, r.cached_tokens,
            )
            for r in recs
        ]
        placeholders = ", ".join("?" for _ in _REQUEST_COLUMNS)
        self._conn.executemany(
            f"INSERT INTO requests ({', '.join(_REQUEST_COLUMNS)}) VALUES ({placeholders})", rows
        )

    def _select(self, where: str, params: list[Any], limit: int | None = None) -> list[StoredRun]:
        sql = f"SELECT * FROM runs WHERE {where} ORDER BY id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._errors("read runs"):
            return [_run_from_row(row) for row in self._conn.execute(sql, params)]

    def _with_requests(self, runs: list[StoredRun]) -> list[StoredRun]:
        with self._errors("read requests"):
            for run in runs:
                rows = self._conn.execute(
                    'SELECT * FROM requests WHERE run_id = ? ORDER BY "index"', (run.id,)
                )
                run.requests = [_request_from_row(row) for row in rows]
        return runs

    @contextmanager
    def _transaction(self, what: str, wait_s: float | None = None) -> Iterator[None]:
        """A write transaction; its lock is waited for `wait_s` (default: the busy timeout)."""
        with self._errors(what), self._busy_timeout(wait_s):
            self._conn.execute("BEGIN IMMEDIATE")  # take the write lock now: no deadlock on upgrade
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @contextmanager
    def _busy_timeout(self, wait_s: float | None) -> Iterator[None]:
        if wait_s is None:
            yield
            return
        self._conn.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
        try:
            yield
        finally:
            self._conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreError(
                    f"cannot {what}: results database {self.path} is locked by another process"
                ) from None
            raise StoreError(f"cannot {what} in results database {self.path}: {_reason(exc)}") from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot {what} in results database {self.path}: {_reason(exc)}") from None


def _may_write(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _file_identity(path: Path) -> tuple[int, int]:
    """What tells one file from another at the same path: device and inode."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


_MAX_ROW_ID = 2**63 - 1


def _row_id(value: int) -> int:
    """An id as SQLite can hold it: one beyond its 64-bit range names no row (-1, never a row id here)."""
    return value if -_MAX_ROW_ID <= value <= _MAX_ROW_ID else -1


def _filters(
    scenario: str | None, backend: str | None, engine: str | None, status: str | None,
    simulated: bool | None, since: float | None,
) -> tuple[str, list[Any]]:
    clauses, params = ["1"], []
    for column, value in (("scenario", scenario), ("backend", backend), ("engine", engine),
                          ("status", status)):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    if simulated is not None:
        clauses.append("simulated = ?")
        params.append(int(simulated))
    if since is not None:
        clauses.append("started_at >= ?")
        params.append(since)
    return " AND ".join(clauses), params


def _summary_from_json(text: str | None) -> dict[str, float]:
    if text is None:
        return {}
    return {k: (math.nan if v is None else v) for k, v in json.loads(text).items()}


def _run_from_row(row: sqlite3.Row) -> StoredRun:
    return StoredRun(
        id=row["id"],
        scenario=row["scenario"],
        backend=row["backend"],
        engine=row["engine"],
        simulated=bool(row["simulated"]),
        load=json.loads(row["load"]),
        repeat=row["repeat"],
        input_len=row["input_len"],
        output_len=row["output_len"],
        num_requests=row["num_requests"],
        seed=row["seed"],
        workload_hash=row["workload_hash"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        status=row["status"],
        error=row["error"],
        caveat=row["caveat"],
        model=row["model"],
        gpu=row["gpu"],
        server_info=json.loads(row["server_info"]),
        backend_flags=json.loads(row["backend_flags"]),
        kernels=json.loads(row["kernels"]),
        environment=json.loads(row["environment"]),
        invocation=row["invocation"],
        summary=_summary_from_json(row["summary"]),
    )


def _request_from_row(row: sqlite3.Row) -> RequestRecord:
    return RequestRecord(
        index=row["index"],
        warmup=bool(row["warmup"]),
        input_len=row["input_len"],
        max_new_tokens=row["max_new_tokens"],
        dispatch_s=row["dispatch_s"],
        chunk_s=json.loads(row["chunk_s"]),
        chunk_tokens=json.loads(row["chunk_tokens"]),
        completion_s=row["completion_s"],
        output_tokens=row["output_tokens"],
        prompt_tokens=row["prompt_tokens"],
        cached_tokens=row["cached_tokens"],
        error=row["error"],
    )


def _profile_from_row(row: sqlite3.Row) -> StoredProfile:
    return StoredProfile(
        id=row["id"],
        kind=row["kind"],
        created_at=row["created_at"],
        gpu=row["gpu"],
        params=json.loads(row["params"]),
        result=json.loads(row["result"]),
        simulated=bool(row["simulated"]),
    )


def _reason(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
