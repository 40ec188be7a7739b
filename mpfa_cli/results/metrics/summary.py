"""A run's summary: the columns of every registered metric, from the run's request records."""
from __future__ import annotations

from collections.abc import Iterable

from ...harness.records import RequestRecord
from . import registry
from .per_request import Sample, validate_slo


def summarize(records: Iterable[RequestRecord], slo: dict[str, float] | None = None) -> dict[str, float]:
    """Flat metrics of one run in declaration order (`n_ok`, `n_failed`, `ttft_ms_*`, ..., the throughputs). A
    metric that the run does not define (no successful request, TPOT with one output token each, goodput without
    an SLO) is left out of the summary rather than invented. The records are taken in request order, not in the
    order they finished: floating-point sums depend on order, and equal runs must summarize to the same bits."""
    if slo:
        validate_slo(slo)
    sample = Sample.of(sorted(records, key=lambda r: r.index), slo)
    summary: dict[str, float] = {}
    for metric in registry.METRICS.values():
        summary |= metric.summarize(sample)
    return summary
