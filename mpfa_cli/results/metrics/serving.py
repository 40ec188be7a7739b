"""The serving metrics every run reports, one declaration each, in the order of a run's summary.

The headline three (`mpfa runs`, the gate) are OTPS and the TTFT and TPOT medians: medians rather than means or p99
because they move with the kernels, not with one straggler request; p99 is too noisy over a handful of repeats to
gate on.
"""
from __future__ import annotations

from .per_request import Sample, e2e_s, itl_gaps_s, meets_slo, tpot_s, ttft_s
from .registry import Distribution, Report, RunValue, ServerValue, register

register(RunValue(
    name="n_ok", header="ok", unit="requests", better=None,
    explanation="Measured requests that completed.",
    value=lambda run: float(len(run.ok))))
register(RunValue(
    name="n_failed", header="failed", unit="requests", better=None,
    explanation="Measured requests that failed: they enter no latency and no throughput.",
    value=lambda run: float(len(run.requests) - len(run.ok))))
register(Distribution(
    name="ttft", header="TTFT", unit="ms", better="lower",
    shown={"median": Report.HEADLINE, "p99": Report.COMPARE},
    explanation="Time to first token: from dispatching the request to the arrival of the first chunk carrying an "
                "output token. Includes queueing on the server and the whole prefill.",
    values=lambda run: [ttft_s(r) * 1e3 for r in run.ok]))
register(Distribution(
    name="tpot", header="TPOT", unit="ms", better="lower", shown={"median": Report.HEADLINE},
    explanation="Time per output token, per request: (E2E - TTFT) / (output tokens - 1). Undefined for requests "
                "with a single output token, which are left out of it.",
    values=lambda run: [t * 1e3 for t in map(tpot_s, run.ok) if t is not None]))
register(Distribution(
    name="itl", header="ITL", unit="ms", better="lower", shown={"p99": Report.COMPARE},
    explanation="Inter-token latency: the gaps between consecutive output tokens, pooled over all requests. A chunk "
                "carrying k tokens that arrives dt after the previous chunk contributes k gaps of dt/k; extra tokens "
                "in the first chunk contribute none (they arrive with the first token).",
    values=lambda run: [g * 1e3 for r in run.ok for g in itl_gaps_s(r)]))
register(Distribution(
    name="e2e", header="E2E", unit="s", better="lower",
    explanation="End-to-end latency: from dispatch to the end of the response stream.",
    values=lambda run: [e2e_s(r) for r in run.ok]))
register(RunValue(
    name="duration_s", header="duration", unit="s", better=None,
    explanation="The span of the successful requests, from the first one's dispatch to the last completion: what "
                "the throughputs divide by.",
    value=lambda run: run.span_s))
register(RunValue(
    name="otps", header="OTPS", unit="tok/s", better="higher", shown=Report.HEADLINE,
    explanation="Output tokens per second: output tokens of successful requests divided by the time from the "
                "first successful request's dispatch to the last completion.",
    value=lambda run: sum(r.output_tokens for r in run.ok) / run.span_s if run.span_s else None))
register(RunValue(
    name="req_per_s", header="requests", unit="req/s", better="higher",
    explanation="Request throughput: successful requests over the same span as OTPS.",
    value=lambda run: len(run.ok) / run.span_s if run.span_s else None))
register(RunValue(
    name="goodput", key="goodput_req_per_s", header="goodput", unit="req/s", better="higher", needs_slo=True,
    explanation="Goodput: requests per second that finished and met every given SLO (TTFT and/or TPOT, in ms); "
                "a request without a TPOT (one output token) meets any TPOT SLO.",
    value=lambda run: sum(meets_slo(r, run.slo) for r in run.ok) / run.span_s if run.span_s else None))


def _cached_tokens(run: Sample) -> float | None:
    """Prompt tokens of the successful requests that the server found in its prefix cache; None where no request
    reported it (servers that do not say)."""
    reported = [r.cached_tokens for r in run.ok if r.cached_tokens is not None]
    return float(sum(reported)) if reported else None


def _hit_rate(run: Sample) -> float | None:
    cached = _cached_tokens(run)
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in run.ok)
    return None if cached is None or not prompt else 100.0 * cached / prompt


register(RunValue(
    name="cached_tokens", header="cached", unit="tokens", better=None,
    explanation="Prompt tokens of the successful requests that the server found in its prefix (radix) cache, as "
                "it reports them (SGLang's meta_info.cached_tokens, OpenAI's prompt_tokens_details); a run whose "
                "total differs from what its workload declares is flagged.",
    value=_cached_tokens))
register(RunValue(
    name="hit_rate", header="prefix hits", unit="%", better="higher", shown=Report.COMPARE,
    explanation="Prefix-cache hit rate: cached prompt tokens over all prompt tokens of the successful requests. "
                "Only workloads that share prefixes (shared-prefix, multi-turn) are served with the cache on.",
    value=_hit_rate))
register(ServerValue(
    name="kv_tokens", header="KV cache", unit="tokens", better="higher", server_key="max_total_num_tokens",
    shown=Report.COMPARE,
    explanation="Tokens the server's KV cache holds, as it reports them (max_total_num_tokens); more means more "
                "context fits at once."))

# What `mpfa metrics --explain` says besides the metrics.
GLOSSARY = {
    "stats": "mean, median, p90, p99 (linear interpolation, as numpy.percentile) and std (population) over "
             "successful measured requests.",
    "ci95": "Across repeats: the mean of the per-repeat values and the half-width of its 95% confidence "
            "interval, t(0.975, n-1) * s / sqrt(n) with the sample standard deviation s (needs n >= 2).",
    "warmup": "Warmup requests run before the measured ones and are excluded from every metric.",
}
