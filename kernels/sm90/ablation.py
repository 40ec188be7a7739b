"""Compile-time ablations of the sm90 prefill kernels, for timing only (the MpFA paper's Fig. 3 method).

An `Ablation` removes pieces of the per-tile work at compile time from v1 (`prefill.PrefillSm90`, `LADDER`) or
from the v7 kernels (`prefill_wgmma_pre`, the default prefill: `PRE_LADDER`); the time saved is what the piece
costs. Each removed piece is replaced by a cheap operation on the same inputs, so every load stays live and the
output still depends on the whole tile loop (nothing lets the compiler delete the loop). In v1:

* ``exp2=False``: P = max(lam S - lam m, -126) and alpha likewise (an FMNMX instead of ``ex2.approx``; row max,
  row sum and rescale stay);
* ``rowstats=False``: no row max, no row sum, no rescale of O (P = exp2(lam S), or `no_exp2` of it; l and m
  stay as initialised);
* ``dequant=False``: the NVFP4 Q and K words go to the FP16 MMAs as raw bits (one XOR with the block scales per
  K word keeps the scale loads live) instead of the exact e2m1 * scale expansion;
* ``pv=False``: no V transpose, no e4m3 packing of P, no PV MMAs; P is added into 16 of the O registers and the
  V words of the tile, XOR-folded, into one more (the V loads stay).

In the v7 kernels (`PrefillSm90WgmmaWsWideTile._softmax` / `_pv_gemm`) ``exp2`` and ``rowstats`` are v1's (the
alphas 1 without row statistics); ``pv=False`` keeps P's e4m3 packing and replaces the PV wgmma groups by
`fold_p_words` and empty groups (the operand images' V^T is still copied, not read); there is no ``dequant``:
their K expansion runs once per prefill in the operand pass, timed with every rung. They hold one CTA per SM by
their shared memory (160 KB), ablated or not, so they need no padding.

Occupancy (v1): the full kernel's 255 registers allow 2 CTAs (8 warps) per SM; removing pieces frees registers (the
last ladder step needs ~122, which would allow 4 CTAs), and more warps per SM would hide latency the full kernel
cannot hide, crediting the removed piece with an occupancy gain. So every ablated kernel launches with
``OCCUPANCY_PAD_BYTES`` of unused dynamic shared memory: at most 2 CTAs fit an H100/H200 SM (228 KB), as for the
full kernel, whose launch is unchanged.

The output of an ablated kernel is meaningless by design. `FULL` (every flag on) is the production kernel, whose
generated code the ablation parameter does not change (tests/kernels_sm90/test_prefill_ablation.py compares the
PTX). Ablated kernels are reachable only through `prefill_launch.mpfa_prefill_ablated`, never from
`mpfa_prefill` or the SGLang plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Ablation:
    """Which pieces of a tile the kernel runs (all True: the full kernel)."""

    exp2: bool = True
    rowstats: bool = True
    dequant: bool = True
    pv: bool = True

    @property
    def is_full(self) -> bool:
        return all(getattr(self, f.name) for f in fields(self))

    @property
    def name(self) -> str:
        off = [f.name for f in fields(self) if not getattr(self, f.name)]
        return "full" if not off else "no-" + "-".join(off)


FULL = Ablation()
OCCUPANCY_PAD_BYTES = 100 * 1024  # 2 x (100 KB + 1 KB reserved) fit the 228 KB of an sm_90 SM, 3 do not

# The cumulative ladder (label, ablation, piece removed at this step): each step's time difference to the
# previous one is that piece's share. The last step keeps the QK^T MMAs, the loads, Delta_S, masking and the loop.
LADDER: tuple[tuple[str, Ablation, str | None], ...] = (
    ("full", FULL, None),
    ("-exp2", Ablation(exp2=False), "exp2"),
    ("-exp2 -rowstats", Ablation(exp2=False, rowstats=False), "rowstats"),
    ("-exp2 -rowstats -dequant", Ablation(exp2=False, rowstats=False, dequant=False), "dequant"),
    ("QK MMA + loads only", Ablation(exp2=False, rowstats=False, dequant=False, pv=False), "pv"),
)


# The v7 kernels' ladder: their K is expanded in the operand pass (no dequantization in the attention kernel).
PRE_LADDER: tuple[tuple[str, Ablation, str | None], ...] = (
    ("full", FULL, None),
    ("-exp2", Ablation(exp2=False), "exp2"),
    ("-exp2 -rowstats", Ablation(exp2=False, rowstats=False), "rowstats"),
    ("QK MMA + copies only", Ablation(exp2=False, rowstats=False, pv=False), "pv"),
)


# --- replacement math (plain functions traced inline by `prefill.PrefillSm90`, like `prefill_tile`) -------------

def no_exp2(x):
    """``exp2=False``: ``ex2.approx`` replaced by a clamp, max(x, -126), one cheap ALU op (FMNMX) instead of the
    SFU. (Plain identity made ptxas schedule the loop differently and spill 16 bytes of stack inside it.)"""
    import cutlass.cute as cute
    from cutlass import Float32

    return cute.arch.fmax(x, Float32(-126.0))


def raw_q_regs(words: list, scale_pair):
    """``dequant=False``: Q chunk registers as the raw NVFP4 words (each word for the 4 registers it expands to),
    XORed with the scale pair so the scale load stays."""
    from mpfa.kernels.sm90 import decode_layout as lay

    raw = [word ^ scale_pair for word in words]
    return [raw[reg // 4] for reg in range(lay.QK_REGS)]


def qk_ntile_raw(a_steps: list, k_words: list, k_scale_pair, c_regs: list) -> list:
    """``dequant=False``: `warp_mma.qk_ntile` with the raw K words (XORed with the scale pair) as B registers."""
    from mpfa.kernels.sm90 import decode_layout as lay
    from mpfa.kernels.sm90.ptx import mma_f16_m16n8k16

    raw = [word ^ k_scale_pair for word in k_words]
    for k_step in range(lay.K_STEPS_QK):
        b_regs = [raw[reg // 4] for reg in lay.qk_step_regs(k_step)]
        c_regs = mma_f16_m16n8k16(a_steps[k_step], b_regs, c_regs)
    return c_regs


def plain_probs(scores: list, lam_scaled, exp2) -> list:
    """``rowstats=False``: P = exp2(lam S) (``exp2`` may be `no_exp2`), no max, no sum."""
    return [[exp2(score * lam_scaled) for score in n_tile] for n_tile in scores]


def fold_p_words(acc, frags: list, fresh: bool) -> None:
    """``pv=False`` on the v7 kernels (`PrefillSm90WgmmaWsWideTile._pv_gemm`): each 4-byte word of the P fragments
    ``frags`` (e4m3 P in the PV wgmma's A layout), as FP32 bits with the exponent cleared (finite), into the
    accumulator register of its index (``fresh``: set, else added); the accumulator's other registers keep their
    values (zeros from before the walk in v7b .. v7h; in v7, whatever they held: its output is meaningless anyway)."""
    import cutlass.cute as cute
    from cutlass import Uint32

    from mpfa.kernels.sm90.ptx import bits_to_f32

    words = []
    for frag in frags:
        frag_words = cute.recast_tensor(frag, Uint32)
        words += [frag_words[i] for i in range(cute.size(frag_words))]
    for i, word in enumerate(words):
        value = bits_to_f32(word & Uint32(0x807FFFFF))
        acc[i] = value if fresh else acc[i] + value


def fold_without_pv(acc: list, probs: list, v_rows: list) -> list:
    """``pv=False``: acc[i] += P value i (16 of them) and acc[16] += the tile's V words XOR-folded (as FP32 bits,
    exponent cleared so it stays finite)."""
    from cutlass import Uint32

    from mpfa.kernels.sm90.ptx import bits_to_f32

    acc = list(acc)
    flat = [p for n_tile in probs for p in n_tile]
    for i, p in enumerate(flat):
        acc[i] = acc[i] + p
    folded = Uint32(0)
    for row in v_rows:
        for word in row:
            folded = folded ^ word
    acc[len(flat)] = acc[len(flat)] + bits_to_f32(folded & Uint32(0x807FFFFF))
    return acc
