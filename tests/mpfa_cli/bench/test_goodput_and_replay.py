"""The goodput search (its rate sweep, and its answer on the simulator: bounded and monotone in the SLO) and a trace
replay through `mpfa bench` on the simulator (each request's own lengths and send time)."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.bench.goodput import GoodputSearch, next_rates
from mpfa.mpfa_cli.bench.runner import BenchOptions, run_bench
from mpfa.mpfa_cli.commands.bench import _parse_slo
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.engines import resolve_backends
from mpfa.mpfa_cli.harness.scenario import load_scenario
from mpfa.mpfa_cli.results.store import ResultStore


def _sweep(start: float, most: int, passes) -> list[float]:
    """The rates `next_rates` probes when a rate passes iff `passes(rate)`."""
    rates, probed = next_rates(start, most), []
    rate = next(rates)
    while rate is not None:
        probed.append(rate)
        rate = rates.send(passes(rate))
    return probed


def test_the_sweep_brackets_then_bisects_within_its_probes():
    probed = _sweep(1.0, 8, lambda rate: rate <= 5.0)
    assert probed[:4] == [1.0, 2.0, 4.0, 8.0]  # doubled until a rate fails
    assert len(probed) <= 8 and all(4.0 <= r <= 8.0 for r in probed[4:])
    passed = max(r for r in probed if r <= 5.0)
    failed = min(r for r in probed if r > 5.0)
    assert failed / passed <= 1.1 or len(probed) == 8


def test_the_sweep_halves_when_the_start_fails_and_stops_at_its_bounds():
    assert _sweep(1.0, 3, lambda rate: False) == [1.0, 0.5, 0.25]
    assert len(_sweep(1.0, 64, lambda rate: False)) < 64  # stops under the lowest rate worth probing
    assert len(_sweep(1.0, 64, lambda rate: True)) < 64  # and at the highest rate a scenario takes
    assert _sweep(1.0, 1, lambda rate: True) == [1.0]


def _search(tmp_path: Path, slo: dict[str, float]) -> GoodputSearch:
    scenario = load_scenario("smoke", {"input_len": [4096], "output_len": 16, "num_requests": 12,
                                       "warmup_requests": 0, "repeats": 1, "rate": [1.0]})
    search = GoodputSearch(scenario, slo, share=0.9, most_probes=6)
    opts = BenchOptions(engine="sim", run_dir=tmp_path, time_scale=1e-4, slo=slo)
    with ResultStore(tmp_path / f"results-{slo['ttft']}.db") as store:
        ids = run_bench(scenario, resolve_backends("fa4-bf16", "sim"), opts, store, Console(file=io.StringIO()),
                        steps=search.steps, most_steps=search.most_probes)
        runs = store.get_runs(ids)
    [result] = search.results
    assert len(runs) == len(result.probes) <= 6 and all(run.status == "ok" for run in runs)
    assert [run.load["rate"] for run in runs] == [rate for rate, _ in result.probes]  # each probe a stored run
    assert all("goodput" in "".join(run.summary) for run in runs)
    return search


def test_the_search_on_the_simulator_is_bounded_and_monotone_in_the_slo(tmp_path):
    tight, loose = (_search(tmp_path, {"ttft": ttft, "tpot": 100.0}).results[0] for ttft in (400.0, 4000.0))
    for result in (tight, loose):
        passing = [rate for rate, share in result.probes if share >= 0.9]
        assert result.rate == (max(passing) if passing else None)
        assert all(share < 0.9 for rate, share in result.probes if result.rate is None or rate > result.rate)
    assert loose.rate is not None and (tight.rate or 0.0) < loose.rate  # a looser TTFT bound admits a higher rate


@pytest.mark.parametrize("text, slo", [
    ("ttft=2s,tpot=50ms", {"ttft": 2000.0, "tpot": 50.0}),
    ("ttft=2000, tpot = 50", {"ttft": 2000.0, "tpot": 50.0}),
    ("ttft=0.5s", {"ttft": 500.0}),
])
def test_slo_values_take_units(text, slo):
    assert _parse_slo(text) == slo


@pytest.mark.parametrize("text", ["ttft=2m", "ttft=", "ttft=-1s", "e2e=3", "ttft=infs", "ttft=nan"])
def test_a_bad_slo_is_one_error(text):
    with pytest.raises(UserError, match="--slo"):
        _parse_slo(text)


@pytest.mark.parametrize("args, error", [
    (["--goodput-search"], "--goodput-search needs --slo"),
    (["--goodput-search", "--slo", "ttft=1s", "-s", "mooncake-sample"], "a trace replay sets its own send times"),
    (["--goodput-search", "--slo", "ttft=1s", "--goodput-share", "1.5"], "--goodput-share: expected a share"),
    (["--goodput-search", "--slo", "ttft=1s", "--goodput-probes", "0"], "--goodput-probes: expected an integer"),
    (["--goodput-search", "--slo", "ttft=1s", "--format", "csv"], "prints its answer as a table or json"),
])
def test_goodput_search_flags_are_checked(tmp_path, args, error):
    result = CliRunner().invoke(app, ["bench", "--engine", "sim", "--db", str(tmp_path / "r.db"), *args])
    assert result.exit_code != 0 and error in result.output


def test_goodput_search_prints_its_answer_as_json(tmp_path):
    result = CliRunner().invoke(app, [
        "bench", "--engine", "sim", "--db", str(tmp_path / "r.db"), "-b", "fa4-bf16,mpfa", "--input-len", "2048",
        "--num-requests", "8", "--output-len", "8", "--warmup-requests", "0", "--goodput-search",
        "--slo", "ttft=1s,tpot=50ms", "--goodput-probes", "3", "--format", "json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout[result.stdout.index("["):])
    assert [a["backend"] for a in answer] == ["fa4-bf16", "mpfa"]
    assert all(len(a["probes"]) <= 3 and a["slo_ms"] == {"ttft": 1000.0, "tpot": 50.0} for a in answer)


def test_a_trace_replay_sends_each_request_its_own_lengths_at_its_time(tmp_path):
    scenario = load_scenario("mooncake-sample", {"speedup": 4.0})
    trace = scenario.trace
    opts = BenchOptions(engine="sim", run_dir=tmp_path, time_scale=1e-4)
    with ResultStore(tmp_path / "r.db") as store:
        [run_id] = run_bench(scenario, resolve_backends("mpfa", "sim"), opts, store, Console(file=io.StringIO()))
        [run] = store.get_runs([run_id], with_requests=True)
    assert run.status == "ok" and run.load == {"trace": "mooncake-sample", "speedup": 4.0}
    requests = sorted(run.requests, key=lambda r: r.index)
    assert [r.input_len for r in requests] == [t.input_length for t in trace.requests]
    assert [r.max_new_tokens for r in requests] == [r.output_tokens for r in requests] == trace.output_lengths()
    # on the modelled clock each request arrives at its trace time / speedup
    starts = [r.dispatch_s - requests[0].dispatch_s for r in requests]
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(starts, trace.send_times(4.0)))
