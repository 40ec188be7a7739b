"""Fixtures shared by the test directories: a per-test seeded generator and where the Triton kernels run.

Without CUDA the Triton kernels (KV write, sequence means) run in Triton's CPU interpreter, so their bit-exactness
is checked on every machine; the variable is set here, before any test module imports a kernel module.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test, reproducible across runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")] if torch.cuda.is_available()
                else [pytest.param("cpu", id="cpu-interpreter")])
def device(request: pytest.FixtureRequest) -> str:
    """Where the Triton kernels run: the GPU (a ``gpu`` test) or, without one, Triton's CPU interpreter."""
    return request.param
