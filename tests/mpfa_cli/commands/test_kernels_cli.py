"""The kernels a run's server ran, end to end on the simulator: `mpfa bench --prefill-kernel` passes the choice to
MpFA's servers and stores it, `mpfa show` prints it, `mpfa backends` lists each backend's kernels."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from mpfa.scenarios import MODEL_DIR

FAST = ["--time-scale", "0.02"]


@pytest.fixture
def gqa8_model(tmp_path: Path) -> Path:
    """A model directory: the 8B's config with 64 query heads over its 8 KV heads (a GQA group of 8)."""
    return _model_with_heads(tmp_path, 64)


@pytest.fixture
def gqa9_model(tmp_path: Path) -> Path:
    """A GQA group of 9 (72 query heads over 8): no wgmma kernel takes it."""
    return _model_with_heads(tmp_path, 72)


def _model_with_heads(tmp_path: Path, q_heads: int) -> Path:
    config = json.loads((MODEL_DIR / "llama-3.1-8b" / "config.json").read_text())
    model = tmp_path / f"heads{q_heads}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": q_heads, "head_dim": 128}))
    return model


def _stored(db) -> list[tuple[str, dict, list]]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT backend, kernels, backend_flags FROM runs ORDER BY id").fetchall()
    finally:
        conn.close()
    return [(backend, json.loads(kernels), json.loads(flags)) for backend, kernels, flags in rows]


def test_bench_passes_the_prefill_kernel_on_and_stores_what_ran(mpfa, scenario_file) -> None:
    result = mpfa("bench", "--scenario", str(scenario_file()), "--backend", "fa4-bf16,mpfa",
                  "--prefill-kernel", "exact", *FAST)
    assert result.returncode == 0, result.stderr
    (fa4, fa4_kernels, fa4_flags), (mpfa_name, mpfa_kernels, mpfa_flags) = _stored(mpfa.db)
    assert (fa4, mpfa_name) == ("fa4-bf16", "mpfa")
    assert fa4_kernels == {"attention_backend": "fa4", "source": "simulated"}
    assert "--mpfa-prefill-kernel" not in fa4_flags  # SGLang's own backends do not take it
    assert mpfa_kernels == {"prefill": "exact", "decode": "split-kv", "numerics": "paper",
                            "prefill_override": "exact", "source": "simulated"}
    assert mpfa_flags[-2:] == ["--mpfa-prefill-kernel", "exact"]
    shown = mpfa("show", "2")
    assert shown.returncode == 0, shown.stderr
    assert "prefill exact (override), decode split-kv (simulated: no kernel ran)" in shown.stdout


def test_bench_stores_the_default_kernel_for_the_model(mpfa, scenario_file, gqa8_model, monkeypatch) -> None:
    monkeypatch.delenv("MPFA_PREFILL_KERNEL", raising=False)
    result = mpfa("bench", "--scenario", str(scenario_file(model=str(gqa8_model))), "--backend", "mpfa", *FAST)
    assert result.returncode == 0, result.stderr
    [(_, kernels, _)] = _stored(mpfa.db)
    assert kernels == {"prefill": "fp8", "decode": "split-kv", "numerics": "paper", "source": "simulated"}  # GQA 8


def test_bench_stores_and_shows_the_served_numerics(mpfa, scenario_file, monkeypatch) -> None:
    monkeypatch.setenv("MPFA_NUMERICS", "had128-k46")
    result = mpfa("bench", "--scenario", str(scenario_file()), "--backend", "mpfa", *FAST)
    assert result.returncode == 0, result.stderr
    [(_, kernels, _)] = _stored(mpfa.db)
    assert kernels["numerics"] == "had128-k46"
    shown = mpfa("show", "1")
    assert "prefill fp8, decode split-kv, numerics had128-k46 (simulated: no kernel ran)" in shown.stdout
    monkeypatch.setenv("MPFA_NUMERICS", "had256")
    result = mpfa("bench", "--scenario", str(scenario_file()), "--backend", "mpfa", *FAST)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "mpfa: MPFA_NUMERICS='had256': choose one of paper, had128-k46")
    assert "starting server" not in result.stdout and len(_stored(mpfa.db)) == 1


def test_a_prefill_kernel_the_model_does_not_take_fails_before_any_server(mpfa, scenario_file, gqa9_model) -> None:
    result = mpfa("bench", "--scenario", str(scenario_file(model=str(gqa9_model))), "--backend", "fa4-bf16,mpfa",
                  "--prefill-kernel", "fp8", *FAST)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "mpfa: the fp8 prefill kernel needs a GQA group of 1 to 8" in result.stderr
    assert "starting server" not in result.stdout and not _stored(mpfa.db)
    result = mpfa.invoke("bench", "--prefill-kernel", "fastest")
    assert result.returncode == 2 and "--prefill-kernel: " in result.stderr


def test_backends_lists_the_kernels_each_runs(mpfa) -> None:
    result = mpfa("backends")
    assert result.returncode == 0, result.stderr
    assert "prefill fp8, decode split-kv" in result.stdout and "SGLang attention backend flashinfer" in result.stdout
    result = mpfa.invoke("backends", "--model", "llama-3.1-70b")  # the options in this process
    assert "prefill fp8, decode split-kv" in result.stdout and "64:8 heads" in result.stdout
    result = mpfa.invoke("backends", "--prefill-kernel", "exact")
    assert "prefill exact (override), decode split-kv" in result.stdout
    result = mpfa.invoke("backends", "--model", "llama-3.1-70b", "--prefill-kernel", "exact")  # GQA 8 by name
    assert result.returncode == 0 and "prefill exact (override), decode split-kv" in result.stdout
    result = mpfa.invoke("backends", "--model", "llama-3.1-70b", "--prefill-kernel", "mma-sync")
    assert result.returncode == 0 and "prefill mma-sync" in result.stdout
