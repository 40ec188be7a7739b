"""Gate: fails only on a drop beyond tolerance with separated CIs; refuses incomparable results."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from rich.console import Console

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.reports.gate import (baseline_from_runs, gate_summary, gate_table, parse_tolerance, read_baseline, run_gate,
                                        write_baseline, write_github_benchmark)


def render(renderable) -> str:
    console = Console(record=True, width=250, color_system=None)
    console.print(renderable)
    return console.export_text()


def jittered(rng, centre: float, spread: float, n: int = 5) -> list[float]:
    return [centre * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_throughput_drop_beyond_tolerance_with_separated_cis_fails(rng, runs_with):
    baseline = baseline_from_runs(runs_with("otps", {"mpfa": jittered(rng, 1000.0, 0.01)}))
    result = run_gate(baseline, runs_with("otps", {"mpfa": jittered(rng, 850.0, 0.01)}), tolerance=0.05)
    assert not result.ok
    (check,) = result.regressions
    assert check.entry.metric == "otps" and check.worsening == pytest.approx(0.15, abs=0.03)
    assert gate_summary(result).startswith("Gate FAILED: 1 of 1 point(s): 1 regression(s)")
    assert "regression" in render(gate_table(result))


def test_latency_rise_beyond_tolerance_with_separated_cis_fails(rng, runs_with):
    baseline = baseline_from_runs(runs_with("ttft_ms_median", {"mpfa": jittered(rng, 200.0, 0.01)}))
    slower = runs_with("ttft_ms_median", {"mpfa": jittered(rng, 240.0, 0.01)})
    assert not run_gate(baseline, slower, tolerance=0.05).ok
    faster = runs_with("ttft_ms_median", {"mpfa": jittered(rng, 160.0, 0.01)})
    result = run_gate(baseline, faster, tolerance=0.05)
    assert result.ok and result.checks[0].status == "improved"


def test_drop_within_overlapping_cis_passes(rng, runs_with):
    noisy_base = [1000.0 * (1 + d) for d in (-0.3, 0.3, -0.2, 0.2, 0.0)]
    baseline = baseline_from_runs(runs_with("otps", {"mpfa": noisy_base}))
    result = run_gate(baseline, runs_with("otps", {"mpfa": [v * 0.9 for v in noisy_base]}), tolerance=0.05)
    assert result.ok and result.checks[0].status == "within noise"
    assert result.checks[0].worsening == pytest.approx(0.10)


def test_small_drop_within_tolerance_passes_even_with_separated_cis(rng, runs_with):
    baseline = baseline_from_runs(runs_with("otps", {"mpfa": jittered(rng, 1000.0, 0.001)}))
    result = run_gate(baseline, runs_with("otps", {"mpfa": jittered(rng, 970.0, 0.001)}), tolerance=0.05)
    assert result.ok and result.checks[0].status == "ok"


def test_single_repeat_falls_back_to_tolerance(runs_with):
    baseline = baseline_from_runs(runs_with("otps", {"mpfa": [1000.0]}))
    assert not run_gate(baseline, runs_with("otps", {"mpfa": [900.0]}), tolerance=0.05).ok
    assert run_gate(baseline, runs_with("otps", {"mpfa": [990.0]}), tolerance=0.05).ok


@pytest.mark.parametrize("field,value,message", [
    ("gpu", "NVIDIA B200", "GPU 'NVIDIA H200' but the results with 'NVIDIA B200'"),
    ("model", "qwen3-32b", "model"),
    ("simulated", True, "baseline is measured but the results are simulated"),
])
def test_incomparable_results_are_refused(rng, runs_with, field, value, message):
    baseline = baseline_from_runs(runs_with("otps", {"mpfa": jittered(rng, 1000.0, 0.01)}))
    other = runs_with("otps", {"mpfa": jittered(rng, 1000.0, 0.01)}, **{field: value})
    with pytest.raises(UserError, match=message):
        run_gate(baseline, other)


def test_unmatched_results_are_refused_and_unmeasured_entries_reported(rng, runs_with):
    baseline = baseline_from_runs(runs_with("otps", {"mpfa": [1000.0, 1010.0], "fa4-bf16": [500.0, 505.0]}))
    with pytest.raises(UserError, match="none of the results match"):
        run_gate(baseline, runs_with("otps", {"mpfa": [1000.0]}, scenario="other"))
    result = run_gate(baseline, runs_with("otps", {"mpfa": [1000.0, 1005.0]}))
    assert sorted(c.status for c in result.checks) == ["missing", "ok"] and not result.ok
    assert run_gate(baseline, runs_with("otps", {"mpfa": [1000.0, 1005.0]}), allow_missing=True).ok


def test_baseline_round_trip(tmp_path, rng, make_run):
    runs = [
        make_run(b, i, {"otps": rng.uniform(900, 1100), "ttft_ms_median": rng.uniform(90, 110),
                        "tpot_ms_median": rng.uniform(9, 11), "itl_ms_p99": 1.0}, load=load)
        for b in ("fa4-bf16", "mpfa") for i in range(3)
        for load in ({"concurrency": 1}, {"rate": 0.5, "burstiness": 1.0})
    ]
    written = write_baseline(runs, tmp_path / "sub" / "baseline.json")
    doc = json.loads((tmp_path / "sub" / "baseline.json").read_text())
    assert {"gpu", "model", "simulated", "created_at", "entries"} <= set(doc)
    assert {e["metric"] for e in doc["entries"]} == {"otps", "ttft_ms_median", "tpot_ms_median"}
    assert len(doc["entries"]) == 2 * 2 * 3
    assert read_baseline(tmp_path / "sub" / "baseline.json") == written
    # The baseline's own runs are not a re-measurement; the same numbers measured later pass.
    assert {c.status for c in run_gate(written, runs).checks} == {"not re-measured"}
    assert run_gate(written, [replace(r, started_at=r.started_at + 1000) for r in runs], tolerance=0.0).ok


def test_bad_baseline_and_tolerance_are_clear_errors(tmp_path):
    bad = tmp_path / "b.json"
    bad.write_text('{"gpu": "x"}')
    with pytest.raises(UserError, match='b.json: expected an object with a non-empty "entries" list'):
        read_baseline(bad)
    with pytest.raises(UserError, match="cannot read baseline"):
        read_baseline(tmp_path / "missing.json")
    assert parse_tolerance("5%") == pytest.approx(0.05) and parse_tolerance("0.1") == pytest.approx(0.1)
    for text in ("five", "150%", "-1%"):
        with pytest.raises(UserError, match="--tolerance"):
            parse_tolerance(text)


def test_github_benchmark_files_split_by_direction(tmp_path, rng, make_run):
    runs = [make_run("mpfa", i, {"otps": rng.uniform(900, 1100), "ttft_ms_median": rng.uniform(90, 110)},
                     simulated=True, engine="sim") for i in range(3)]
    write_github_benchmark(runs, tmp_path / "bigger.json", tmp_path / "smaller.json")
    (bigger,) = json.loads((tmp_path / "bigger.json").read_text())
    (smaller,) = json.loads((tmp_path / "smaller.json").read_text())
    assert bigger["name"] == "paper/16K/c=8/mpfa/otps" and bigger["unit"] == "tok/s"
    assert bigger["value"] == pytest.approx(sum(r.summary["otps"] for r in runs) / 3)
    assert bigger["range"].startswith("± ") and "SIMULATED" in bigger["extra"]
    assert smaller["name"].endswith("/ttft_ms_median") and smaller["unit"] == "ms"
