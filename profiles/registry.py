"""Backend name -> kernel adapter, and the reference backend each profile kind compares against."""
from __future__ import annotations

from mpfa.kernels.sm90.decode_launch import LEAN_KERNELS, WARPS_PER_SM_TARGET
from mpfa.kernels.sm90.prefill_launch import PRE_KERNELS, WS_KERNELS
from mpfa.profiles.kernel_adapter import KernelAdapter
from mpfa.profiles.kernels_fa4 import Fa4Bf16
from mpfa.profiles.kernels_flashinfer import FlashInferPaged
from mpfa.profiles.kernels_mpfa import MpfaAdapter

# mpfa-dw<n> / mpfa-dv4w<n>: the default decode kernel / v4 (a third fewer instructions per tile) with partitions
# aimed at n warps per SM (12: every slot; the default 6, `decode_launch.PARTITION_WARPS_PER_SM`) -> 2/3, 1/2 and
# 1/4 as many partitions as every slot's, each longer (`decode_launch.partition_warps`)
DECODE_PARTITION_WARPS = (8, 6, 3)
ADAPTERS: dict[str, KernelAdapter] = {
    adapter.name: adapter
    for adapter in (Fa4Bf16(), FlashInferPaged(kv_fp8=True), FlashInferPaged(kv_fp8=False), MpfaAdapter(),
                    MpfaAdapter("v1"), MpfaAdapter("v2"), MpfaAdapter("v2w8"),
                    MpfaAdapter("v3"), MpfaAdapter("v3w8"),  # mpfa-<v>: the prefill kernel pinned
                    MpfaAdapter("v3c"), MpfaAdapter("v3w8c"),  # v3 with Delta_S as an extra K column
                    MpfaAdapter("v4"), MpfaAdapter("v4w8"),  # v3 with QK^T on FP8 (mpfa-qk8tile numerics)
                    MpfaAdapter("v5"), MpfaAdapter("v5w8"),  # v4 with PV on FP8 too (mpfa-qk8tile numerics)
                    # v6 (v5w8 warp-specialized: a producer warpgroup, two consumers) and its variants
                    *(MpfaAdapter(v) for v in WS_KERNELS),
                    *(MpfaAdapter(v) for v in PRE_KERNELS),  # v7: v6n on operand images (timed with their pass)
                    # mpfa-d<v>: the decode kernel, its partitions at the adopted 6 warps per SM (v4w14: its 14)
                    MpfaAdapter(decode_kernel="v1"), MpfaAdapter(decode_kernel="v3"),
                    *(MpfaAdapter(decode_kernel=v) for v in LEAN_KERNELS),  # decode_lean (mpfa-dv4: the default)
                    *(MpfaAdapter(decode_kernel=kernel, decode_warps=n)
                      for kernel in (None, "v4") for n in DECODE_PARTITION_WARPS),
                    # mpfa-dv4w12 / mpfa-dv2w12: every slot (v2 on every slot: the default to session 23)
                    *(MpfaAdapter(decode_kernel=v, decode_warps=WARPS_PER_SM_TARGET) for v in ("v4", "v2")),
                    MpfaAdapter(compensate=False))  # mpfa-direct: no Delta_S
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
