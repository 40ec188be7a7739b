"""Backend name -> kernel adapter, from the backend registry (`mpfa.backends.specs`), and the reference backend
each profile kind compares against.

Every serving backend that declares a `KernelBench`, and every kernel-bench-only `KernelVariant`, has an adapter:
its class ("module:Class") built with its options. A new one is declared with the backend, not here.
"""
from __future__ import annotations

import importlib

from ..backends.specs import kernel_benches
from .kernel_adapter import KernelAdapter

DEFAULT_BACKENDS = ("fa4-bf16", "flashinfer-fp8", "mpfa")
REFERENCE_BACKEND = {"prefill": "fa4-bf16", "decode": "flashinfer-fp8"}


def adapter_for(name: str) -> KernelAdapter:
    benches = kernel_benches()
    if name not in benches:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(benches)})")
    module, _, cls = benches[name].adapter.partition(":")
    return getattr(importlib.import_module(module), cls)(**benches[name].options)


def parse_backends(text: str) -> list[str]:
    """'fa4-bf16,flashinfer-fp8' -> validated names in the given order, duplicates dropped."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("no backend given (e.g. --backend fa4-bf16,flashinfer-fp8,mpfa)")
    for name in names:
        adapter_for(name)
    return list(dict.fromkeys(names))
