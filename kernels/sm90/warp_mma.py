"""Warp-level pieces of an MpFA tile shared by the sm90 decode and prefill kernels: exact NVFP4 -> FP16 operand
registers, the QK^T n-tile (Delta_S through the accumulator), FP8 P fragments and the O^T = V^T P^T m-tile.

Plain Python functions traced inline by the calling `cute.jit` kernel (loops are Python loops, fully unrolled);
the register layouts are `decode_layout`'s. They use only the primitives bound at module level, so the CPU tests
can run them on a NumPy model of a warp (tests/kernels/sm90/test_prefill_layout.py).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Uint32

from . import decode_layout as lay
from .ptx import e4m3x2_to_f16x2, f32x2_to_e4m3x2, mma_e4m3_m16n8k32, mma_f16_m16n8k16, mul_f16x2, prmt, shuffle_xor

P_SCALE = 448.0  # FP8 P is e4m3(448 P); the output divides by 448 l once
fmax = cute.arch.fmax


def _scale_blocks(scale: Uint32) -> tuple:
    """f16x2 of two block scales -> (first scale in both halves, second scale in both halves)."""
    return prmt(scale, scale, 0x1010), prmt(scale, scale, 0x3232)


def q_chunk_regs(words: list, scale_pair: Uint32) -> list:
    """A lane's 16-byte NVFP4 chunk of a Q row (4 words) and its two e4m3 block scales (low 16 bits of
    ``scale_pair``) -> the chunk's 16 f16x2 registers, exactly dequantized (e2m1 * 2**-14 * 2**14 * scale)."""
    blocks = _scale_blocks(e4m3x2_to_f16x2(scale_pair))
    regs = []
    for reg in range(lay.QK_REGS):
        word, j = divmod(reg, 4)
        exact = mul_f16x2(lay.e2m1_word_to_f16x2(words[word], j), Uint32(lay.F16X2_TWO_POW_14))
        regs.append(mul_f16x2(exact, blocks[word // 2]))
    return regs


def k_chunk_regs(words: list, scale_pair: Uint32) -> list:
    """`q_chunk_regs` for a K row: the chunk's 16 f16x2 registers in the same element order, each e2m1 * 2**-14
    times scale * 2**7, i.e. exactly K * 2**-7 (so Q K^T comes out as S * 2**-7, as in `qk_ntile`)."""
    blocks = _scale_blocks(mul_f16x2(e4m3x2_to_f16x2(scale_pair), Uint32(lay.F16X2_TWO_POW_7)))
    regs = []
    for reg in range(lay.QK_REGS):
        word, j = divmod(reg, 4)
        regs.append(mul_f16x2(lay.e2m1_word_to_f16x2(words[word], j), blocks[word // 2]))
    return regs


def k_fragments(k_words: list, k_scale_pair: Uint32) -> list:
    """The lane's K chunk (``k_words``: its 4 words of the key's NVFP4 row, ``k_scale_pair`` its two e4m3 block
    scales) -> the 16 f16x2 B registers of the 8 QK k-steps in k-step order (k-step k: registers 2k, 2k + 1), each
    e2m1 * 2**-14 * scale * 2**7, i.e. exactly K * 2**-7 (so Q K^T comes out as S * 2**-7)."""
    blocks = _scale_blocks(mul_f16x2(e4m3x2_to_f16x2(k_scale_pair), Uint32(lay.F16X2_TWO_POW_7)))
    regs = []
    for k_step in range(lay.K_STEPS_QK):
        for reg in lay.qk_step_regs(k_step):
            word, j = divmod(reg, 4)
            regs.append(mul_f16x2(lay.e2m1_word_to_f16x2(k_words[word], j), blocks[lay.scale_block_of_step(k_step)]))
    return regs


def qk_ntile(a_steps: list, fragments: list, c_regs: list) -> list:
    """One 8-key n-tile of S * 2**-7 = Q K^T * 2**-7 + C over the 8 k-steps. ``a_steps[step]``: the 4 A registers
    of the step; ``fragments``: the n-tile's B registers (`k_fragments`); ``c_regs``: the accumulator's initial
    value (Delta_S * 2**-7, or -inf for a masked score)."""
    for k_step in range(lay.K_STEPS_QK):
        c_regs = mma_f16_m16n8k16(a_steps[k_step], fragments[2 * k_step:2 * k_step + 2], c_regs)
    return c_regs


def p_pair(p_lo: Float32, p_hi: Float32) -> Uint32:
    """e4m3(448 P) of two keys in the low 16 bits (``p_lo`` in byte 0)."""
    return f32x2_to_e4m3x2(p_lo * Float32(P_SCALE), p_hi * Float32(P_SCALE))


def p_fragment(pairs: list) -> list:
    """P^T B registers of a 32-key PV step from the e4m3 pairs of its 4 n-tiles (keys 8 n + 2c, 8 n + 2c + 1)."""
    return [pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16)]


def transpose_v(v_rows: list) -> list:
    """V chunks (dimensions 16g..16g+15, 4 words each) of the 8 keys ``pv_key(k_half, c, j)`` (index 4 k_half + j)
    -> per k_half, 16 registers: register 4 word + b holds dimension 4 word + b of the 4 keys j = 0..3."""
    sel_lo, sel_hi, sel_even, sel_odd = lay.transpose_selectors()
    transposed = []
    for k_half in range(2):
        rows = [v_rows[4 * k_half + j] for j in range(4)]
        bytes_by_dim = []
        for word in range(4):
            lo01 = prmt(rows[0][word], rows[1][word], sel_lo)
            hi01 = prmt(rows[0][word], rows[1][word], sel_hi)
            lo23 = prmt(rows[2][word], rows[3][word], sel_lo)
            hi23 = prmt(rows[2][word], rows[3][word], sel_hi)
            bytes_by_dim += [prmt(lo01, lo23, sel_even), prmt(lo01, lo23, sel_odd),
                             prmt(hi01, hi23, sel_even), prmt(hi01, hi23, sel_odd)]
        transposed.append(bytes_by_dim)
    return transposed


def pv_mtile(transposed: list, p_regs: list, m_tile: int, c_regs: list) -> list:
    """O^T m-tile ``m_tile`` (dimensions ``o_dim(m_tile, g, upper)``) += V^T P^T over one 32-key step."""
    lower, upper = lay.pv_a_regs(m_tile)
    a_regs = [transposed[0][lower], transposed[0][upper], transposed[1][lower], transposed[1][upper]]
    return mma_e4m3_m16n8k32(a_regs, p_regs, c_regs)


def quad_max(x: Float32) -> Float32:
    """Max over the 4 lanes of a lane group (the lanes holding one accumulator row)."""
    x = fmax(x, shuffle_xor(x, 1))
    return fmax(x, shuffle_xor(x, 2))


def quad_sum(x: Float32) -> Float32:
    """Sum over the 4 lanes of a lane group."""
    x = x + shuffle_xor(x, 1)
    return x + shuffle_xor(x, 2)
