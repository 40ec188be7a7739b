"""`compare` and `plot` take the newest scenario's runs, refuse runs of different setups and say which they used."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.store import ResultStore


def mpfa(db: Path, *args: str):
    return CliRunner().invoke(app, [*args, "--db", str(db)], env={"COLUMNS": "100"})


def stored(path: Path, runs: list) -> Path:
    with ResultStore(path) as store:
        store.import_runs(runs)
    return path


def pair(make_run, start: float, **fields) -> list:
    return [make_run(b, 0, {"otps": 1000.0, "ttft_ms_median": 50.0}, started_at=start + i, **fields)
            for i, b in enumerate(("fa4-bf16", "mpfa"))]


def sim(scale: float, clock: str = "modelled") -> dict:
    return dict(engine="sim", simulated=True, server_info={"time_scale": scale, "metrics_clock": clock})


@pytest.mark.parametrize("command", [["compare"], ["plot", "-o", "PLOT"]])
def test_the_newest_scenario_is_the_default_and_the_runs_used_are_named(tmp_path, make_run, command):
    db = stored(tmp_path / "r.db", [*pair(make_run, 1.0e9, scenario="old"), *pair(make_run, 2.0e9)])
    result = mpfa(db, *[str(tmp_path / "p.png") if a == "PLOT" else a for a in command])
    assert result.exit_code == 0, result.output
    assert "using runs 3–4 (scenario paper)" in result.output
    assert "old" not in result.output


@pytest.mark.parametrize("first, second, words", [
    (sim(0.01), sim(1.0), "time scale: x0.01, modelled clock (runs 1–2); x1, modelled clock (runs 3–4)"),
    (dict(gpu="NVIDIA H100"), dict(gpu="NVIDIA H200"), "GPU: NVIDIA H100 (runs 1–2); NVIDIA H200 (runs 3–4)"),
    (dict(engine="sglang"), dict(engine="vllm"), "engine: sglang (runs 1–2); vllm (runs 3–4)"),
])
@pytest.mark.parametrize("command", ["compare", "plot"])
def test_runs_of_different_setups_are_refused_in_one_line(tmp_path, make_run, first, second, words, command):
    db = stored(tmp_path / "r.db", [*pair(make_run, 1.0e9, **first),
                                    *pair(make_run, 2.0e9, input_len=8192, **second)])
    result = mpfa(db, command, "-o", str(tmp_path / "p.png")) if command == "plot" else mpfa(db, command)
    assert result.exit_code == 2
    assert f"these runs differ in {words}" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_runs_of_one_setup_named_by_id_are_compared(tmp_path, make_run):
    db = stored(tmp_path / "r.db", [*pair(make_run, 1.0e9, **sim(0.01)),
                                    *pair(make_run, 2.0e9, input_len=8192, **sim(1.0))])
    result = mpfa(db, "compare", "1", "2")
    assert result.exit_code == 0 and "using runs 1–2 (scenario paper)" in result.output
