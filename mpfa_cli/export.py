"""Export stored runs as JSON (full records) or CSV (one row per run with its summary metrics); read JSON
exports back (`mpfa import`).

Every exported run carries `simulated` and `caveat`, so simulator numbers cannot pass for measurements, nor
caveated numbers (measured, but not the backend's own) for clean ones, downstream, and the `kernels` its server ran
(CSV: as one line, `describe_kernels`).
Non-finite metric values are written as JSON null / an empty CSV cell. A JSON export read back gives the runs
as exported (null metrics as NaN); exports written before runs had a `caveat` read as caveat None, and those
written without `--requests` as runs without requests, and those written before runs had `kernels` as runs with none
recorded.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from mpfa.harness.errors import UserError
from mpfa.harness.records import RequestRecord
from mpfa.harness.served_kernels import describe_kernels
from mpfa.harness.store import FINAL_STATUSES, StoredRun, load_key

EXPORT_FORMATS = ("json", "csv")

# Run metadata written to every CSV row, in column order; summary metrics follow.
_CSV_RUN_COLUMNS = (
    "id", "scenario", "backend", "engine", "simulated", "caveat", "load", "repeat", "input_len", "output_len",
    "num_requests", "seed", "workload_hash", "started_at", "finished_at", "status", "error", "model", "gpu",
    "kernels",
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
            with dest.open("w", newline="", encoding="utf-8") as stream:
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


def read_export(path: Path) -> list[StoredRun]:
    """The runs of a JSON export written by `export_runs` (ids as exported); anything else is a UserError."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path} is not an mpfa JSON export (not JSON; `mpfa export` writes one)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise UserError(f"{path} is not an mpfa JSON export (no top-level \"runs\" list)")
    try:
        return [run_from_dict(data) for data in doc["runs"]]
    except ValueError as exc:
        raise UserError(f"{path} is not an mpfa JSON export: {exc}") from None


def run_from_dict(data: Any) -> StoredRun:
    """The inverse of `run_to_dict`; a ValueError names the first field that is missing, unknown or mistyped."""
    run = _dataclass_from_dict(StoredRun, data, "run", optional={"caveat", "requests", "kernels"})
    if run.status not in (*FINAL_STATUSES, "running"):
        raise ValueError(f"run {run.id} has status {run.status!r}, not one of {', '.join(FINAL_STATUSES)}, running")
    run.summary = {k: math.nan if v is None else v for k, v in run.summary.items()}
    run.requests = [_dataclass_from_dict(RequestRecord, r, f"run {run.id} request", derived={"ok"})
                    for r in run.requests]
    return run


def _dataclass_from_dict(cls: type, data: Any, what: str, optional: set[str] = frozenset(),
                         derived: set[str] = frozenset()) -> Any:
    """`cls(**data)` once every field is present (or has a default and is in `optional`) with its declared type;
    keys in `derived` (computed on export) are dropped."""
    if not isinstance(data, dict):
        raise ValueError(f"a {what} is {type(data).__name__}, not an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    if unknown := sorted(set(data) - set(fields) - derived):
        raise ValueError(f"a {what} has unknown field(s) {', '.join(unknown)}")
    if missing := sorted(n for n in fields if n not in data and n not in optional):
        raise ValueError(f"a {what} lacks field(s) {', '.join(missing)}")
    for name, value in data.items():
        if name in fields and not _conforms(value, hints[name]):
            raise ValueError(f"a {what}'s {name} is {value!r:.40}, not {hints[name]}")
    return cls(**{k: v for k, v in data.items() if k in fields})


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type: containers by their outer type; an int fits float, a bool no number."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


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
        row["kernels"] = describe_kernels(run.kernels)
        row.update({k: _finite_or_none(v) for k, v in run.summary.items()})
        writer.writerow(row)


def _finite_or_none(value: float) -> float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value
