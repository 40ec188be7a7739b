"""What metrics are computed from: one request's timings, and a run's measured requests (`Sample`).

Warmup records are never measured; failed records are counted but never enter a latency or a throughput.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...harness.records import RequestRecord

SLO_KEYS = ("ttft", "tpot")


def measured(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.warmup]


def ttft_s(r: RequestRecord) -> float:
    return r.chunk_s[0] - r.dispatch_s


def e2e_s(r: RequestRecord) -> float:
    return r.completion_s - r.dispatch_s


def tpot_s(r: RequestRecord) -> float | None:
    """None when the request produced a single token (no inter-token time exists)."""
    if r.output_tokens < 2:
        return None
    return (e2e_s(r) - ttft_s(r)) / (r.output_tokens - 1)


def itl_gaps_s(r: RequestRecord) -> list[float]:
    gaps: list[float] = []
    for j in range(1, len(r.chunk_s)):
        k = r.chunk_tokens[j]
        gaps.extend([(r.chunk_s[j] - r.chunk_s[j - 1]) / k] * k)
    return gaps


def validate_slo(slo: dict[str, float]) -> None:
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"unknown SLO key(s) {', '.join(sorted(unknown))}; valid: {', '.join(SLO_KEYS)}")
    for key, value in slo.items():
        if not value > 0:
            raise ValueError(f"SLO '{key}' must be > 0 ms, got {value}")


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    if "ttft" in slo and ttft_s(r) * 1e3 > slo["ttft"]:
        return False
    tpot = tpot_s(r)
    return not ("tpot" in slo and tpot is not None and tpot * 1e3 > slo["tpot"])


# Below a nanosecond no clock measured the span: a rate over it would be meaningless (over a subnormal span, infinite).
MIN_SPAN_S = 1e-9


@dataclass(frozen=True)
class Sample:
    """A run's requests as its metrics see them: the measured ones, those that succeeded, their span and the
    goodput SLO (in ms; empty without one)."""

    requests: list[RequestRecord]
    ok: list[RequestRecord]
    span_s: float | None  # first successful dispatch to last completion; None under MIN_SPAN_S
    slo: dict[str, float]

    @classmethod
    def of(cls, records: Iterable[RequestRecord], slo: dict[str, float] | None = None) -> Sample:
        runs = measured(records)
        ok = [r for r in runs if r.ok]
        # The completed requests' span: a failed request's dispatch may be on another clock (the simulator's
        # modelled times replace only completed ones) or an attempt that never reached the server.
        span = max(r.completion_s for r in ok) - min(r.dispatch_s for r in ok) if ok else 0.0
        return cls(runs, ok, span if span >= MIN_SPAN_S else None, slo or {})
