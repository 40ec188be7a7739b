"""Which sm90 MpFA kernel runs: the one place that chooses, from the shape, with one override.

Prefill kernels, named for what they compute:

* ``fp8`` (the default where it fits): Q and K requantized from NVFP4 to e4m3 (power-of-two scales per query row
  and per 64-key tile), FP8 QKᵀ and PV wgmma in a warp-specialized kernel fed from FP8 operand images that one
  pass per prefill expands from the cache; numerics ``mpfa-qk8tile-psum`` of `mpfa.kernels.reference`.
* ``exact``: the paper's numerics (``mpfa``): NVFP4 Q and K dequantized exactly to FP16 for the QKᵀ wgmma, ΔS as an
  extra K column, FP8 PV.
* ``mma-sync``: the fallback for the shapes neither wgmma kernel runs (pages of fewer than 64 keys, odd head counts,
  GQA groups above 8): warp-level mma.sync, the paper's numerics.

The wgmma kernels take every GQA group from 1 to 8 (a CTA holds gcd(group, 4) heads of the group); both pass their
GPU tests at every one (H100, 2026-12-06). The default is ``fp8`` wherever the wgmma kernels fit (`wgmma_fits`),
else ``mma-sync``; ``exact`` (the numerics of ``mma-sync`` at ~2.5x its speed at 32:8, each against FA4-BF16:
docs/kernels.md) runs when named.

Decode has one kernel, ``split-kv`` (split-KV partitions, then a merge kernel), with the paper's numerics.

The override is ``MPFA_PREFILL_KERNEL`` (the SGLang plugin's ``--mpfa-prefill-kernel`` sets it for every process of
the server). Host-side only: importing this module imports no CuTe DSL.
"""

from __future__ import annotations

import os

PREFILL_KERNELS: dict[str, str] = {
    "fp8": "FP8 QK and PV wgmma on operand images, Q/K requantized to e4m3 (mpfa-qk8tile-psum)",
    "exact": "NVFP4 QK dequantized exactly to FP16 wgmma, FP8 PV: the paper's numerics (mpfa)",
    "mma-sync": "warp-level mma.sync fallback for shapes the wgmma kernels refuse, the paper's numerics (mpfa)",
}
DECODE_KERNEL = "split-kv"
PREFILL_KERNEL_ENV = "MPFA_PREFILL_KERNEL"
WGMMA_KERNELS = ("fp8", "exact")  # the first is the default wherever they fit
WGMMA_GROUPS = tuple(range(1, 9))  # a warpgroup's 64 rows: gcd(group, 4) heads x 64 / gcd(group, 4) rows
WGMMA_MIN_PAGE = 64  # the wgmma kernels' 64-key tiles never straddle a page
NUMERICS = {"fp8": "mpfa-qk8tile-psum", "exact": "mpfa", "mma-sync": "mpfa"}
SOFTMAX_KEYS = {"fp8": 128, "exact": 64, "mma-sync": 32}


def wgmma_fits(num_q_heads: int, num_kv_heads: int, page_size: int) -> bool:
    """Whether the wgmma kernels (``fp8``, ``exact``) take this shape."""
    return (num_q_heads % 2 == 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads in WGMMA_GROUPS and page_size >= WGMMA_MIN_PAGE)


def requested_prefill_kernel(kernel: str | None = None) -> str | None:
    """``kernel``, else ``MPFA_PREFILL_KERNEL``, checked (None: neither is set); case-insensitive."""
    source = "kernel" if kernel is not None else PREFILL_KERNEL_ENV
    choice = kernel if kernel is not None else os.environ.get(PREFILL_KERNEL_ENV) or None
    if choice is None:
        return None
    choice = choice.strip().lower()
    if choice not in PREFILL_KERNELS:
        raise ValueError(f"{source} must be one of {', '.join(PREFILL_KERNELS)}, got {choice!r}")
    return choice


def prefill_kernel(num_q_heads: int, num_kv_heads: int, page_size: int, kernel: str | None = None) -> str:
    """The prefill kernel that runs for this shape: ``kernel`` or ``MPFA_PREFILL_KERNEL`` if given (a wgmma kernel
    the shape does not fit is a ValueError), else ``fp8`` where the wgmma kernels fit (`wgmma_fits`) and
    ``mma-sync`` elsewhere."""
    choice = requested_prefill_kernel(kernel)
    if choice is None:
        return WGMMA_KERNELS[0] if wgmma_fits(num_q_heads, num_kv_heads, page_size) else "mma-sync"
    if choice in WGMMA_KERNELS:
        check_wgmma_shape(choice, num_q_heads, num_kv_heads, page_size)
    return choice


def check_wgmma_shape(kernel: str, num_q_heads: int, num_kv_heads: int, page_size: int) -> None:
    """A ValueError naming the limits unless the wgmma kernel ``kernel`` takes this shape (`wgmma_fits`)."""
    if not wgmma_fits(num_q_heads, num_kv_heads, page_size):
        raise ValueError(
            f"the {kernel} prefill kernel needs a GQA group of {WGMMA_GROUPS[0]} to {WGMMA_GROUPS[-1]}, an even number of "
            f"query heads and pages of >= {WGMMA_MIN_PAGE} keys; got {num_q_heads}:{num_kv_heads} heads, pages of "
            f"{page_size}: use mma-sync")


def prefill_numerics(kernel: str) -> str:
    """The `mpfa.kernels.reference` variant a prefill kernel computes."""
    return NUMERICS[kernel]


def softmax_keys(kernel: str) -> int:
    """Keys per online-softmax update (the reference's ``block_n`` that rounds P as the kernel does): the fp8
    kernel's consumers step over 128 keys, the exact kernel's over 64, the mma-sync kernel's warps over 32."""
    return SOFTMAX_KEYS[kernel]
