"""Compile-time ablations of the fp8 prefill kernel, for timing only (the MpFA paper's Fig. 3 method).

An `Ablation` removes pieces of the per-tile work of `prefill_fp8.PrefillSm90Fp8` at compile time (`LADDER`); the
time saved is what the piece costs. Each removed piece is replaced by a cheap operation on the same inputs, so every
load stays live and the output still depends on the whole tile loop (nothing lets the compiler delete the loop):

* ``exp2=False``: P = max(lam S - lam m, -126) and alpha likewise (an FMNMX instead of ``ex2.approx``; row max,
  row sum and rescale stay);
* ``rowstats=False``: no row max, no row sum, no rescale of O (P = exp2(lam S), or `no_exp2` of it; the alphas 1);
* ``pv=False``: P's e4m3 packing stays, the PV wgmma groups are replaced by `fold_p_words` and empty groups (the
  operand images' V^T is still copied, not read).

There is no dequantization to ablate: the kernel's K expansion runs once per prefill in its operand pass, timed
with every rung. The kernel holds one CTA per SM by its shared memory (160 KB), ablated or not, so an ablated build
needs no occupancy padding. The output of an ablated kernel is meaningless by design. `FULL` (every flag on) is the
production kernel, whose generated code the ablation parameter does not change (tests/kernels/sm90/
test_prefill_ablation.py compares the SASS). Ablated kernels are reachable only through
`prefill_launch.mpfa_prefill_ablated`, never from `mpfa_prefill` or the SGLang plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Ablation:
    """Which pieces of a tile the kernel runs (all True: the full kernel)."""

    exp2: bool = True
    rowstats: bool = True
    pv: bool = True

    @property
    def is_full(self) -> bool:
        return all(getattr(self, f.name) for f in fields(self))

    @property
    def name(self) -> str:
        off = [f.name for f in fields(self) if not getattr(self, f.name)]
        return "full" if not off else "no-" + "-".join(off)


FULL = Ablation()

# The cumulative ladder (label, ablation, piece removed at this step): each step's time difference to the previous
# one is that piece's share. The last step keeps the QK^T MMAs, the copies, Delta_S, masking and the loop.
LADDER: tuple[tuple[str, Ablation, str | None], ...] = (
    ("full", FULL, None),
    ("-exp2", Ablation(exp2=False), "exp2"),
    ("-exp2 -rowstats", Ablation(exp2=False, rowstats=False), "rowstats"),
    ("QK MMA + copies only", Ablation(exp2=False, rowstats=False, pv=False), "pv"),
)


# --- replacement math (plain functions traced inline by the kernel) ---------------------------------------------

def no_exp2(x):
    """``exp2=False``: ``ex2.approx`` replaced by a clamp, max(x, -126), one cheap ALU op (FMNMX) instead of the
    SFU (a plain identity let ptxas schedule the loop differently)."""
    import cutlass.cute as cute
    from cutlass import Float32

    return cute.arch.fmax(x, Float32(-126.0))


def plain_probs(scores: list, lam_scaled, exp2) -> list:
    """``rowstats=False``: P = exp2(lam S) (``exp2`` may be `no_exp2`), no max, no sum."""
    return [[exp2(score * lam_scaled) for score in n_tile] for n_tile in scores]


def fold_p_words(acc, frags: list, fresh: bool) -> None:
    """``pv=False``: each 4-byte word of the P fragments ``frags`` (e4m3 P in the PV wgmma's A layout), as FP32
    bits with the exponent cleared (finite), into the accumulator register of its index (``fresh``: set, else
    added); the accumulator's other registers keep their values (zeros from before the walk)."""
    import cutlass.cute as cute
    from cutlass import Uint32

    from .ptx import bits_to_f32

    words = []
    for frag in frags:
        frag_words = cute.recast_tensor(frag, Uint32)
        words += [frag_words[i] for i in range(cute.size(frag_words))]
    for i, word in enumerate(words):
        value = bits_to_f32(word & Uint32(0x807FFFFF))
        acc[i] = value if fresh else acc[i] + value
