"""Export stored runs as JSON (full records) or CSV (one row per run with its summary metrics).

Every exported run carries `simulated` and `caveat`, so simulator numbers cannot pass for measurements, nor
caveated numbers (measured, but not the backend's own) for clean ones, downstream.
Non-finite metric values are written as JSON null / an empty CSV cell.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from mpfa.cli.errors import UserError
from mpfa.cli.store import StoredRun, load_key

EXPORT_FORMATS = ("json", "csv")

# Run metadata written to every CSV row, in column order; summary metrics follow.
_CSV_RUN_COLUMNS = (
    "id", "scenario", "backend", "engine", "simulated", "caveat", "load", "repeat", "input_len", "output_len",
    "num_requests", "seed", "workload_hash", "started_at", "finished_at", "status", "error", "model", "gpu",
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
        row.update({k: _finite_or_none(v) for k, v in run.summary.items()})
        writer.writerow(row)


def _finite_or_none(value: float) -> float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value
