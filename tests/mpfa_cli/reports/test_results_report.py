"""Reports: compare speedups and CIs on hand-checked numbers, simulated labelling, clear errors."""
from __future__ import annotations

import math

import pytest
from rich.console import Console

from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.reports.tables import (compare_records, compare_rows, compare_table, compare_tables,
                                          default_reference, format_compare, runs_table, show_run, speedup)

T975_DF2 = 4.302652729911275  # Student t 0.975 quantile, 2 degrees of freedom


def render(renderable) -> str:
    console = Console(record=True, width=250, color_system=None)
    console.print(renderable)
    return console.export_text()


def two_backends(make_run, **overrides):
    """fa4-bf16 (reference) and mpfa, three repeats each, OTPS and median TTFT set by hand."""
    otps = {"fa4-bf16": [100.0, 120.0, 110.0], "mpfa": [220.0, 240.0, 200.0]}
    ttft = {"fa4-bf16": [300.0, 330.0, 270.0], "mpfa": [100.0, 110.0, 90.0]}
    return [
        make_run(b, i, {"otps": otps[b][i], "ttft_ms_median": ttft[b][i]}, **overrides)
        for b in otps for i in range(3)
    ]


def test_compare_speedups_and_confidence_intervals(make_run):
    backends, rows = compare_rows(two_backends(make_run), "fa4-bf16", ["otps", "ttft_ms_median"])
    assert backends == ["fa4-bf16", "mpfa"]
    by_metric = {r.metric: r for r in rows}
    assert by_metric["otps"].speedups == {"mpfa": pytest.approx(220.0 / 110.0)}  # throughput: x / ref
    assert by_metric["ttft_ms_median"].speedups == {"mpfa": pytest.approx(300.0 / 100.0)}  # latency: ref / x
    ref = by_metric["otps"].values["fa4-bf16"]
    half = T975_DF2 * 10.0 / math.sqrt(3)  # sample std of 100, 120, 110 is 10
    assert (ref.mean, ref.n) == (pytest.approx(110.0), 3)
    assert ref.ci_low == pytest.approx(110.0 - half) and ref.ci_high == pytest.approx(110.0 + half)


def test_compare_table_shows_speedup_column_and_no_simulated_marker(make_run):
    text = render(compare_table(two_backends(make_run), "fa4-bf16", ["otps", "ttft_ms_median"]))
    assert "mpfa speedup" in text and "2.00×" in text and "3.00×" in text
    assert "110 ± 24.84" in text  # mean ± 95% CI half-width: 4.3027 * 10 / sqrt(3)
    assert "SIMULATED" not in text


def test_compare_title_says_simulated(make_run):
    runs = two_backends(make_run, simulated=True, engine="sim")
    assert render(compare_table(runs, "fa4-bf16", ["otps"])).lstrip().startswith("SIMULATED")


def test_compare_groups_by_context_and_load(make_run):
    runs = [
        make_run(b, 0, {"otps": v}, input_len=n, load={"concurrency": c})
        for b, scale in (("fa4-bf16", 1.0), ("mpfa", 1.5))
        for n in (16384, 32768) for c in (1, 16)
        for v in [scale * n / c]
    ]
    _, rows = compare_rows(runs, "fa4-bf16", ["otps"])
    assert [(r.config.input_len, r.config.load_label) for r in rows] == [
        (16384, "c=1"), (16384, "c=16"), (32768, "c=1"), (32768, "c=16")]
    assert all(r.speedups["mpfa"] == pytest.approx(1.5) for r in rows)
    assert all(r.values["mpfa"].n == 1 and r.values["mpfa"].half_width is None for r in rows)


def test_compare_leaves_out_runs_that_did_not_finish_ok(make_run):
    runs = two_backends(make_run) + [make_run("mpfa", 3, {"otps": 1e9}, status="failed")]
    _, rows = compare_rows(runs, "fa4-bf16", ["otps"])
    assert rows[0].values["mpfa"].mean == pytest.approx(220.0)
    assert "1 run(s) that did not finish ok" in render(compare_table(runs, "fa4-bf16", ["otps"]))


def test_missing_reference_is_a_clear_error(make_run):
    with pytest.raises(UserError, match="reference backend 'triton-bf16' has no ok run"):
        compare_table(two_backends(make_run), "triton-bf16")


def test_mixing_simulated_and_measured_runs_is_refused(make_run):
    runs = [make_run("mpfa", 0, {"otps": 1.0}), make_run("mpfa", 1, {"otps": 1.0}, simulated=True)]
    with pytest.raises(UserError, match="mix simulated and measured"):
        compare_rows(runs, "mpfa", ["otps"])


def test_unknown_metric_is_a_clear_error(make_run):
    with pytest.raises(UserError, match="unknown metric 'ttft_p50'"):
        compare_rows(two_backends(make_run), "fa4-bf16", ["ttft_p50"])


def test_speedup_direction():
    assert speedup("otps", 100.0, 150.0) == pytest.approx(1.5)
    assert speedup("tpot_ms_median", 30.0, 20.0) == pytest.approx(1.5)
    assert math.isnan(speedup("ttft_ms_p99", 30.0, 0.0))


def test_runs_table_labels_simulated_runs(make_run):
    runs = [make_run("mpfa", 0, {"otps": 1234.5}, id=7, engine="sim", simulated=True),
            make_run("fa4-bf16", 0, {"otps": 99.0}, id=8)]
    text = render(runs_table(runs))
    assert "SIMULATED" in text and "simulated runs come from the latency model (engine sim)" in text
    assert " sim " in text and "1234" in text
    measured = render(runs_table(runs[1:]))
    assert "simulated" not in measured.lower()


def test_show_run_prints_metadata_and_distribution_stats(make_run, random_requests):
    requests = random_requests(9)
    summary = summarize(requests)
    text = render(show_run(make_run("mpfa", 0, summary, id=3, requests=requests)))
    for expected in ("mpfa", "16K input", "c=8", "TTFT (ms)", "TPOT (ms)", "p99", "n_failed", "otps"):
        assert expected in text
    assert f"{summary['ttft_ms_p99']:.0f}" in text or f"{summary['ttft_ms_p99']:.2f}" in text


def test_show_unfinished_run_summarizes_recorded_requests(make_run, random_requests):
    requests = random_requests(5)
    run = make_run("mpfa", 0, None, status="running", finished_at=None, requests=requests, simulated=True)
    text = render(show_run(run))
    assert "SIMULATED" in text and "never finished" in text and "TTFT (ms)" in text


def test_kv_capacity_comes_from_the_servers_own_report(make_run):
    runs = [make_run("fa4-bf16", 0, {"otps": 10.0}, server_info={"max_total_num_tokens": 905_984}),
            make_run("mpfa", 0, {"otps": 20.0}, server_info={"max_total_num_tokens": 2_179_840}),
            make_run("mpfa-direct", 0, {"otps": 20.0}, server_info={"max_total_num_tokens": True}),  # not a count
            make_run("flashinfer-fp8", 0, {"otps": 15.0, "kv_tokens": 1.0})]  # a summary value is not the server's
    _, rows = compare_rows(runs, "fa4-bf16", ["kv_tokens"])
    (row,) = rows
    assert set(row.values) == {"fa4-bf16", "mpfa"}
    assert row.speedups == {"mpfa": pytest.approx(2_179_840 / 905_984)}  # more tokens is better
    assert "kv_tokens (tokens)" in render(compare_table(runs, "fa4-bf16", ["kv_tokens"]))


def _measured_on(machine: str, revision: str = "abc123") -> dict[str, str]:
    return {"machine": machine, "mpfa_revision": revision}


def test_ratios_of_runs_measured_together_carry_no_mark(make_run):
    runs = two_backends(make_run, environment=_measured_on("boot-1/42"))
    _, rows = compare_rows(runs, "fa4-bf16", ["otps"])
    assert rows[0].apart == {"mpfa": ()}
    assert "§" not in render(compare_tables(runs, "fa4-bf16", ["otps"]))


@pytest.mark.parametrize(("change", "kind"), [
    ({"environment": _measured_on("boot-2/42", "def456")}, "machine"),
    ({"environment": _measured_on("boot-1/42", "0123ab")}, "revision"),
    ({"gpu": "NVIDIA H100 80GB HBM3"}, "GPU"),
])
def test_a_ratio_across_machines_gpus_or_revisions_is_flagged(make_run, change, kind):
    runs = two_backends(make_run, environment=_measured_on("boot-1/42", "def456"))
    runs[0] = make_run("fa4-bf16", 0, runs[0].summary, environment=_measured_on("boot-1/42", "def456-dirty"))
    mpfa_last = {**{"environment": runs[-1].environment}, **change}
    runs[-1] = make_run("mpfa", 2, runs[-1].summary, **mpfa_last)  # one of mpfa's three repeats comes from elsewhere
    _, rows = compare_rows(runs, "fa4-bf16", ["otps"])
    assert rows[0].apart == {"mpfa": (kind,)}
    text = render(compare_tables(runs, "fa4-bf16", ["otps"]))
    assert "2.00× §" in text and "mpfa at 16K c=8" in text
    assert f"§ measured on different machines or revisions (different {kind})" in text
    assert compare_records(runs, "fa4-bf16", ["otps"])[1]["apart"] == kind
    assert "§ measured on different machines or revisions" in format_compare(runs, "fa4-bf16", "md", ["otps"])


def test_simulated_runs_are_not_flagged_for_their_machine(make_run):
    runs = two_backends(make_run, simulated=True, engine="sim", environment=_measured_on("boot-1/42"))
    runs[-1] = make_run("mpfa", 2, runs[-1].summary, simulated=True, engine="sim",
                        environment=_measured_on("boot-9/7"))
    assert compare_rows(runs, "fa4-bf16", ["otps"])[1][0].apart == {"mpfa": ()}


def test_the_default_reference_is_the_strongest_baseline_measured(make_run):
    runs = [make_run(b) for b in ("mpfa", "fa4-bf16", "flashinfer-fp8")]
    assert default_reference(runs) == "flashinfer-fp8"
    assert default_reference([*runs, make_run("fa3-fp8")]) == "fa3-fp8"
    assert default_reference([*runs, make_run("fa3-fp8", status="failed")]) == "flashinfer-fp8"  # ok runs only
    assert default_reference([make_run("mpfa-direct"), make_run("mpfa")]) == "mpfa"
    with pytest.raises(UserError, match="no run among these finished ok"):
        default_reference([make_run("mpfa", status="failed")])
