"""Run `mpfa` as a real subprocess against the simulator, each test with its own database; or in this process, for
a command that starts no server and takes no signal, where a subprocess would only add an interpreter's start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app

FAST_SIM = ["--time-scale", "0.02"]


class Mpfa:
    def __init__(self, tmp_path: Path) -> None:
        self.db = tmp_path / "results.db"
        self.tmp = tmp_path

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "mpfa.mpfa_cli", *args]

    def settings(self, columns: int = 200) -> dict[str, str]:
        """What `mpfa` reads from its environment here: this test's database and the terminal's width."""
        return {"MPFA_DB": str(self.db), "COLUMNS": str(columns)}

    def env(self) -> dict[str, str]:
        # PYTHONSAFEPATH: `python -m` must not put the checkout on sys.path, where its top-level `kernels` folder would
        # shadow the `kernels` package transformers imports (the installed `mpfa` command never does)
        return {**os.environ, **self.settings(), "PYTHONSAFEPATH": "1"}

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=timeout, env=self.env())

    def invoke(self, *args: str, columns: int = 200) -> subprocess.CompletedProcess:
        """`mpfa ARGS` run in this process (in a terminal `columns` wide), answered as the subprocess would be: an
        exception that escapes the command is its traceback on stderr and exit status 1, as Python does."""
        result = CliRunner().invoke(app, list(args), env=self.settings(columns), prog_name="mpfa")
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            stderr += "".join(traceback.format_exception(result.exception))
        return subprocess.CompletedProcess(self.command(*args), result.exit_code, result.stdout, stderr)

    def run_at(self, columns: int, *args: str) -> subprocess.CompletedProcess:
        """`mpfa ARGS` in a terminal `columns` wide."""
        return subprocess.run(self.command(*args), capture_output=True, text=True, timeout=120,
                              env={**self.env(), **self.settings(columns)})

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


@pytest.fixture
def task_cache(tmp_path, monkeypatch):
    """SQuAD, social_iqa and the essays where `data.task_file` / `data.essay_text` look, so nothing downloads."""
    root = tmp_path / "cache"
    bigbench = root / "datasets" / "bigbench-1.0.0"
    (bigbench / "squad_shifts").mkdir(parents=True)
    (bigbench / "social_iqa").mkdir(parents=True)
    (root / "models" / "text").mkdir(parents=True)
    articles = [{"title": f"article {a}", "paragraphs": [{
        "context": f"River {a} flows north past the town of Rivet {a}. " * 3,
        "qas": [{"id": f"q{a}", "question": f"Where does river {a} flow?",
                 "answers": [{"answer_start": 9, "text": "flows north"}]}]}]} for a in range(30)]
    (bigbench / "squad_shifts" / "squaddev_v1.1.json").write_text(json.dumps({"data": articles}))
    (bigbench / "social_iqa" / "task.json").write_text(json.dumps({"examples": [
        {"input": f"Question {i}?", "target_scores": {"yes": 1, "no": 0, "maybe so": 0}} for i in range(10)]}))
    (root / "models" / "text" / "paul_graham_essays.txt").write_text(
        " ".join(f"Sentence {i} is about painters and hackers." for i in range(600)))
    monkeypatch.setenv("MPFA_CACHE", str(root))
    return root
