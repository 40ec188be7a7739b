"""Run `mpfa` as a real subprocess against the simulator, each test with its own database."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAST_SIM = ["--time-scale", "0.02"]


class Mpfa:
    def __init__(self, tmp_path: Path) -> None:
        self.db = tmp_path / "results.db"
        self.tmp = tmp_path

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "mpfa.cli", *args]

    def env(self) -> dict[str, str]:
        return {**os.environ, "MPFA_DB": str(self.db), "COLUMNS": "200"}

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout, env=self.env())

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env())


@pytest.fixture
def mpfa(tmp_path: Path) -> Mpfa:
    return Mpfa(tmp_path)


@pytest.fixture
def scenario_file(tmp_path: Path):
    """Writes a small scenario TOML (fields override a fast default) and returns its path."""

    def write(**fields: object) -> Path:
        return _write_scenario(tmp_path / "scenario.toml", **fields)

    return write


def _write_scenario(path: Path, **fields: object) -> Path:
    base = dict(model="llama-3.1-8b", input_len=256, output_len=8, num_requests=6, warmup_requests=1,
                concurrency=[2], repeats=1, seed=3)
    base.update(fields)
    lines = [f"{k} = {v!r}".replace("'", '"') if not isinstance(v, list) else f"{k} = {v}" for k, v in base.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
