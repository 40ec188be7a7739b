"""QK^T of the staged prefill from K expanded once per CTA (``shared_dequant``): the register math, as plain
functions like `prefill_tile` (the primitives are looked up in `warp_mma` at call time, so the CPU test's NumPy
model of a warp can replace them).

`k_fragments` is `warp_mma.qk_ntile`'s expansion of one n-tile's K (its B registers, in k-step order),
`k_fragment_part` the same for a part of the chunk (the CTA's warps share the expansion), and
`qk_ntile_from_fragments` is `warp_mma.qk_ntile` on already expanded B registers: the same FP16 products and the
same MMA chain, so S is bit-identical to v1's `prefill_tile.qk_scores` (which drives it, through its ``ntile``
hook, with the same initial accumulators)."""

from __future__ import annotations

import cutlass
from cutlass import Uint32

from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90 import warp_mma

select_ = cutlass.select_


def k_fragments(k_words: list, k_scale_pair, k_steps: int = lay.K_STEPS_QK) -> list:
    """The B registers of the first ``k_steps`` k-steps (k-step k: registers 2k, 2k + 1) of the lane's K chunk:
    `warp_mma.qk_ntile`'s (all 16 by default)."""
    blocks = warp_mma._scale_blocks(warp_mma.mul_f16x2(warp_mma.e4m3x2_to_f16x2(k_scale_pair),
                                                       Uint32(lay.F16X2_TWO_POW_7)))
    regs = []
    for k_step in range(k_steps):
        for reg in lay.qk_step_regs(k_step):
            word, j = divmod(reg, 4)
            regs.append(warp_mma.mul_f16x2(lay.e2m1_word_to_f16x2(k_words[word], j),
                                           blocks[lay.scale_block_of_step(k_step)]))
    return regs


def k_fragment_part(k_words: list, k_scale_pair, part, parts: int) -> list:
    """`k_fragments`' registers of part ``part`` of ``parts`` (1 or 2) of the lane's chunk: with 2, k-steps
    4 part .. 4 part + 3 (registers 8 part .. 8 part + 7: words 2 part, 2 part + 1 and NVFP4 block 2c + part).
    ``part`` may be a runtime value: its words are selected and its block scale shifted down, one code path."""
    if parts == 1:
        return k_fragments(k_words, k_scale_pair)
    words = len(k_words) // 2
    upper = part > 0
    chosen = [select_(upper, k_words[words + i], k_words[i]) for i in range(words)]
    return k_fragments(chosen, k_scale_pair >> (8 * part), lay.K_STEPS_QK // 2)


def qk_ntile_from_fragments(a_steps: list, fragments: list, _unused, c_regs: list) -> list:
    """`warp_mma.qk_ntile` on the n-tile's expanded B registers (`k_fragments`); the signature of
    `prefill_tile.qk_scores`' ``ntile`` hook (the scale pair is already folded in)."""
    for k_step in range(lay.K_STEPS_QK):
        c_regs = warp_mma.mma_f16_m16n8k16(a_steps[k_step], fragments[2 * k_step:2 * k_step + 2], c_regs)
    return c_regs
