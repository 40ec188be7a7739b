"""Fixtures of the harness, results and reports tests: the simulator as a real subprocess (tests talk to it over
real HTTP), and synthetic runs (hand-set summaries, or seeded random request timings).

The suite runs with --import-mode=importlib, so helpers reach tests as fixtures, not imports.
"""
from __future__ import annotations

import json
import itertools
import random
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from mpfa.mpfa_cli.harness.records import RequestRecord
from mpfa.mpfa_cli.results.store import StoredRun

FAST = 0.01  # time scale: simulated steps run 100x faster than modelled


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(url: str, body: Any = None, raw: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of a GET, or of a POST when `body` (JSON) or `raw` bytes are given."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class SimProcess:
    def __init__(self, backend: str = "fa4-bf16", **options: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kwargs = ", ".join(f"{k}={v!r}" for k, v in {"time_scale": FAST, **options}.items())
        code = (f"from mpfa.mpfa_cli.harness.sim_server import run_sim_server; "
                f"run_sim_server('127.0.0.1', {self.port}, {backend!r}, {kwargs})")
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"sim server exited: {self.output()}")
            try:
                if http(self.url + "/health", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("sim server did not start within 30 s")
            time.sleep(0.05)

    def get(self, path: str) -> tuple[int, bytes]:
        return http(self.url + path)

    def post(self, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, bytes]:
        return http(self.url + path, body if body is not None else {}, raw)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture
def start_sim() -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []

    def start(backend: str = "fa4-bf16", **options: Any) -> SimProcess:
        started.append(SimProcess(backend, **options))
        return started[-1]

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    """One shared simulator (fa4-bf16, fast) for tests that do not need special options."""
    server = SimProcess()
    yield server
    server.stop()


# --- synthetic runs for the results and reports tests ---
GPU = "NVIDIA H200"
MODEL = "llama-3.1-8b"


def _random_requests(rng: random.Random, n: int, input_len: int = 2048, max_new: int = 16) -> list[RequestRecord]:
    """`n` requests with random dispatch, first-token and chunk times: a warmup (index -1, as the client numbers
    them), then measured ones 0..n-2, the last of them failed."""
    records = []
    t = rng.uniform(0.0, 1.0)
    for i in range(n):
        t += rng.uniform(0.01, 0.2)
        if i == n - 1:
            records.append(RequestRecord(i - 1, input_len, max_new, t, error=f"HTTP 500 (req {rng.randint(0, 99)})"))
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
            index=i - 1, input_len=input_len, max_new_tokens=max_new, dispatch_s=t, warmup=(i == 0),
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


_passes = itertools.count()


def _runs_with(metric: str, per_backend: dict[str, list[float]], **overrides: Any) -> list[StoredRun]:
    """One run per (backend, repeat) whose summary holds `metric` = the given per-repeat value; each call a new pass
    started after the one before (the gate judges only runs newer than its baseline's)."""
    start = 1_700_000_000.0 + 1000 * next(_passes)
    return [
        _make_run(backend, repeat, {metric: value}, **{"started_at": start + repeat, **overrides})
        for backend, values in per_backend.items()
        for repeat, value in enumerate(values)
    ]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Seeded per test (by its name), so inputs are fresh across tests yet reproducible."""
    return random.Random(request.node.name)


# Helpers as fixtures: test modules cannot import this conftest by name (tests/mpfa_cli/commands has one too).
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
    """A results database as the version-2 store left it (tests/fixtures/results/results-v2.sql): runs 1-3 are a measured
    fa4-bf16, a measured mpfa and a simulated mpfa run, two requests each; profile 1 is a decode profile."""
    db = tmp_path / "schema2.db"
    conn = sqlite3.connect(db)
    try:
        conn.executescript((Path(__file__).parents[1] / "fixtures" / "results" / "results-v2.sql").read_text())
        conn.execute("PRAGMA user_version = 2")
    finally:
        conn.close()
    return db
