"""The backend registry: one name, one declaration; kernel-bench variants are not served."""
from __future__ import annotations

import dataclasses

import pytest

from mpfa.backends.specs import (BACKENDS, KERNEL_VARIANTS, UnknownBackend, backend_spec, kernel_benches,
                                 register_backend, register_kernel_variant)


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="backend 'mpfa' is registered already"):
        register_backend(dataclasses.replace(BACKENDS["mpfa"], description="again"))
    with pytest.raises(ValueError, match="backend 'mpfa' is registered already"):
        register_kernel_variant(dataclasses.replace(KERNEL_VARIANTS["mpfa-exact"], name="mpfa"))
    assert BACKENDS["mpfa"].description != "again"


def test_a_kernel_bench_variant_is_not_a_serving_backend() -> None:
    assert backend_spec("mpfa") is BACKENDS["mpfa"]
    with pytest.raises(UnknownBackend, match="'mpfa-exact' is a kernel-bench variant .*not a serving backend; serve "
                                             "its kernels with `mpfa bench --backend mpfa --prefill-kernel exact`"):
        backend_spec("mpfa-exact")
    with pytest.raises(UnknownBackend, match="'fa3-fp8-contiguous' is a kernel-bench variant .*; serving backends: "
                                             "fa4-bf16, fa3-bf16"):
        backend_spec("fa3-fp8-contiguous")
    with pytest.raises(UnknownBackend, match="unknown backend 'fa5'; valid: fa4-bf16, fa3-bf16"):
        backend_spec("fa5")


def test_kernel_bench_lists_serving_backends_then_variants() -> None:
    names = list(kernel_benches())
    served = [name for name, spec in BACKENDS.items() if spec.kernel_bench is not None]
    assert names == served + list(KERNEL_VARIANTS)
    assert "triton-bf16" in BACKENDS and "triton-bf16" not in names  # declares no adapter
