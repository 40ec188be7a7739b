"""Backend name -> kernel adapter, and the reference backend each profile kind compares against.

``mpfa`` runs the kernels `mpfa.kernels.sm90.dispatch` chooses for the shape (``$MPFA_PREFILL_KERNEL`` overrides
the prefill kernel); ``mpfa-exact`` and ``mpfa-mma-sync`` name the prefill kernel; ``mpfa-direct`` runs the
default's direct builds (no Delta_S): mpfa over mpfa-direct is the compensation's cost. ``fa3-bf16`` / ``fa3-fp8``
run FlashAttention-3 as SGLang's default Hopper backend does (paged, page 1); ``fa3-fp8-contiguous`` is its
prefill on contiguous K/V, FA3's best case. ``flashinfer-fp8`` / ``flashinfer-bf16`` run SGLang's `flashinfer`
backend (fa2 template); FlashInfer's FP8 tensor-core paths on sm_90a are ``flashinfer-fp8-xqa`` (decode, as SGLang's
`trtllm_mha` decode runs on Hopper), ``flashinfer-fp8-fa3`` and ``flashinfer-fp8-fmha-v2`` (prefill).
"""
from __future__ import annotations

from .kernel_adapter import KernelAdapter
from .kernels_fa3 import Fa3
from .kernels_fa4 import Fa4Bf16
from .kernels_flashinfer import FlashInferFa3Fp8, FlashInferFmhaV2Fp8, FlashInferPaged, FlashInferXqaFp8
from .kernels_mpfa import MpfaAdapter

ADAPTERS: dict[str, KernelAdapter] = {
    adapter.name: adapter
    for adapter in (Fa4Bf16(), Fa3(kv_fp8=False), Fa3(kv_fp8=True), Fa3(kv_fp8=True, contiguous=True),
                    FlashInferPaged(kv_fp8=True), FlashInferPaged(kv_fp8=False), FlashInferXqaFp8(),
                    FlashInferFa3Fp8(), FlashInferFmhaV2Fp8(), MpfaAdapter(),
                    MpfaAdapter(compensate=False), MpfaAdapter("exact"), MpfaAdapter("mma-sync"))
}
DEFAULT_BACKENDS = ("fa4-bf16", "flashinfer-fp8", "mpfa")
REFERENCE_BACKEND = {"prefill": "fa4-bf16", "decode": "flashinfer-fp8"}


def adapter_for(name: str) -> KernelAdapter:
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(ADAPTERS)})") from None


def parse_backends(text: str) -> list[str]:
    """'fa4-bf16,flashinfer-fp8' -> validated names in the given order, duplicates dropped."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("no backend given (e.g. --backend fa4-bf16,flashinfer-fp8,mpfa)")
    for name in names:
        adapter_for(name)
    return list(dict.fromkeys(names))
