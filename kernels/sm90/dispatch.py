"""Which sm90 MpFA kernel runs: the one place that chooses, from the shape, with one override.

Prefill kernels, named for what they compute:

* ``fp8`` (the default where it fits): Q and K requantized from NVFP4 to e4m3 (power-of-two scales per query row
  and per 64-key tile), FP8 QKᵀ and PV wgmma in a warp-specialized kernel fed from FP8 operand images that one
  pass per prefill expands from the cache; numerics ``mpfa-qk8tile-psum`` of `mpfa.kernels.reference`.
* ``exact``: the paper's numerics (``mpfa``): NVFP4 Q and K dequantized exactly to FP16 for the QKᵀ wgmma, ΔS as an
  extra K column, FP8 PV.
* ``mma-sync``: the fallback for the shapes neither wgmma kernel runs (pages of fewer than 64 keys, odd head counts,
  GQA groups above 8): warp-level mma.sync, the paper's numerics.

The wgmma kernels compile for every GQA group from 1 to 8 (a CTA holds gcd(group, 4) heads of the group) but run
only on the groups where their GPU tests pass (``GPU_TESTED_GROUPS``): ``fp8`` by default where it passes, else
``exact`` (the numerics of ``mma-sync``; ~2.5x its speed at 32:8, each against FA4-BF16: docs/kernels.md), else
``mma-sync``. Naming a wgmma kernel for a group where it fails is an error unless ``MPFA_UNTESTED_GROUPS=1`` (for
testing a fix on the GPU).

Decode kernels, both with the paper's numerics: ``split-kv`` (the default: split-KV partitions, then a merge kernel)
and ``split-kv-fused``, a variant under test: the same split kernel, whose last warp per (request, KV head) merges
that head's partitions (an arrival counter per (request, KV head) in the workspace), no second kernel, with the merge
kernel's operations in its order, to equal ``split-kv``'s output bit for bit (tests/kernels_sm90/test_decode_gpu.py;
not yet run on a GPU).

The overrides are ``MPFA_PREFILL_KERNEL`` (the SGLang plugin's ``--mpfa-prefill-kernel`` sets it for every process
of the server) and ``MPFA_DECODE_KERNEL``. Host-side only: importing this module imports no CuTe DSL.
"""

from __future__ import annotations

import os

PREFILL_KERNELS: dict[str, str] = {
    "fp8": "FP8 QK and PV wgmma on operand images, Q/K requantized to e4m3 (mpfa-qk8tile-psum)",
    "exact": "NVFP4 QK dequantized exactly to FP16 wgmma, FP8 PV: the paper's numerics (mpfa)",
    "mma-sync": "warp-level mma.sync fallback for shapes the wgmma kernels refuse, the paper's numerics (mpfa)",
}
DECODE_KERNELS: dict[str, str] = {
    "split-kv": "split-KV partitions, then a merge kernel launched with programmatic dependent launch",
    "split-kv-fused": "split-KV partitions, the last warp of each (request, KV head) merges them (variant under test)",
}
DECODE_KERNEL = "split-kv"  # the default
DECODE_KERNEL_ENV = "MPFA_DECODE_KERNEL"
PREFILL_KERNEL_ENV = "MPFA_PREFILL_KERNEL"
WGMMA_KERNELS = ("fp8", "exact")  # in the order the default prefers them
WGMMA_GROUPS = tuple(range(1, 9))  # a warpgroup's 64 rows: gcd(group, 4) heads x 64 / gcd(group, 4) rows
# Where tests/kernels_sm90/test_prefill_{fp8,exact}_gpu.py pass (H100, 2026-12-06); fp8 at groups 6-8 and exact at
# 1-2 miss their oracles there.
GPU_TESTED_GROUPS = {"fp8": (1, 2, 3, 4, 5), "exact": (3, 4, 5, 6, 7, 8)}
UNTESTED_GROUPS_ENV = "MPFA_UNTESTED_GROUPS"
WGMMA_MIN_PAGE = 64  # the wgmma kernels' 64-key tiles never straddle a page
NUMERICS = {"fp8": "mpfa-qk8tile-psum", "exact": "mpfa", "mma-sync": "mpfa"}
SOFTMAX_KEYS = {"fp8": 128, "exact": 64, "mma-sync": 32}


def wgmma_fits(num_q_heads: int, num_kv_heads: int, page_size: int, groups: tuple[int, ...] = WGMMA_GROUPS) -> bool:
    """Whether the wgmma kernels (``fp8``, ``exact``) take this shape (``groups``: the GQA groups allowed)."""
    return (num_q_heads % 2 == 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads in groups and page_size >= WGMMA_MIN_PAGE)


def requested_prefill_kernel(kernel: str | None = None) -> str | None:
    """``kernel``, else ``MPFA_PREFILL_KERNEL``, checked (None: neither is set); case-insensitive."""
    return _requested(kernel, PREFILL_KERNEL_ENV, PREFILL_KERNELS)


def _requested(kernel: str | None, env: str, names: dict[str, str]) -> str | None:
    """``kernel``, else the environment variable ``env`` (unset or empty: None), lower-cased and checked against
    ``names``; a ValueError naming the choices otherwise."""
    source = "kernel" if kernel is not None else env
    choice = kernel if kernel is not None else os.environ.get(env) or None
    if choice is None:
        return None
    choice = choice.strip().lower()
    if choice not in names:
        raise ValueError(f"{source} must be one of {', '.join(names)}, got {choice!r}")
    return choice


def prefill_kernel(num_q_heads: int, num_kv_heads: int, page_size: int, kernel: str | None = None) -> str:
    """The prefill kernel that runs for this shape: ``kernel`` or ``MPFA_PREFILL_KERNEL`` if given (a wgmma kernel
    the shape does not fit, or whose GPU tests fail at its group, is a ValueError), else the first wgmma kernel
    whose GPU tests pass at this shape (``fp8``, then ``exact``), else ``mma-sync``."""
    choice = requested_prefill_kernel(kernel)
    if choice is None:
        tested = [k for k in WGMMA_KERNELS if wgmma_fits(num_q_heads, num_kv_heads, page_size, GPU_TESTED_GROUPS[k])]
        return tested[0] if tested else "mma-sync"
    if choice in WGMMA_KERNELS:
        check_wgmma_shape(choice, num_q_heads, num_kv_heads, page_size)
        _check_tested_group(choice, num_q_heads // num_kv_heads)
    return choice


def _check_tested_group(kernel: str, group: int) -> None:
    """A ValueError unless ``kernel`` passes its GPU tests at GQA ``group`` or ``MPFA_UNTESTED_GROUPS=1``."""
    tested = GPU_TESTED_GROUPS[kernel]
    if group in tested or os.environ.get(UNTESTED_GROUPS_ENV) == "1":
        return
    others = [k for k in WGMMA_KERNELS if k != kernel and group in GPU_TESTED_GROUPS[k]]
    raise ValueError(
        f"the {kernel} prefill kernel fails its GPU tests at GQA group {group} (it passes groups "
        f"{', '.join(map(str, tested))}): use {' or '.join([*others, 'mma-sync'])} "
        f"({UNTESTED_GROUPS_ENV}=1 runs it anyway, to test a fix)")


def check_wgmma_shape(kernel: str, num_q_heads: int, num_kv_heads: int, page_size: int) -> None:
    """A ValueError naming the limits unless the wgmma kernel ``kernel`` takes this shape (`wgmma_fits`)."""
    if not wgmma_fits(num_q_heads, num_kv_heads, page_size):
        raise ValueError(
            f"the {kernel} prefill kernel needs a GQA group of {WGMMA_GROUPS[0]} to {WGMMA_GROUPS[-1]}, an even number of "
            f"query heads and pages of >= {WGMMA_MIN_PAGE} keys; got {num_q_heads}:{num_kv_heads} heads, pages of "
            f"{page_size}: use mma-sync")


def decode_kernel(kernel: str | None = None) -> str:
    """The decode kernel that runs: ``kernel``, else ``MPFA_DECODE_KERNEL``, else `DECODE_KERNEL`; checked,
    case-insensitive."""
    return _requested(kernel, DECODE_KERNEL_ENV, DECODE_KERNELS) or DECODE_KERNEL


def prefill_numerics(kernel: str) -> str:
    """The `mpfa.kernels.reference` variant a prefill kernel computes."""
    return NUMERICS[kernel]


def softmax_keys(kernel: str) -> int:
    """Keys per online-softmax update (the reference's ``block_n`` that rounds P as the kernel does): the fp8
    kernel's consumers step over 128 keys, the exact kernel's over 64, the mma-sync kernel's warps over 32."""
    return SOFTMAX_KEYS[kernel]
