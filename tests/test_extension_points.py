"""A backend and a metric are each declared once: a toy of each, registered through their registries alone (an
extension module that `$MPFA_EXTENSIONS` names, written by the test, never shipped), shows in `mpfa backends` and
`mpfa metrics --explain`; the toy backend runs on the simulator with its own latency-model costs, and its runs,
with the toy metric, reach compare's table, the gate and the export."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

TOY = "toy-bf16"
TOY_METRIC = "toy_tokens_per_request"
OUTPUT_LEN = 8  # every simulated request produces this many tokens: the toy metric's value
# Declared more efficient than fa4-bf16 in every simulated cost, so its modelled OTPS must come out higher.
TOY_MODULE = f'''
from mpfa.backends.specs import BF16_BYTES_PER_ELEMENT, BackendSpec, SimulatedCosts, register_backend
from mpfa.mpfa_cli.results.metrics.registry import Report, RunValue, register

register(RunValue(
    name="{TOY_METRIC}", header="toy", unit="tok/req", better="higher", shown=Report.COMPARE | Report.GATE,
    explanation="Toy: output tokens per successful request.",
    value=lambda run: sum(r.output_tokens for r in run.ok) / len(run.ok) if run.ok else None))

register_backend(BackendSpec(
    name="{TOY}",
    description="A toy backend that a test registers",
    sglang_args=("--attention-backend", "toy"),
    expect={{"attention_backend": "toy"}},
    sim=SimulatedCosts(BF16_BYTES_PER_ELEMENT, BF16_BYTES_PER_ELEMENT, attention_efficiency=0.9,
                       kv_bandwidth_efficiency=0.95, step_overhead_s=0.1e-3),
))
'''
SCENARIO = f'''model = "llama-3.1-8b"
input_len = 256
output_len = {OUTPUT_LEN}
num_requests = 6
warmup_requests = 1
concurrency = [2]
repeats = 1
seed = 3
'''

Mpfa = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def mpfa(tmp_path: Path) -> Mpfa:
    """`mpfa` as a subprocess whose environment loads the toy's registration module (and so do the simulator
    servers it starts); nothing registers it in this process."""
    (tmp_path / "toy_backend.py").write_text(TOY_MODULE)
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    # PYTHONSAFEPATH: `python -m` must not put the working directory on sys.path (its `kernels` folder would shadow
    # the `kernels` package transformers imports)
    env = {**os.environ, "MPFA_DB": str(tmp_path / "results.db"), "MPFA_EXTENSIONS": "toy_backend",
           "PYTHONPATH": os.pathsep.join(path), "COLUMNS": "200", "PYTHONSAFEPATH": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mpfa.mpfa_cli", *args], capture_output=True, text=True,
                              timeout=120, env=env)

    return run


def test_a_registered_backend_and_metric_reach_every_command(mpfa: Mpfa, tmp_path: Path) -> None:
    listed = mpfa("backends")
    assert listed.returncode == 0, listed.stderr
    assert TOY in listed.stdout and "A toy backend that a test registers" in listed.stdout
    explained = mpfa("metrics", "--explain")
    assert f"{TOY_METRIC} (tok/req; higher is better): Toy: output tokens per successful request." in explained.stdout

    scenario = tmp_path / "toy.toml"
    scenario.write_text(SCENARIO)
    bench_args = ("bench", "--engine", "sim", "--scenario", str(scenario), "--backend", f"fa4-bf16,{TOY}",
                  "--time-scale", "0.02")
    bench = mpfa(*bench_args)
    assert bench.returncode == 0, bench.stderr

    table = mpfa("compare")
    assert table.returncode == 0, table.stderr
    assert TOY in table.stdout and "toy (tok/req)" in table.stdout
    rows = json.loads(mpfa("compare", "--ref", "fa4-bf16", "--format", "json").stdout)
    [toy_otps] = [r for r in rows if r["backend"] == TOY and r["metric"] == "otps"]
    assert toy_otps["simulated"] and toy_otps["speedup"] > 1  # the latency model ran on the toy's own costs
    assert {r["mean"] for r in rows if r["backend"] == TOY and r["metric"] == TOY_METRIC} == {OUTPUT_LEN}

    baseline = tmp_path / "baseline.json"
    written = mpfa("gate", "--baseline", str(baseline), "--write-baseline")
    assert written.returncode == 0, written.stderr
    entries = json.loads(baseline.read_text())["entries"]
    assert TOY in {entry["backend"] for entry in entries}
    assert any(TOY_METRIC in json.dumps(entry) for entry in entries if entry["backend"] == TOY)
    assert mpfa(*bench_args).returncode == 0  # measured anew: a gate judges runs newer than its baseline's
    gated = mpfa("gate", "--baseline", str(baseline), "--verbose")
    assert gated.returncode == 0, gated.stdout
    assert gated.stdout.startswith("Gate passed") and TOY in gated.stdout

    exported = mpfa("export", "--format", "json", "--backend", TOY)
    assert exported.returncode == 0, exported.stderr
    [run] = json.loads(exported.stdout)["runs"]
    assert (run["backend"], run["simulated"], run["server_info"]["attention_backend"]) == (TOY, True, "toy")
    assert run["summary"][TOY_METRIC] == OUTPUT_LEN


def test_a_failing_extension_is_one_line(mpfa: Mpfa, tmp_path: Path) -> None:
    """A module that registers a name already taken stops every command with one line naming it."""
    (tmp_path / "toy_backend.py").write_text(TOY_MODULE.replace(f'name="{TOY}"', 'name="mpfa"'))
    result = mpfa("backends")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "MPFA_EXTENSIONS: cannot load 'toy_backend'" in result.stderr
    assert "backend 'mpfa' is registered already" in result.stderr
