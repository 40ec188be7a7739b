"""The metric registry: each metric a run reports is declared once, with `register`, and every report reads it.

A metric has a name (`mpfa metrics` lists it), a header and a unit (tables print "TTFT p50 (ms)"), the direction
that is better (None for a count or a span, which are never compared), an explanation (`mpfa metrics --explain`),
how a run's requests give it, and the reports that show each of its columns. A column is one number per run, named
by its key: a distribution's stat (`ttft_ms_median`), a run value (`otps`) or a value the server reports
(`kv_tokens`). Summaries, exports and `mpfa show` hold every column; `Report` names the others that show one.

Three kinds, after where a run's number comes from:
* `Distribution`: a value per request (or pooled over them), summarised by every stat of `STATS`;
* `RunValue`: one value per run from its requests (a throughput, a count);
* `ServerValue`: one value per run from the server's own report (/get_server_info), not from the requests.
Reports list run values first, then distributions, then server values; each kind in the order it was declared.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar

import numpy as np

from ...errors import UserError
from ...harness.records import RunRecord
from .per_request import Sample

Better = Literal["higher", "lower"]


class Report(enum.Flag):
    """The reports that show a column, besides the summary, exports and `mpfa show` (which hold every one)."""

    NONE = 0
    RUNS = enum.auto()  # a column of `mpfa runs`
    COMPARE = enum.auto()  # a row of every point of `mpfa compare`
    GATE = enum.auto()  # an entry of a gate baseline and of the github-action-benchmark files
    HEADLINE = RUNS | COMPARE | GATE


@dataclass(frozen=True)
class Stat:
    name: str  # a distribution's keys end in it: ttft_ms_<name>
    label: str  # what tables print
    of: Callable[[np.ndarray], float]


STATS = {stat.name: stat for stat in (
    Stat("mean", "mean", lambda v: float(v.mean())),
    Stat("median", "p50", lambda v: float(np.median(v))),
    Stat("p90", "p90", lambda v: float(np.percentile(v, 90))),  # linear interpolation
    Stat("p99", "p99", lambda v: float(np.percentile(v, 99))),
    Stat("std", "std", lambda v: float(v.std())),  # population
)}


@dataclass(frozen=True, kw_only=True)
class Metric:
    name: str
    header: str
    unit: str
    better: Better | None
    explanation: str
    rank: ClassVar[int]  # where reports list this kind of metric

    def columns(self) -> list[Column]:
        raise NotImplementedError

    def summarize(self, sample: Sample) -> dict[str, float]:
        """Its summary entries for one run: none where the run does not define it."""
        return {}

    def read(self, run: RunRecord, key: str) -> float:
        """A run's value of its column `key` (NaN when the run has none)."""
        return float(run.summary.get(key, math.nan))


@dataclass(frozen=True, kw_only=True)
class Distribution(Metric):
    """`values` in `unit` per request (or pooled over requests), summarised by every stat of STATS under the keys
    <name>_<unit>_<stat>; `shown` names the reports of each stat's column (by stat name)."""

    values: Callable[[Sample], Sequence[float]]
    shown: Mapping[str, Report] = field(default_factory=dict)
    rank: ClassVar[int] = 1

    def columns(self) -> list[Column]:
        return [Column(f"{self.name}_{self.unit}_{stat.name}", self, stat, self.shown.get(stat.name, Report.NONE))
                for stat in STATS.values()]

    def summarize(self, sample: Sample) -> dict[str, float]:
        values = np.asarray(self.values(sample), dtype=np.float64)
        return {c.key: c.stat.of(values) for c in self.columns()} if values.size else {}


@dataclass(frozen=True, kw_only=True)
class RunValue(Metric):
    """One value per run under `key` (default: the name); `value` is None where the run does not define it.
    `needs_slo`: given only with a goodput SLO, which is not stored with a run (import cannot recompute it)."""

    value: Callable[[Sample], float | None]
    key: str | None = None
    needs_slo: bool = False
    shown: Report = Report.NONE
    rank: ClassVar[int] = 0

    def columns(self) -> list[Column]:
        return [Column(self.key or self.name, self, None, self.shown)]

    def summarize(self, sample: Sample) -> dict[str, float]:
        value = None if self.needs_slo and not sample.slo else self.value(sample)
        return {} if value is None else {self.key or self.name: value}


@dataclass(frozen=True, kw_only=True)
class ServerValue(Metric):
    """One value per run that its server reports (`server_key` of /get_server_info); not in the summary."""

    server_key: str
    shown: Report = Report.NONE
    rank: ClassVar[int] = 2

    def columns(self) -> list[Column]:
        return [Column(self.name, self, None, self.shown)]

    def read(self, run: RunRecord, key: str) -> float:
        value = (run.server_info or {}).get(self.server_key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


@dataclass(frozen=True, eq=False)
class Column:
    """One number a metric gives per run, named by `key`."""

    key: str
    metric: Metric
    stat: Stat | None  # a distribution's
    shown: Report

    @property
    def unit(self) -> str:
        return self.metric.unit

    @property
    def label(self) -> str:
        """'TTFT p50 (ms)' for ttft_ms_median, 'OTPS (tok/s)' for otps: the name a table prints, with its unit."""
        name = self.metric.header if self.stat is None else f"{self.metric.header} {self.stat.label}"
        return f"{name} ({self.unit})"

    def read(self, run: RunRecord) -> float:
        return self.metric.read(run, self.key)


METRICS: dict[str, Metric] = {}  # by name, in declaration order: the order of a summary's keys
M = TypeVar("M", bound=Metric)


def register(metric: M) -> M:
    """Declare `metric`: from now on summaries give its columns and every report reads it."""
    keys = [c.key for c in metric.columns()]
    taken = [k for k in keys if k in _columns()]
    if metric.name in METRICS or taken or len(set(keys)) < len(keys):
        raise ValueError(f"metric '{metric.name}' or its column(s) {', '.join(taken or keys)} declared twice")
    METRICS[metric.name] = metric
    return metric


def _columns() -> dict[str, Column]:
    return {c.key: c for metric in METRICS.values() for c in metric.columns()}


def find(key: str) -> Column | None:
    return _columns().get(key)


def column(key: str) -> Column:
    """The column `key` names; an unknown key is a UserError."""
    if (found := find(key)) is None:
        raise UserError(_unknown(key))
    return found


def higher_is_better(key: str) -> bool:
    """Whether more is better in column `key`; an unknown key, or one without a better direction, is a UserError."""
    found = find(key)
    if found is None or found.metric.better is None:
        raise UserError(_unknown(key))
    return found.metric.better == "higher"


def _unknown(key: str) -> str:
    ranked = [c for c in _columns().values() if c.metric.better]
    single = ", ".join(c.key for c in ranked if c.stat is None)
    example = next((f" such as {c.key}" for c in ranked if c.stat is not None), "")
    return (f"unknown metric '{key}': use {single} or a distribution's <name>_<unit>_<stat>{example} "
            "(`mpfa metrics --explain` lists them)")


def shown_in(report: Report) -> list[str]:
    """The keys of the columns `report` shows: run values, then distributions, then server values."""
    return [c.key for c in sorted(_columns().values(), key=lambda c: c.metric.rank) if c.shown & report]
