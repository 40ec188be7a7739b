"""Shared setup for the sm90 kernel tests.

Without CUDA the Triton kernels run in Triton's CPU interpreter (set here, before any kernel module is
imported), so their bit-exactness is checked on every machine; the CuTe DSL kernels are compiled for sm_90a
everywhere but run only on a GPU (tests marked ``gpu``).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")] if torch.cuda.is_available()
                else [pytest.param("cpu", id="cpu-interpreter")])
def device(request: pytest.FixtureRequest) -> str:
    """Where the Triton kernels run: the GPU (a ``gpu`` test) or, without one, Triton's CPU interpreter."""
    return request.param


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test, reproducible across runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
