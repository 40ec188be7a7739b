"""Sibling test modules loaded by file name. The suite runs with ``--import-mode=importlib``, so a test module is
not importable by name; a kernel's tests reuse the inputs, runners and checks of another test module (the prefill
kernels' GPU tests those of test_prefill_gpu) through `load` (this directory is put on ``sys.path`` by its
conftest)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(file: str, name: str) -> ModuleType:
    """The test module ``file`` of this directory, executed once as ``name`` (registered in ``sys.modules`` first:
    its dataclasses look their module up). When the sibling skips (triton / cutlass / tvm_ffi missing), so does the
    module loading it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
