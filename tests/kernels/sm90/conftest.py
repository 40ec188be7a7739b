"""The sm90 kernel tests: Triton kernels run on the GPU or in Triton's CPU interpreter (`device`, tests/conftest.py);
the CuTe DSL kernels are compiled for sm_90a everywhere but run only on a GPU (tests marked ``gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `siblings`: test modules that load each other by file name


@pytest.fixture(scope="session")
def cuobjdump() -> Callable[..., str]:
    """``cuobjdump(*args)``: the tool's stdout, to read a cubin's resources and SASS (the binary ships with triton)."""
    triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return lambda *args: subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="session")
def compile_sm90() -> Callable[[str, Path], None]:
    """``compile_sm90(code, dump)``: run ``code`` (indented Python source) in a fresh interpreter that compiles for
    sm_90a and keeps PTX and cubins in ``dump``; neither Triton's CPU interpreter nor a prefill-kernel choice from
    the environment reaches it."""
    from mpfa.kernels.sm90.dispatch import PREFILL_KERNEL_ENV

    def run(code: str, dump: Path) -> None:
        clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", PREFILL_KERNEL_ENV)}
        env = {**clean, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(dump)}
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                                text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-4000:]

    return run


@pytest.fixture(scope="session")
def compile_builds(compile_sm90) -> Callable[[list, str, Path], dict]:
    """``compile_builds(builds, class_name, dump)``: compile each ``(config, compensate, kernel)`` prefill build
    (`compile_prefill_kernel(*config, kernel=..., compensate=...)`) in one fresh interpreter -> {build: its cubin},
    the PTX beside each cubin; ``class_name`` names the kernel class whose files to keep."""

    def run(builds: list, class_name: str, dump: Path) -> dict:
        code = f"""
            from pathlib import Path
            from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel
            dump = Path({str(dump)!r})
            for i, (config, compensate, kernel) in enumerate({builds!r}):
                compile_prefill_kernel(*config, kernel=kernel, compensate=compensate)
                for suffix in ("cubin", "ptx"):
                    (path,) = dump.glob(f"*{class_name}_*.{{suffix}}")
                    path.rename(dump / f"build{{i}}.{{suffix}}")
            """
        compile_sm90(code, dump)
        return {build: dump / f"build{i}.cubin" for i, build in enumerate(builds)}

    return run
