"""The metric registry: the columns each report reads, their labels, and declarations it refuses."""
from __future__ import annotations

import pytest

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.results.metrics import registry
from mpfa.mpfa_cli.results.metrics.registry import Report, RunValue


def test_each_report_reads_its_columns_from_the_declarations():
    assert registry.shown_in(Report.COMPARE) == ["otps", "hit_rate", "ttft_ms_median", "ttft_ms_p99",
                                                 "tpot_ms_median", "itl_ms_p99", "kv_tokens"]
    assert registry.shown_in(Report.GATE) == registry.shown_in(Report.RUNS) == ["otps", "ttft_ms_median",
                                                                               "tpot_ms_median"]


@pytest.mark.parametrize(("key", "label", "higher"), [
    ("otps", "OTPS (tok/s)", True), ("ttft_ms_median", "TTFT p50 (ms)", False), ("e2e_s_p90", "E2E p90 (s)", False),
    ("goodput_req_per_s", "goodput (req/s)", True), ("kv_tokens", "KV cache (tokens)", True),
])
def test_a_column_is_labelled_and_directed_by_its_metric(key, label, higher):
    assert registry.column(key).label == label
    assert registry.higher_is_better(key) is higher


def test_counts_and_unknown_names_have_no_direction():
    for key in ("n_ok", "duration_s", "ttft_p50"):
        with pytest.raises(UserError, match=f"unknown metric '{key}': use otps, req_per_s"):
            registry.higher_is_better(key)
    assert registry.find("ttft_p50") is None and registry.column("n_ok").unit == "requests"


def test_a_name_or_column_declared_twice_is_refused():
    for clash in (dict(name="otps"), dict(name="other", key="otps")):
        with pytest.raises(ValueError, match="declared twice"):
            registry.register(RunValue(header="x", unit="x", better=None, explanation="x", value=lambda run: 0.0,
                                       **clash))
    assert list(registry.METRICS)[-1] == "kv_tokens"  # nothing was added
