"""Caveated runs through the CLI (in this process: these commands start nothing): `mpfa runs` marks them, `mpfa gate`
refuses them unless --allow-caveats."""
from __future__ import annotations

import json

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.harness.records import RunRecord
from mpfa.mpfa_cli.results.store import ResultStore

CAVEAT = BACKENDS["mpfa"].caveat


def _store_runs(db, started_at: float = 1_764_000_000.0) -> None:
    """Two repeats each of a measured fa4-bf16 and a measured, caveated mpfa run, finished ok."""
    with ResultStore(db) as store:
        for backend in ("fa4-bf16", "mpfa"):
            for repeat in range(2):
                run = RunRecord(
                    scenario="smoke", backend=backend, engine="sglang", simulated=False, load={"concurrency": 2},
                    repeat=repeat, input_len=256, output_len=8, num_requests=4, seed=3, workload_hash="5a1e",
                    started_at=started_at + repeat, caveat=BACKENDS[backend].caveat, model="llama-3.1-8b",
                    gpu="NVIDIA H200",
                )
                store.finish_run(store.begin_run(run), "ok", summary={
                    "otps": 100.0 + repeat, "ttft_ms_median": 50.0 + repeat, "tpot_ms_median": 5.0 + repeat})


def test_runs_marks_and_gate_refuses_caveated_runs_unless_allowed(mpfa, tmp_path) -> None:
    _store_runs(mpfa.db)
    listed = mpfa.invoke("runs")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("mpfa †") == 2 and "fa4-bf16 †" not in listed.stdout
    assert " ".join(listed.stdout.split()).count(CAVEAT) == 1

    baseline = tmp_path / "baseline.json"
    refused = mpfa.invoke("gate", "--baseline", str(baseline), "--write-baseline")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "carry a caveat" in refused.stderr and "--allow-caveats" in refused.stderr and not baseline.exists()

    written = mpfa.invoke("gate", "--baseline", str(baseline), "--write-baseline", "--allow-caveats")
    assert written.returncode == 0, written.stderr
    assert {e["caveat"] for e in json.loads(baseline.read_text())["entries"]} == {None, CAVEAT}
    _store_runs(mpfa.db, started_at=1_764_000_100.0)  # measured anew
    judged = mpfa.invoke("gate", "--baseline", str(baseline), "--allow-caveats", "--verbose")
    assert judged.returncode == 0, judged.stderr
    assert "Gate passed" in judged.stdout and "mpfa †" in judged.stdout
