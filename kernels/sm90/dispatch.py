"""The sm90 MpFA kernels, each declared once, and the one place that chooses which runs: from the shape, with one
override.

A kernel's declaration (`PrefillKernel`, `DecodeKernel`) holds its name (what users pass and runs record), what it
computes, its ``numerics`` (a `mpfa.kernels.reference.VARIANTS` name: the oracle its GPU tests compare against),
when it fits and its CuTe DSL class, named here and imported only when `prefill_launch` / `decode_launch` compile
it. Prefill kernels, named for what they compute (`PREFILL_KERNELS`, in the order the default tries them):

* ``fp8`` (the default where it fits): Q and K requantized from NVFP4 to e4m3 (power-of-two scales per query row
  and per 64-key tile), FP8 QKᵀ and PV wgmma in a warp-specialized kernel fed from FP8 operand images that one
  pass per prefill expands from the cache; numerics ``mpfa-qk8tile-psum``.
* ``exact``: the paper's numerics (``mpfa``): NVFP4 Q and K dequantized exactly to FP16 for the QKᵀ wgmma, ΔS as an
  extra K column, FP8 PV.
* ``mma-sync``: the fallback for the shapes neither wgmma kernel runs (pages of fewer than 64 keys, odd head counts,
  GQA groups above 8): warp-level mma.sync, the paper's numerics.

The wgmma kernels take every GQA group from 1 to 8 (a CTA holds gcd(group, 4) heads of the group); both pass their
GPU tests at every one (H100, 2026-12-06). The default is the first ``default`` kernel that fits the shape: ``fp8``
wherever the wgmma kernels fit (`wgmma_fits`), else ``mma-sync``; ``exact`` (the numerics of ``mma-sync`` at ~2.5x
its speed at 32:8, each against FA4-BF16: docs/kernels.md) runs when named.

Decode has one kernel, ``split-kv`` (split-KV partitions, then a merge kernel), with the paper's numerics.

The override is ``MPFA_PREFILL_KERNEL`` or a ``kernel`` argument, checked in one place (`requested_prefill_kernel`,
which looks the name up with `prefill_kernel_spec`): the SGLang plugin's ``--mpfa-prefill-kernel`` (which sets the
variable for every process of the server), `mpfa --prefill-kernel` and the kernel benchmarks' ``mpfa-<kernel>``
backends all pass through it. Host-side only: importing this module imports no CuTe DSL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import import_module

PREFILL_KERNEL_ENV = "MPFA_PREFILL_KERNEL"
WGMMA_GROUPS = tuple(range(1, 9))  # a warpgroup's 64 rows: gcd(group, 4) heads x 64 / gcd(group, 4) rows
WGMMA_MIN_PAGE = 64  # the wgmma kernels' 64-key tiles never straddle a page


def _load_class(path: str) -> type:
    """``"<module of this package>.<class>"`` -> the class (importing its module imports the CuTe DSL)."""
    module, _, name = path.rpartition(".")
    return getattr(import_module(f".{module}", __package__), name)


@dataclass(frozen=True)
class DecodeKernel:
    """The decode kernel: the split kernel's class and the merge kernel's that combines its partitions."""

    name: str
    computes: str
    numerics: str  # the `mpfa.kernels.reference` variant it computes
    kernel_class: str  # "<module>.<class>" in this package
    merge_class: str

    def load_classes(self) -> tuple[type, type]:
        """(split kernel class, merge kernel class)."""
        return _load_class(self.kernel_class), _load_class(self.merge_class)


@dataclass(frozen=True)
class PrefillKernel:
    """One prefill kernel. ``softmax_keys``: keys per online-softmax update (the reference's ``block_n`` that
    rounds P as the kernel does). ``wgmma``: a warpgroup-MMA kernel, which takes only the shapes `wgmma_fits` takes
    (the others take every shape). ``default``: a candidate for the shape's default. ``operand_pass_class``: the
    pass that expands the cache into operand images the attention reads (then it runs in two launches).
    ``ablations``: its class builds the compile-time ablations of `ablation.LADDER`."""

    name: str
    computes: str
    numerics: str  # the `mpfa.kernels.reference` variant it computes
    softmax_keys: int
    kernel_class: str  # "<module>.<class>" in this package: the attention
    wgmma: bool = False
    default: bool = False
    operand_pass_class: str | None = None
    ablations: bool = False

    def fits(self, num_q_heads: int, num_kv_heads: int, page_size: int) -> bool:
        """Whether this kernel takes the shape."""
        return not self.wgmma or wgmma_fits(num_q_heads, num_kv_heads, page_size)

    def load_class(self) -> type:
        return _load_class(self.kernel_class)

    def load_operand_pass_class(self) -> type:
        """The operand pass's class (for a kernel that has one: ``operand_pass_class``)."""
        return _load_class(self.operand_pass_class)


PREFILL_KERNELS: dict[str, PrefillKernel] = {
    k.name: k
    for k in (
        PrefillKernel("fp8", "FP8 QK and PV wgmma on operand images, Q/K requantized to e4m3 (mpfa-qk8tile-psum)",
                      numerics="mpfa-qk8tile-psum", softmax_keys=128, kernel_class="prefill_fp8.PrefillSm90Fp8",
                      wgmma=True, default=True, operand_pass_class="prefill_fp8_pass.OperandPass", ablations=True),
        PrefillKernel("exact", "NVFP4 QK dequantized exactly to FP16 wgmma, FP8 PV: the paper's numerics (mpfa)",
                      numerics="mpfa", softmax_keys=64, kernel_class="prefill_exact.PrefillSm90Exact", wgmma=True),
        PrefillKernel("mma-sync",
                      "warp-level mma.sync fallback for shapes the wgmma kernels refuse, the paper's numerics (mpfa)",
                      numerics="mpfa", softmax_keys=32, kernel_class="prefill_mma_sync.PrefillSm90MmaSync",
                      default=True),
    )
}
DECODE_KERNEL = DecodeKernel("split-kv", "split-KV partitions, then a merge kernel: the paper's numerics (mpfa)",
                             numerics="mpfa", kernel_class="decode.SplitKVDecodeSm90",
                             merge_class="decode_merge.DecodeMergeSm90")


def wgmma_fits(num_q_heads: int, num_kv_heads: int, page_size: int) -> bool:
    """Whether the wgmma kernels (``fp8``, ``exact``) take this shape."""
    return (num_q_heads % 2 == 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads in WGMMA_GROUPS and page_size >= WGMMA_MIN_PAGE)


def prefill_kernel_spec(name: str | None, source: str = "kernel") -> PrefillKernel:
    """The declaration of prefill kernel ``name`` (case-insensitive); any other name is a ValueError that says
    ``source`` must be one of the declared kernels."""
    choice = name.strip().lower() if isinstance(name, str) else name
    if choice not in PREFILL_KERNELS:
        raise ValueError(f"{source} must be one of {', '.join(PREFILL_KERNELS)}, got {choice!r}")
    return PREFILL_KERNELS[choice]


def requested_prefill_kernel(kernel: str | None = None) -> str | None:
    """``kernel``, else ``MPFA_PREFILL_KERNEL``, checked (None: neither is set); case-insensitive."""
    source = "kernel" if kernel is not None else PREFILL_KERNEL_ENV
    choice = kernel if kernel is not None else os.environ.get(PREFILL_KERNEL_ENV) or None
    return None if choice is None else prefill_kernel_spec(choice, source).name


def prefill_kernel(num_q_heads: int, num_kv_heads: int, page_size: int, kernel: str | None = None) -> str:
    """The prefill kernel that runs for this shape: ``kernel`` or ``MPFA_PREFILL_KERNEL`` if given (a wgmma kernel
    the shape does not fit is a ValueError), else the first ``default`` kernel that fits: ``fp8`` where the wgmma
    kernels fit (`wgmma_fits`) and ``mma-sync`` elsewhere."""
    choice = requested_prefill_kernel(kernel)
    if choice is None:
        return next(k.name for k in PREFILL_KERNELS.values() if k.default and k.fits(num_q_heads, num_kv_heads,
                                                                                       page_size))
    if PREFILL_KERNELS[choice].wgmma:
        check_wgmma_shape(choice, num_q_heads, num_kv_heads, page_size)
    return choice


def check_wgmma_shape(kernel: str, num_q_heads: int, num_kv_heads: int, page_size: int) -> None:
    """A ValueError naming the limits unless the wgmma kernel ``kernel`` takes this shape (`wgmma_fits`)."""
    if not wgmma_fits(num_q_heads, num_kv_heads, page_size):
        raise ValueError(
            f"the {kernel} prefill kernel needs a GQA group of {WGMMA_GROUPS[0]} to {WGMMA_GROUPS[-1]}, an even number of "
            f"query heads and pages of >= {WGMMA_MIN_PAGE} keys; got {num_q_heads}:{num_kv_heads} heads, pages of "
            f"{page_size}: use mma-sync")
