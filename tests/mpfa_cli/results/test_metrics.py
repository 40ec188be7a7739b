"""Metrics on hand-built records whose values are checked by hand in the comments."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mpfa.mpfa_cli.results.metrics import per_request, registry, repeats
from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.harness.records import RequestRecord


def rec(dispatch, chunks, completion, index=0, warmup=False, error=None) -> RequestRecord:
    """`chunks` = [(arrival_s, tokens), ...]."""
    return RequestRecord(
        index=index, input_len=16, max_new_tokens=sum(k for _, k in chunks), dispatch_s=dispatch, warmup=warmup,
        chunk_s=[t for t, _ in chunks], chunk_tokens=[k for _, k in chunks], completion_s=completion,
        output_tokens=sum(k for _, k in chunks), prompt_tokens=16, error=error,
    )


# A: TTFT 0.5, E2E 0.9, 4 tokens -> TPOT (0.9 - 0.5) / 3; a 2-token chunk 0.2 s after the first -> ITL 0.1, 0.1
A = rec(10.0, [(10.5, 1), (10.7, 2), (10.8, 1)], 10.9)
# B: TTFT 0.7, E2E 1.5, 3 tokens -> TPOT 0.4; ITL 0.3, 0.5
B = rec(11.0, [(11.7, 1), (12.0, 1), (12.5, 1)], 12.5, index=1)
# C: one token, TTFT 0.2 -> no TPOT, no ITL
C = rec(12.0, [(12.2, 1)], 12.2, index=2)


def test_per_request_metrics():
    assert per_request.ttft_s(A) == pytest.approx(0.5)
    assert per_request.e2e_s(A) == pytest.approx(0.9)
    assert per_request.tpot_s(A) == pytest.approx(0.4 / 3)
    assert per_request.itl_gaps_s(A) == pytest.approx([0.1, 0.1, 0.1])
    assert per_request.itl_gaps_s(B) == pytest.approx([0.3, 0.5])
    assert per_request.tpot_s(C) is None and per_request.itl_gaps_s(C) == []


def test_extra_tokens_in_the_first_chunk_add_no_gaps():
    r = rec(0.0, [(1.0, 3), (1.6, 3)], 1.6)
    assert per_request.itl_gaps_s(r) == pytest.approx([0.2, 0.2, 0.2])
    assert per_request.tpot_s(r) == pytest.approx(0.6 / 5)


def test_summary_values():
    s = summarize([A, B, C])
    assert s["n_ok"] == 3 and s["n_failed"] == 0
    assert s["ttft_ms_mean"] == pytest.approx((500 + 700 + 200) / 3)
    assert s["ttft_ms_median"] == pytest.approx(500)
    assert s["ttft_ms_p90"] == pytest.approx(660)  # linear interpolation between 500 and 700 at rank 1.8
    assert s["ttft_ms_std"] == pytest.approx(np.std([500, 700, 200]))
    assert s["tpot_ms_mean"] == pytest.approx((400 / 3 + 400) / 2)  # C has no TPOT
    assert s["itl_ms_mean"] == pytest.approx(np.mean([100, 100, 100, 300, 500]))
    assert s["itl_ms_p99"] == pytest.approx(np.percentile([100, 100, 100, 300, 500], 99))
    assert s["e2e_s_mean"] == pytest.approx((0.9 + 1.5 + 0.2) / 3)
    # span: first dispatch 10.0 to last completion 12.5 = 2.5 s; 4 + 3 + 1 = 8 tokens
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["otps"] == pytest.approx(8 / 2.5)
    assert s["req_per_s"] == pytest.approx(3 / 2.5)
    assert "goodput_req_per_s" not in s


def test_warmup_and_failed_requests_are_excluded_from_statistics():
    warm = rec(0.0, [(5.0, 4)], 9.0, index=-1, warmup=True)
    failed = rec(9.5, [(9.6, 1)], None, index=3, error="ServerDisconnectedError")
    s = summarize([warm, A, B, C, failed])
    assert s["n_ok"] == 3 and s["n_failed"] == 1
    assert s["ttft_ms_mean"] == pytest.approx((500 + 700 + 200) / 3)
    # the span is the completed requests': from A's dispatch (10.0) to B's completion (12.5)
    assert s["duration_s"] == pytest.approx(2.5) and s["otps"] == pytest.approx(8 / 2.5)


def test_a_request_that_never_connected_does_not_stretch_the_duration():
    never_sent = rec(0.0, [], None, index=3, error="ClientConnectorError: refused")
    s = summarize([A, B, C, never_sent])
    assert s["duration_s"] == pytest.approx(2.5) and s["n_failed"] == 1


def test_goodput_under_slo():
    # A: TTFT 500 ms, TPOT 133 ms -> meets; B: TTFT 700 ms -> misses; C: TTFT 200 ms, no TPOT -> meets
    s = summarize([A, B, C], slo={"ttft": 600, "tpot": 150})
    assert s["goodput_req_per_s"] == pytest.approx(2 / 2.5)
    # TPOT 100 ms: A's 133 ms now misses; C still meets (no TPOT)
    assert summarize([A, B, C], slo={"tpot": 100})["goodput_req_per_s"] == pytest.approx(1 / 2.5)


def test_bad_slo_is_rejected():
    with pytest.raises(ValueError, match="unknown SLO"):
        summarize([A], slo={"ttfb": 100})
    with pytest.raises(ValueError, match="> 0"):
        summarize([A], slo={"ttft": 0})


def test_only_failed_requests_give_counts_only():
    failed = rec(1.0, [], None, error="HTTP 400: bad")
    assert summarize([failed]) == {"n_ok": 0.0, "n_failed": 1.0}


def test_t_quantile_known_values_and_scipy():
    assert repeats.t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)  # textbook tables
    assert repeats.t_quantile_975(10) == pytest.approx(2.2281, abs=1e-4)
    assert repeats.t_quantile_975(1000) == pytest.approx(1.9623, abs=1e-4)
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 80):
        assert repeats.t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-9)


def test_mean_ci95():
    ci = repeats.mean_ci95([1.0, 2.0, 3.0, 4.0])
    s = math.sqrt(sum((x - 2.5) ** 2 for x in [1, 2, 3, 4]) / 3)
    assert ci.mean == 2.5 and ci.n == 4
    assert ci.half_width == pytest.approx(3.182446 * s / 2, rel=1e-6)  # t(0.975, 3) = 3.182446
    single = repeats.mean_ci95([7.0])
    assert single.mean == 7.0 and single.half_width is None
    with pytest.raises(ValueError):
        repeats.mean_ci95([])


def test_ci_covers_the_true_mean_95_percent_of_the_time():
    rng = np.random.default_rng(20240)
    samples = rng.normal(3.0, 2.0, size=(4000, 5))
    hits = 0
    for row in samples:
        ci = repeats.mean_ci95(row.tolist())
        hits += abs(ci.mean - 3.0) <= ci.half_width
    assert 0.94 <= hits / len(samples) <= 0.96


def test_every_summary_key_is_a_declared_column_in_declaration_order():
    summary = summarize([A, B, C], slo={"ttft": 600})
    declared = [c.key for metric in registry.METRICS.values() for c in metric.columns()]
    assert all(key in declared for key in summary)
    assert list(summary) == [key for key in declared if key in summary]
    assert all(metric.explanation.strip() for metric in registry.METRICS.values())
