"""Compile the sm90 CuTe DSL kernels from fake tensors: the same path on the H200 (then called with torch tensors
through TVM-FFI) and on a CPU-only machine (CI compiles every kernel for sm_90a so a broken kernel fails CI).

``CUTE_DSL_ARCH`` must name the target before `cutlass` is imported; `target_sm90a()` sets it when unset.
Symbolic sizes (`cute.sym_int`) keep one compiled kernel per configuration, whatever the batch, cache size or
number of partitions.
"""

from __future__ import annotations

import os
from typing import Any

from . import sass

ARCH = "sm_90a"


def target_sm90a() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)


def fake_tensor(dtype: Any, shape: tuple, *, align: int = 16) -> Any:
    """A compact row-major fake tensor; ``None`` entries of ``shape`` become symbolic sizes."""
    import cutlass.cute as cute

    dims = tuple(cute.sym_int() if size is None else size for size in shape)
    order = tuple(range(len(dims) - 1, -1, -1))
    return cute.runtime.make_fake_compact_tensor(dtype, dims, stride_order=order, assumed_align=align)


def compile_kernel(launcher: Any, *args: Any) -> Any:
    """``cute.compile`` with a fake stream taken from the caller's current stream at call time (TVM-FFI). A launch
    with ``min_blocks_per_mp`` > 1 (``.minnctapersm``: ptxas then bounds the registers so that many CTAs fit an SM)
    makes the DSL ask the device for its shared memory per SM (a carveout hint); without a device the answer is
    sm_90's, so a CPU-only build is the GPU's."""
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import cutlass as dsl_cutlass

    helpers = dsl_cutlass.cuda_helpers
    device_attribute = helpers.get_device_attribute

    def attribute_or_sm90(attribute, device_id: int = 0):
        try:
            return device_attribute(attribute, device_id)
        except Exception:
            if attribute != helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR:
                raise
            return sass.SMEM_PER_SM

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    helpers.get_device_attribute = attribute_or_sm90
    try:
        return cute.compile(launcher, *args, stream, options="--enable-tvm-ffi")
    finally:
        helpers.get_device_attribute = device_attribute
