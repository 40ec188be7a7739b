"""Fixtures shared by the test directories: a per-test seeded generator and where the Triton kernels run.

Without CUDA the Triton kernels (KV write, sequence means) run in Triton's CPU interpreter, so their bit-exactness
is checked on every machine; the variable is set here, before any test module imports a kernel module.

`python -m pytest` puts the repository root on sys.path, where the `kernels/` folder (installed as `mpfa.kernels`)
would shadow the PyPI `kernels` package that transformers 5 imports; the root is taken off again here (the project
is imported through its installed `mpfa` namespace, never from the root).

Under pytest-xdist (``-n N``) each worker's torch takes an equal share of the CPU cores: the GPU tests' float64
oracles otherwise run N x cores threads, which on the H200 host (16 cores, 8 workers) made tests take longer than
a 120 s per-test timeout.

The CLI makes its Rich consoles at import, and Rich fixes a console's width from $COLUMNS when it is made. An xdist
worker starts with COLUMNS=80 and LINES=24 in its environment (readline, imported by the controlling pytest process,
exports them), which would fix the in-process CLI at 80 columns whatever width a test's CliRunner sets; they are
dropped here, before any test module imports the CLI, so each test's own $COLUMNS is what its output is made for.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test, reproducible across runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")] if torch.cuda.is_available()
                else [pytest.param("cpu", id="cpu-interpreter")])
def device(request: pytest.FixtureRequest) -> str:
    """Where the Triton kernels run: the GPU (a ``gpu`` test) or, without one, Triton's CPU interpreter."""
    return request.param


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The skips in one line, counted by reason (-ra would list every skipping test file)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    counted = "; ".join(f"{reason}: {count}" for reason, count in sorted(reasons.items(), key=lambda r: -r[1]))
    terminalreporter.write_line(f"skipped {len(skipped)} ({counted})")
