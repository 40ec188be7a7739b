"""The sm90 kernel tests: Triton kernels run on the GPU or in Triton's CPU interpreter (`device`, tests/conftest.py);
the CuTe DSL kernels are compiled for sm_90a everywhere but run only on a GPU (tests marked ``gpu``)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cuobjdump() -> Callable[..., str]:
    """``cuobjdump(*args)``: the tool's stdout, to read a cubin's resources and SASS (the binary ships with triton)."""
    triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return lambda *args: subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout
