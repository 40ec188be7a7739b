"""run_bench stores the backend's caveat on a measured run whose server environment it applies to
(`MPFA_PREFILL=reference`), and prints it once before the backend's runs start; a simulated run gets none. Driven against the simulator over real HTTP, as a `--url` server."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.bench import runner as bench
from mpfa.mpfa_cli.bench.runner import BenchOptions, run_bench
from mpfa.mpfa_cli.harness.scenario import Scenario
from mpfa.mpfa_cli.results.store import ResultStore

CAVEAT = BACKENDS["mpfa"].caveat


@pytest.mark.parametrize(("measured", "prefill", "expected"), [
    (True, "reference", CAVEAT), (True, None, None), (False, "reference", None)],
    ids=["measured-reference-prefill", "measured-kernel-prefill", "simulated"])
def test_measured_runs_carry_the_caveat_and_simulated_runs_do_not(start_sim, tmp_path, monkeypatch, measured,
                                                                  prefill, expected):
    if prefill:
        monkeypatch.setenv("MPFA_PREFILL", prefill)
    else:
        monkeypatch.delenv("MPFA_PREFILL", raising=False)
    server = start_sim("mpfa")
    if measured:  # answer /get_server_info as SGLang serving the plugin would: without the simulator's flag
        fetch_json = bench.fetch_json
        monkeypatch.setattr(bench, "fetch_json", lambda url, body=None: {
            k: v for k, v in fetch_json(url, body).items() if k != "simulated"})
    scenario = Scenario(name="tiny", description="", model="llama-3.1-8b", input_len=[64], output_len=2,
                        num_requests=2, warmup_requests=0, repeats=2, seed=1, concurrency=[2])
    out = io.StringIO()
    with ResultStore(tmp_path / "r.db") as store:
        ids = run_bench(scenario, [BACKENDS["mpfa"]], BenchOptions(engine="url", run_dir=tmp_path, url=server.url),
                        store, Console(file=out, width=300, color_system=None))
        runs = store.get_runs(ids)
    assert [(r.status, r.simulated, r.caveat) for r in runs] == [("ok", not measured, expected)] * 2
    assert out.getvalue().count(f"mpfa † caveat: {CAVEAT}") == (1 if expected else 0)
