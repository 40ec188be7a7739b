"""Fixtures that start the simulator as a real subprocess; tests talk to it over real HTTP.

The suite runs with --import-mode=importlib, so helpers reach tests as fixtures, not imports.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Callable

import pytest

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
