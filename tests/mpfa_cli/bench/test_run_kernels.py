"""run_bench records the kernels a measured server ran: what the server reports, else what the backend runs for the
model's heads on one tensor-parallel rank (`served_kernels`). Driven against the simulator over real HTTP, as a
`--url` server answering /get_server_info as SGLang does (no `simulated`, no `kernels`)."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.bench import runner as bench
from mpfa.mpfa_cli.bench.runner import BenchOptions, run_bench
from mpfa.mpfa_cli.harness.scenario import Scenario
from mpfa.mpfa_cli.results.store import ResultStore


def _measured_runs(start_sim, tmp_path, monkeypatch, model: str, tp: int = 1, reported: bool = False) -> list:
    server = start_sim("mpfa", model=model)
    fetch_json = bench.fetch_json
    hidden = ("simulated",) if reported else ("simulated", "kernels")
    monkeypatch.setattr(bench, "fetch_json", lambda url, body=None: {
        k: v for k, v in fetch_json(url, body).items() if k not in hidden})
    scenario = Scenario(name="tiny", description="", model=model, input_len=[64], output_len=2, num_requests=1,
                        warmup_requests=0, repeats=1, seed=1, concurrency=[1])
    with ResultStore(tmp_path / "r.db") as store:
        ids = run_bench(scenario, [BACKENDS["mpfa"]], BenchOptions(engine="url", run_dir=tmp_path, url=server.url,
                                                                   tp=tp), store, Console(file=io.StringIO()))
        return store.get_runs(ids)


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPFA_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("MPFA_PREFILL", raising=False)
    monkeypatch.delenv("MPFA_NUMERICS", raising=False)


@pytest.mark.parametrize(("tp", "prefill"), [(1, "fp8"), (8, "mma-sync")], ids=["40:8-heads", "5:1-heads-per-rank"])
def test_the_kernels_follow_the_heads_of_one_rank(start_sim, tmp_path, monkeypatch, tp, prefill):
    [run] = _measured_runs(start_sim, tmp_path, monkeypatch, "qwen3-14b", tp)
    assert (run.simulated, run.kernels) == (False, {"prefill": prefill, "decode": "split-kv", "numerics": "paper",
                                                    "source": "dispatch"})


def test_the_reference_prefill_path_is_recorded(start_sim, tmp_path, monkeypatch):
    monkeypatch.setenv("MPFA_PREFILL", "reference")
    [run] = _measured_runs(start_sim, tmp_path, monkeypatch, "llama-3.1-8b")
    assert run.kernels["prefill"] == "pytorch-reference" and run.caveat is not None


def test_the_served_numerics_are_recorded(start_sim, tmp_path, monkeypatch):
    monkeypatch.setenv("MPFA_NUMERICS", "had128-k46")  # the benchmark's environment, which its servers inherit
    [run] = _measured_runs(start_sim, tmp_path, monkeypatch, "llama-3.1-8b")
    assert run.kernels["numerics"] == "had128-k46"


def test_what_the_server_reports_is_recorded(start_sim, tmp_path, monkeypatch):
    [run] = _measured_runs(start_sim, tmp_path, monkeypatch, "llama-3.1-8b", reported=True)
    assert run.kernels == {"prefill": "fp8", "decode": "split-kv", "numerics": "paper", "source": "simulated"}
