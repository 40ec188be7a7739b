"""The kernel-bench adapters come from the backend registry: each declared one builds and names itself as
registered."""
from __future__ import annotations

import pytest

from mpfa.backends.specs import kernel_benches
from mpfa.profiles.registry import adapter_for


def test_every_declared_adapter_builds_under_its_registered_name():
    for name in kernel_benches():
        assert adapter_for(name).name == name


def test_a_backend_without_an_adapter_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'triton-bf16' \(choose from fa4-bf16, fa3-bf16, fa3-fp8, "
                                         r"flashinfer-fp8, mpfa, mpfa-direct, fa3-fp8-contiguous"):
        adapter_for("triton-bf16")
