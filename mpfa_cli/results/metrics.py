"""Serving metrics from request records: latency distributions, throughput, goodput, and repeat statistics.

All functions are pure. Warmup records are always excluded; failed records are counted (`n_failed`) but
never enter latency statistics or throughput. A metric that is undefined for a run (no successful request,
TPOT with one output token each, goodput without an SLO) is left out of the summary rather than invented.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..harness.records import RequestRecord

EXPLANATIONS: dict[str, str] = {
    "ttft": "Time to first token: from dispatching the request to the arrival of the first chunk carrying an "
            "output token. Includes queueing on the server and the whole prefill.",
    "tpot": "Time per output token, per request: (E2E - TTFT) / (output tokens - 1). Undefined for requests with "
            "a single output token, which are left out of it.",
    "itl": "Inter-token latency: the gaps between consecutive output tokens, pooled over all requests. A chunk "
           "carrying k tokens that arrives dt after the previous chunk contributes k gaps of dt/k; extra tokens "
           "in the first chunk contribute none (they arrive with the first token).",
    "e2e": "End-to-end latency: from dispatch to the end of the response stream.",
    "otps": "Output tokens per second: output tokens of successful requests divided by the time from the "
            "first successful request's dispatch to the last completion.",
    "req_per_s": "Request throughput: successful requests over the same span as OTPS.",
    "goodput": "Goodput: requests per second that finished and met every given SLO (TTFT and/or TPOT, in ms); "
               "a request without a TPOT (one output token) meets any TPOT SLO.",
    "stats": "mean, median, p90, p99 (linear interpolation, as numpy.percentile) and std (population) over "
             "successful measured requests.",
    "ci95": "Across repeats: the mean of the per-repeat values and the half-width of its 95% confidence "
            "interval, t(0.975, n-1) * s / sqrt(n) with the sample standard deviation s (needs n >= 2).",
    "warmup": "Warmup requests run before the measured ones and are excluded from every metric.",
}

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


def _stats(prefix: str, values: Sequence[float], scale: float) -> dict[str, float]:
    if not values:
        return {}
    v = np.asarray(values, dtype=np.float64) * scale
    return {
        f"{prefix}_mean": float(v.mean()),
        f"{prefix}_median": float(np.median(v)),
        f"{prefix}_p90": float(np.percentile(v, 90)),
        f"{prefix}_p99": float(np.percentile(v, 99)),
        f"{prefix}_std": float(v.std()),
    }


def _validate_slo(slo: dict[str, float]) -> None:
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


def summarize(records: Iterable[RequestRecord], slo: dict[str, float] | None = None) -> dict[str, float]:
    """Flat metrics of one run: `ttft_ms_*`, `tpot_ms_*`, `itl_ms_*`, `e2e_s_*`, throughputs and counts."""
    if slo:
        _validate_slo(slo)
    runs = measured(records)
    ok = [r for r in runs if r.ok]
    summary: dict[str, float] = {"n_ok": float(len(ok)), "n_failed": float(len(runs) - len(ok))}
    if not ok:
        return summary
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    summary |= _stats("ttft_ms", [ttft_s(r) for r in ok], 1e3)
    summary |= _stats("tpot_ms", tpots, 1e3)
    summary |= _stats("itl_ms", [g for r in ok for g in itl_gaps_s(r)], 1e3)
    summary |= _stats("e2e_s", [e2e_s(r) for r in ok], 1.0)
    # The completed requests' span: a failed request's dispatch may be on another clock (the simulator's
    # modelled times replace only completed ones) or an attempt that never reached the server.
    span = max(r.completion_s for r in ok) - min(r.dispatch_s for r in ok)
    if span > 0:
        summary["duration_s"] = span
        summary["otps"] = sum(r.output_tokens for r in ok) / span
        summary["req_per_s"] = len(ok) / span
        if slo:
            summary["goodput_req_per_s"] = sum(meets_slo(r, slo) for r in ok) / span
    return summary


# --- repeats -------------------------------------------------------------------------------------------------


def _t_coverage(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer `df` (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        term = total = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * total)
    term = total = 1.0
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        total += term
    return math.sin(theta) * total


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (bisection on the exact CDF)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    low, high = 0.0, 64.0  # t(0.975, 1) = 12.7
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_coverage(mid, df) < 0.95 else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class MeanCI:
    mean: float
    half_width: float | None  # None with a single repeat
    n: int


def mean_ci95(values: Sequence[float]) -> MeanCI:
    """Mean and 95% confidence half-width (Student t) of independent repeat values."""
    if not values:
        raise ValueError("no values to average")
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return MeanCI(float(v[0]), None, 1)
    half = t_quantile_975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return MeanCI(float(v.mean()), half, len(v))


def aggregate_repeats(summaries: Sequence[dict[str, float]]) -> dict[str, MeanCI]:
    """Per key present in every repeat's summary: mean and 95% CI across repeats."""
    if not summaries:
        return {}
    keys = set(summaries[0]).intersection(*summaries[1:])
    return {k: mean_ci95([s[k] for s in summaries]) for k in sorted(keys)}
