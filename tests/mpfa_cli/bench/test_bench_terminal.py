"""Whatever breaks inside a measurement, its run ends `failed` with the reason and the requests it completed."""
from __future__ import annotations

import pytest
from rich.console import Console

from mpfa.mpfa_cli.bench import runner as bench
from mpfa.mpfa_cli.harness import client
from mpfa.mpfa_cli.bench.runner import BenchOptions, run_bench
from mpfa.mpfa_cli.harness.engines import resolve_backends
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.scenario import load_scenario
from mpfa.mpfa_cli.results.store import ResultStore


def test_an_exception_inside_a_measurement_fails_the_run_and_keeps_its_requests(tmp_path, monkeypatch):
    real_run_load = client.run_load

    async def breaks_after_the_load(*args, **kwargs):
        await real_run_load(*args, **kwargs)
        raise OverflowError("int too large to convert")

    monkeypatch.setattr(bench.client, "run_load", breaks_after_the_load)
    scenario = load_scenario("smoke", {"num_requests": 3, "warmup_requests": 0, "concurrency": [1], "repeats": 1,
                                       "input_len": [256], "output_len": 4})
    store = ResultStore(tmp_path / "mpfa.db")
    opts = BenchOptions(engine="sim", run_dir=tmp_path / "runs", time_scale=0.01)
    try:
        with pytest.raises(UserError, match="run 1 failed: OverflowError: int too large to convert"):
            run_bench(scenario, resolve_backends("fa4-bf16", "sim"), opts, store, Console(quiet=True))
        (run,) = store.get_runs([1], with_requests=True)
    finally:
        store.close()
    assert run.status == "failed" and run.error == "OverflowError: int too large to convert"
    assert len(run.requests) == 3 and all(r.ok for r in run.requests) and run.summary["n_ok"] == 3
