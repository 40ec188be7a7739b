"""Synthetic runs for the results tests: hand-set summaries, or seeded random request timings."""
from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from mpfa.mpfa_cli.harness.records import RequestRecord
from mpfa.mpfa_cli.results.store import StoredRun

GPU = "NVIDIA H200"
MODEL = "llama-3.1-8b"


def _random_requests(rng: random.Random, n: int, input_len: int = 2048, max_new: int = 16) -> list[RequestRecord]:
    """`n` requests with random dispatch, first-token and chunk times; one warmup and one failure among them."""
    records = []
    t = rng.uniform(0.0, 1.0)
    for i in range(n):
        t += rng.uniform(0.01, 0.2)
        if i == n - 1:
            records.append(RequestRecord(i, input_len, max_new, t, error=f"HTTP 500 (req {rng.randint(0, 99)})"))
            continue
        chunk_s, chunk_tokens = [], []
        clock = t + rng.uniform(0.05, 0.5)
        produced = 0
        while produced < max_new:
            k = min(rng.randint(1, 3), max_new - produced)
            chunk_s.append(clock)
            chunk_tokens.append(k)
            produced += k
            clock += rng.uniform(0.005, 0.03)
        records.append(RequestRecord(
            index=i, input_len=input_len, max_new_tokens=max_new, dispatch_s=t, warmup=(i == 0),
            chunk_s=chunk_s, chunk_tokens=chunk_tokens, completion_s=chunk_s[-1] + rng.uniform(0, 0.01),
            output_tokens=produced, prompt_tokens=input_len + rng.randint(0, 3),
        ))
    return records


def _make_run(backend: str, repeat: int = 0, summary: dict[str, float] | None = None, **overrides: Any) -> StoredRun:
    """A finished run of scenario 'paper' at 16K, concurrency 8, on an H200, unless overridden."""
    fields: dict[str, Any] = dict(
        scenario="paper", backend=backend, engine="sglang", simulated=False, load={"concurrency": 8},
        repeat=repeat, input_len=16384, output_len=1024, num_requests=16, seed=repeat,
        workload_hash="f00d", started_at=1_700_000_000.0 + repeat, status="ok", model=MODEL, gpu=GPU,
        finished_at=1_700_000_100.0 + repeat, summary=dict(summary or {}),
    )
    fields.update(overrides)
    return StoredRun(**fields)


def _runs_with(metric: str, per_backend: dict[str, list[float]], **overrides: Any) -> list[StoredRun]:
    """One run per (backend, repeat) whose summary holds `metric` = the given per-repeat value."""
    return [
        _make_run(backend, repeat, {metric: value}, **overrides)
        for backend, values in per_backend.items()
        for repeat, value in enumerate(values)
    ]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Seeded per test (by its name), so inputs are fresh across tests yet reproducible."""
    return random.Random(request.node.name)


# Helpers as fixtures: test modules cannot import this conftest by name (tests/cli has one too).
@pytest.fixture
def make_run():
    return _make_run


@pytest.fixture
def runs_with():
    return _runs_with


@pytest.fixture
def random_requests(rng: random.Random):
    """`random_requests(n, ...)` drawing from this test's seeded generator."""
    return lambda n, **kw: _random_requests(rng, n, **kw)


@pytest.fixture
def v2_database(tmp_path: Path) -> Path:
    """A results database as the version-2 store left it (fixtures/results-v2.sql): runs 1-3 are a measured
    fa4-bf16, a measured mpfa and a simulated mpfa run, two requests each; profile 1 is a decode profile."""
    db = tmp_path / "schema2.db"
    conn = sqlite3.connect(db)
    try:
        conn.executescript((Path(__file__).parent / "fixtures" / "results-v2.sql").read_text())
        conn.execute("PRAGMA user_version = 2")
    finally:
        conn.close()
    return db
