"""Export stored runs as JSON (full records) or CSV (one row per run with its summary metrics); read JSON
exports back (`mpfa import`).

Every exported run carries `simulated` and `caveat`, so simulator numbers cannot pass for measurements, nor
caveated numbers (measured, but not the backend's own) for clean ones, downstream, and the `kernels` its server ran
(CSV: as one line, `describe_kernels`).
A file name ending in `.gz` is written gzip-compressed (exports with every request are mostly repeated digits:
about 6x smaller), and a gzip file is read back as such, streamed and cut off past `MAX_EXPORT_BYTES` (a gzip bomb
costs at most that much memory before it is refused). Non-finite metric values are written as JSON null / an
empty CSV cell. A JSON export read back gives the runs
as exported (null metrics as NaN); exports written before runs had a `caveat` read as caveat None, and those
written without `--requests` as runs without requests, and those written before runs had `kernels` as runs with none
recorded, and those written before runs had an `invocation` (the bench call that measured them) as runs of none.

Nothing read back is taken on trust: beyond types and ranges, a run must be physically possible (`ImpossibleRun`):
each request's times ordered (dispatch <= first chunk <= ... <= completion), its tokens within what it asked for,
its index in range, and a run marked ok must hold every one of its requests. Strings are bounded
(`MAX_NAME_CHARS` for names, `MAX_TEXT_CHARS` for any other).
"""
from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import json
import math
import types
import typing
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..errors import UserError, field_names
from ..harness.records import RequestRecord
from ..harness.scenario import MAX_INPUT_LEN, MAX_OUTPUT_LEN, MAX_REPEATS, MAX_REQUESTS, load_problem
from ..harness.served_kernels import describe_kernels
from ..harness.safe_files import replace_private, write_private
from .metrics import registry
from .metrics.per_request import measured
from .metrics.summary import summarize
from .store import FINAL_STATUSES, StoredRun, load_key

EXPORT_FORMATS = ("json", "csv")

# Run metadata written to every CSV row, in column order; summary metrics follow.
_CSV_RUN_COLUMNS = (
    "id", "scenario", "backend", "engine", "simulated", "caveat", "load", "repeat", "input_len", "output_len",
    "num_requests", "seed", "workload_hash", "started_at", "finished_at", "status", "error", "model", "gpu",
    "kernels", "invocation",
)


def export_runs(runs: Sequence[StoredRun], fmt: str, dest: Path | TextIO,
                include_requests: bool = False) -> None:
    """Write `runs` to `dest` (a path, or an open text stream such as stdout) as `fmt` ("json" or "csv").

    `include_requests` adds each run's request records to JSON (the runs must have been read with them);
    CSV has one row per run and never holds requests.
    """
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unknown export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    if isinstance(dest, Path):
        try:
            if dest.suffix == ".gz":
                text = io.StringIO(newline="")
                _write(runs, fmt, text, include_requests)
                write_private(dest, gzip.compress(text.getvalue().encode("utf-8"), mtime=0), "export file")  # same
                return  # runs, same bytes
            with replace_private(dest, "export file") as stream:
                _write(runs, fmt, stream, include_requests)
        except OSError as exc:
            raise UserError(f"cannot write export file {dest}: {exc.strerror or exc}") from None
    else:
        _write(runs, fmt, dest, include_requests)


def run_to_dict(run: StoredRun, include_requests: bool = False) -> dict[str, Any]:
    """A run as a plain JSON-able dict: metadata, `simulated`, `caveat`, summary and optionally its requests."""
    data = dataclasses.asdict(run)
    data["summary"] = {k: _finite_or_none(v) for k, v in run.summary.items()}
    if include_requests:
        for req, rec in zip(data["requests"], run.requests):
            req["ok"] = rec.ok
    else:
        del data["requests"]
    return data


# The most JSON one export may hold, decompressed: 7x the largest committed export (9 MB); parsing that much costs
# at most ~0.4 GB (docs/reliability.md).
MAX_EXPORT_BYTES = 64 * 2**20
MAX_NAME_CHARS = 256  # scenario, backend, engine, model, gpu, workload hash, status
MAX_TEXT_CHARS = 65536  # any other string: an error message, a server flag, a server-info value
_NAMES = ("scenario", "backend", "engine", "model", "gpu", "workload_hash", "status")


class ImpossibleRun(ValueError):
    """A run that no bench could have measured: times out of order, tokens beyond the request, an index out of
    range, or `ok` without all its requests."""


def read_export(path: Path) -> list[StoredRun]:
    """The runs of a JSON export written by `export_runs` (ids as exported); anything else is a UserError."""
    try:
        doc = json.loads(_export_bytes(path).decode("utf-8"))
    except OSError as exc:  # gzip.BadGzipFile is one
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise UserError(f"{path} is not an mpfa JSON export (not UTF-8 JSON; `mpfa export` writes one)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise UserError(f"{path} is not an mpfa JSON export (no top-level \"runs\" list)")
    try:
        return [run_from_dict(data) for data in doc["runs"]]
    except ImpossibleRun as exc:
        raise UserError(f"{path}: {exc}: not imported") from None
    except ValueError as exc:
        raise UserError(f"{path} is not an mpfa JSON export: {exc}") from None


def _export_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed if gzip, read in a stream that stops past `MAX_EXPORT_BYTES`."""
    with path.open("rb") as raw:
        compressed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        data = (gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw).read(MAX_EXPORT_BYTES + 1)
    if len(data) > MAX_EXPORT_BYTES:
        raise UserError(f"{path} holds more than {MAX_EXPORT_BYTES // 2**20} MiB of JSON"
                        f"{' once decompressed' if compressed else ''}: refused (split the export by scenario)")
    return data


# Ranges of a run's and a request's numbers (inclusive); every other int must fit SQLite's 64 bits, every float
# must be finite. `repeat` is a repeat index: scenarios allow at most MAX_REPEATS repeats.
_INT64 = (-(2**63), 2**63 - 1)
_RUN_RANGES = {"repeat": (0, MAX_REPEATS - 1), "input_len": (1, MAX_INPUT_LEN), "output_len": (1, MAX_OUTPUT_LEN),
               "num_requests": (1, MAX_REQUESTS), "seed": (0, _INT64[1])}
_REQUEST_RANGES = {"index": (-MAX_REQUESTS, MAX_REQUESTS),  # warmup requests count down from -1
                    "input_len": (1, MAX_INPUT_LEN),
                   "max_new_tokens": (1, MAX_OUTPUT_LEN), "output_tokens": (0, MAX_OUTPUT_LEN),
                   "prompt_tokens": (0, _INT64[1]), "cached_tokens": (0, _INT64[1])}


def run_from_dict(data: Any) -> StoredRun:
    """The inverse of `run_to_dict`; a ValueError names the first field that is missing, unknown, mistyped or out
    of range, and the first request that is inconsistent (chunk lists of different lengths, an index twice)."""
    if isinstance(data, dict) and isinstance(data.get("summary"), dict):  # exported null metrics are NaN
        data = {**data, "summary": {k: math.nan if v is None else v for k, v in data["summary"].items()}}
    run = dataclass_from_dict(StoredRun, data, "run", optional={"caveat", "requests", "kernels", "invocation"}, ranges=_RUN_RANGES)
    if run.status not in (*FINAL_STATUSES, "running"):
        raise ValueError(f"run {run.id} has status {run.status!r}, not one of {', '.join(FINAL_STATUSES)}, running")
    if (problem := load_problem(run.load)) is not None:
        raise ValueError(f"run {run.id}: {problem}")
    run.requests = [_request_from_dict(r, f"run {run.id} request") for r in run.requests]
    indices = [r.index for r in run.requests]
    if len(set(indices)) < len(indices):
        twice = next(i for i in indices if indices.count(i) > 1)
        raise ValueError(f"run {run.id} lists request index {twice} twice")
    _check_physics(run)
    return run


LAST_EPOCH_S = 253402300799.0  # 9999-12-31 23:59:59 UTC: the last time a run's date can be shown


def _check_physics(run: StoredRun) -> None:
    """Raise `ImpossibleRun` naming the run (and request) that no bench could have measured."""
    for name in ("started_at", "finished_at"):
        if (when := getattr(run, name)) is not None and not 0 <= when <= LAST_EPOCH_S:
            raise ImpossibleRun(f"run {run.id} {name} {when:g} is not a time between 1970 and 9999")
    if run.finished_at is not None and run.finished_at < run.started_at:
        raise ImpossibleRun(f"run {run.id} finished at {run.finished_at} before it started at {run.started_at}")
    for request in run.requests:
        where = f"run {run.id} request {request.index}"
        if not request.warmup and not 0 <= request.index < run.num_requests:
            raise ImpossibleRun(f"{where}: index out of range (its measured requests are 0..{run.num_requests - 1})")
        if problem := _timing_problem(request):
            raise ImpossibleRun(f"{where}: {problem}")
    measured_count = sum(not r.warmup for r in run.requests)
    if run.status == "ok" and run.requests and measured_count != run.num_requests:
        raise ImpossibleRun(f"run {run.id} is marked ok but holds {measured_count} of its {run.num_requests} "
                            "requests")


def _timing_problem(request: RequestRecord) -> str | None:
    """What makes one request's record impossible, if anything: times out of order or more tokens than asked."""
    times = [request.dispatch_s, *request.chunk_s]
    if request.chunk_s and request.chunk_s[0] < request.dispatch_s:
        return f"first token at {request.chunk_s[0]} s, before its dispatch at {request.dispatch_s} s (negative TTFT)"
    if any(later < earlier for earlier, later in zip(times[1:], times[2:])):
        return "chunk times run backwards"
    if request.completion_s is not None and request.completion_s < times[-1]:
        return f"completion at {request.completion_s} s, before its last chunk or dispatch at {times[-1]} s"
    if (tokens := max(sum(request.chunk_tokens), request.output_tokens)) > request.max_new_tokens:
        return f"{tokens} tokens for a request of at most {request.max_new_tokens}"
    return None


def _request_from_dict(data: Any, what: str) -> RequestRecord:
    request = dataclass_from_dict(RequestRecord, data, what, optional={"cached_tokens"}, derived={"ok"},
                                  ranges=_REQUEST_RANGES)
    where = f"{what} {request.index}"
    if len(request.chunk_s) != len(request.chunk_tokens):
        raise ValueError(f"{where} has {len(request.chunk_s)} chunk_s but {len(request.chunk_tokens)} chunk_tokens")
    if not all(0 < k <= MAX_OUTPUT_LEN for k in request.chunk_tokens):
        raise ValueError(f"{where}'s chunk_tokens must each be in [1, {MAX_OUTPUT_LEN}]")
    if request.ok and not request.chunk_s:
        raise ValueError(f"{where} completed without an error but has no chunk (no first token)")
    return request


def dataclass_from_dict(cls: type, data: Any, what: str, optional: set[str] = frozenset(),
                        derived: set[str] = frozenset(), ranges: dict[str, tuple[int, int]] | None = None) -> Any:
    """`cls(**data)` once every field is present (or has a default and is in `optional`) with its declared type,
    every int within `ranges` (else SQLite's 64 bits) and every float finite; keys in `derived` (computed on
    export) are dropped. A ValueError names the field."""
    if not isinstance(data, dict):
        raise ValueError(f"a {what} is {type(data).__name__}, not an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    if unknown := sorted(set(data) - set(fields) - derived):
        raise ValueError(f"a {what} has unknown field(s) {field_names(unknown)}")
    if missing := sorted(n for n in fields if n not in data and n not in optional):
        raise ValueError(f"a {what} lacks field(s) {', '.join(missing)}")
    for name, value in data.items():
        limit = MAX_NAME_CHARS if name in _NAMES else MAX_TEXT_CHARS
        if (longest := _longest_string(value)) > limit:
            raise ValueError(f"a {what}'s {name} holds a string of {longest} characters (at most {limit})")
        if name in fields and not _conforms(value, hints[name]):
            raise ValueError(f"a {what}'s {name} is {value!r:.40}, not {_type_name(hints[name])}")
        low, high = (ranges or {}).get(name, _INT64)
        if _is_number(value, int) and not low <= value <= high:
            raise ValueError(f"a {what}'s {name} is {value!r:.40}, not in [{low}, {high}]")
        if name in fields and name != "summary" and not _all_finite(value):
            raise ValueError(f"a {what}'s {name} holds a non-finite number")
    return cls(**{k: v for k, v in data.items() if k in fields})


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type, containers and their items too; an int fits float, a bool no
    number, and an int beyond 64 bits none."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if dataclasses.is_dataclass(hint):  # an object, validated as its own record
        return isinstance(value, dict)
    if hint in (int, float):
        return _is_number(value, hint) and not (isinstance(value, int) and not _INT64[0] <= value <= _INT64[1])
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(v, args[1]) for v in value.values())
    return isinstance(value, hint)


def _is_number(value: Any, kind: type) -> bool:
    return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)


def _longest_string(value: Any) -> int:
    """The length of the longest string in a JSON value, keys included (0: none)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return max(map(_longest_string, value), default=0)
    if isinstance(value, dict):
        return max((max(len(str(k)), _longest_string(v)) for k, v in value.items()), default=0)
    return 0


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(_all_finite, value))
    return True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


# --- summaries on import -----------------------------------------------------------------------------------------

@dataclass
class SummaryCheck:
    """What import made of one run's exported summary: `stale` names the metrics that disagreed with the run's
    requests (the summary was replaced by theirs); `unverified` is a run without requests (summary as exported)."""

    run: StoredRun
    stale: list[str]
    unverified: bool


def derive_summary(run: StoredRun) -> SummaryCheck:
    """Recompute a run's summary from its requests, and mark an `ok` run with failed requests `failed` (as `mpfa
    bench` does). A run exported without requests keeps its summary, marked unverified."""
    if run.status == "running":  # never finished: no summary to check (`mpfa show` derives one)
        return SummaryCheck(run, [], unverified=False)
    if not run.requests:
        return SummaryCheck(run, [], unverified=True)
    derived = summarize(run.requests)
    underivable = _underivable()
    stale = sorted(k for k in set(derived) | set(run.summary) - set(underivable)
                   if not _same(run.summary.get(k), derived.get(k)))
    kept = {} if stale else {k: run.summary[k] for k in underivable if k in run.summary}
    failed = [r for r in measured(run.requests) if not r.ok]
    status, error = run.status, run.error
    if failed and status == "ok":
        status, error = "failed", f"{len(failed)} request(s) failed: {failed[0].error or 'no completion'}"
    fixed = dataclasses.replace(run, summary=derived | kept, status=status, error=error)
    return SummaryCheck(fixed, stale, unverified=False)


def _underivable() -> list[str]:
    """The summary keys no request record can give (the goodput SLO is not stored with a run): kept on import only
    from a summary that agrees with the requests on everything else."""
    return [c.key for m in registry.METRICS.values() if isinstance(m, registry.RunValue) and m.needs_slo
            for c in m.columns()]


def _same(stored: float | None, derived: float | None) -> bool:
    if stored is None or derived is None:
        return stored is derived
    return math.isclose(stored, derived, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(stored) and math.isnan(derived))


def _write(runs: Sequence[StoredRun], fmt: str, stream: TextIO, include_requests: bool) -> None:
    if fmt == "json":
        doc = {"runs": [run_to_dict(r, include_requests) for r in runs]}
        json.dump(doc, stream, indent=2, allow_nan=False)
        stream.write("\n")
        return
    metric_columns = sorted({k for r in runs for k in r.summary})
    writer = csv.DictWriter(stream, fieldnames=[*_CSV_RUN_COLUMNS, *metric_columns])
    writer.writeheader()
    for run in runs:
        row: dict[str, Any] = {c: getattr(run, c) for c in _CSV_RUN_COLUMNS}
        row["load"] = load_key(run.load)
        row["kernels"] = kernels_text(run.kernels)
        row.update({k: _finite_or_none(v) for k, v in run.summary.items()})
        writer.writerow({k: csv_safe(v) for k, v in row.items()})


def kernels_text(kernels: Any) -> str:
    """`describe_kernels`, or what a record that holds no kernel names holds (a run stored by an older mpfa)."""
    if isinstance(kernels, dict) and all(isinstance(v, str) for v in kernels.values()):
        return describe_kernels(kernels)
    return f"unreadable ({json.dumps(kernels)[:80]})"


def csv_safe(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: a string starting =, +, -, @ (or a tab or CR, which some read past)
    would be run as a formula (`=HYPERLINK(...)` in a scenario name), so it gets a leading '."""
    return f"'{value}" if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def _finite_or_none(value: float) -> float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value
