"""MpFA prefill v4: v3 (`prefill_wgmma`) with QK^T on FP8 (e4m3) wgmma; PV unchanged (FP16 wgmma, P e4m3-exact).

Numerics: the reference variant ``mpfa-qk8tile`` (`kernels/reference.py`, `formats.fake_quant_fp8_pow2`). Q and K
are the exactly dequantized centered NVFP4 values requantized to e4m3 with a power-of-two scale 2**e, Q per (query
row, head), K per 64-key tile of a KV head; S = (q8 . k8) 2**(e_q + e_k) + Delta_S, the dot products summed by
the FP8 wgmma (not exactly in FP32: see the QK item below).

* The exponent: the smallest e with amax / 2**e <= 448, with amax taken as 6 x the largest NVFP4 block scale of the
  group (`exponent_from_scale`, `ptx.e4m3_pow2_exponent`). NVFP4 quantization (`formats.quantize_nvfp4`) gives the
  largest element of every nonzero block the code 6 (its scale is amax / 6 rounded to e4m3, within 6.25%, so
  amax / scale >= 5.6 encodes as 6), so 6 x the largest block scale *is* the group's largest magnitude and e is the
  reference's exponent (`formats.e4m3_pow2_scale`; checked on the CPU). Were it ever larger (a block whose largest
  code is 4), nothing would saturate and only values in e4m3's subnormal range would round differently. K: every
  warp reads
  the tile's 512 block scales from the ring (16 bytes per lane) and reduces them with shuffles: no barrier, no
  shared memory. Q: the 4 threads of a quad that expand a row reduce its 8 scales with shuffles; the softmax
  threads read their rows' 8 scales once per CTA and compute the same exponent.
* The expansion: v3's exact NVFP4 -> f16x2 (e2m1 x block scale), with the block scale multiplied by 2**-e in two
  exact power-of-two steps (2**-e can exceed FP16's 2**15; scale x 2**-e <= 448 / 6 fits), then
  ``cvt.rn.satfinite.e4m3x2.f16x2`` (`ptx.f16x2x2_to_e4m3x4`) into e4m3 operand tiles [64 rows][128] e4m3,
  K-major with the 128-byte swizzle (`fp8_operand_offset`, CuTe's `fp8_operand_layout`): 8 KB each, half v3's.
  Exact in FP16 (at most 6 significant bits, nothing below FP16's normal range that e4m3 would not flush to 0),
  so bit-exact with `fake_quant_fp8_pow2` for the same exponent.
* QK on ``m64n64k32`` e4m3 wgmma (4 k-steps) from a zero accumulator (-inf where masked), then per score one FFMA:
  S 2**-7 = acc 2**(e_q + e_k - 7) + Delta_S 2**-7, so v3's online softmax (`prefill_tile.online_softmax`) runs
  unchanged. Not v3's Delta_S-initialised accumulator: Hopper's FP8 wgmma adds the products with fewer bits than
  FP32 (DeepSeek-V3's report measured ~14), relative to the largest addend, so a large initial value costs them
  precision: on the H200, 2.4-3.8e-3 rms from the oracle with Delta_S as the initial value, 1.5-2.3e-3 added after
  (both at ~1.5% of the format's own error, 0.13 from float64; `profiles/NOTES.md`). Delta_S is read from shared
  memory after the MMA, so no register holds it across the MMA (v4w8 stays at 128). Folding 2**(e_q + e_k) into
  the running max and lambda would save the multiply but needs its own softmax; left for later.
* PV exactly as v3.

Resources (ptxas, 32:8 causal BF16 page 128; `tests/kernels_sm90/test_prefill_v4_compile.py`): v4 151 registers
(v3 154), 0 spills, 84 KB dynamic shared memory (v3 100 KB), 2 CTAs per SM (8 warps); per tile loop 4
QGMMA.64x64x32 E4M3 + 4 HGMMA.64x128x16 (v3: 8 + 4 HGMMA); SASS per thread and whole 64-key tile 962 (v3 830:
+34 HMUL2 and +32 F2FP e4m3 for the requantization, the tile-max reduction). v4w8: 128 registers and 92 KB, so 2
CTAs of 256 threads fit an SM: 16 warps, the only build with more than 8 (the compile test holds it there: one
register more and it drops to 8); 778 per tile (v3w8 703). On the H200 (session 14, Delta_S still the initial
accumulator, 128 registers): v4w8 90.8 ms at 64K causal 32:8 (387 TFLOPS), 1.41x v3, where v4 (8 warps) gained
nothing: the warps, not FP8 QK, made the difference. Cheapest next savings: fold the scale into the softmax (-32
FMUL) and drop the separate x 2**14 of the e2m1 expansion (-16 HMUL2 per K chunk; needs a block-scale factor that
cannot overflow FP16).
"""

from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int64, Uint32
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90 import prefill_tile as tile_math
from mpfa.kernels.sm90.prefill_wgmma import (
    HEAD_DIM,
    N_BLOCKS,
    STAGES,
    TILE_KEYS,
    PrefillSm90Wgmma,
    _gemm,
    p_operand,
    warpgroup_half,
)
from mpfa.kernels.sm90.ptx import (
    bits_to_f32,
    e4m3_pow2_exponent,
    e4m3x2_to_f16x2,
    f16x2x2_to_e4m3x4,
    load_shared_v4_u32,
    load_u16,
    max_u16x2,
    mul_f16x2,
    prmt,
    prmt_var,
    shuffle_xor_u32,
)
from mpfa.kernels.sm90.warp_mma import P_SCALE

FP8_OPERAND_BYTES = TILE_KEYS * HEAD_DIM  # one e4m3 operand tile [64][128]
FP8_ROW_UNITS = HEAD_DIM // 16  # 16-byte units of an e4m3 operand row (128 bytes)
E4M3_MAX = 448.0
F16_EXP_BIAS = 15
F16_MAX_EXP = 15  # 2**15: the largest power of two in FP16
F16X2_EXP_SHIFT = 0x04000400  # (biased exponent) * this = the f16x2 of 2**(exponent - 15) in both halves
E2M1_F16_HIGH = (0x3E3C3800, 0x46444240)  # high bytes of the FP16 of e2m1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6
E2M1_MAGNITUDES = 0x77777777  # the 3 magnitude bits of each of a word's 8 e2m1 codes
F16X2_SIGNS = 0x80008000


# --- pure-Python model of the requantization (the CPU tests check it against `formats.fake_quant_fp8_pow2`) ------

def exponent_from_scale(scale: float) -> int:
    """The exponent e of the power-of-two e4m3 scale of a group whose largest NVFP4 block scale is ``scale``
    (its largest magnitude taken as 6 scale): the smallest e with 6 scale / 2**e <= 448; 0 for 0 (as
    `ptx.e4m3_pow2_exponent` computes it in the kernel)."""
    amax = 6.0 * float(scale)
    if amax == 0.0:
        return 0
    mantissa, exponent = math.frexp(amax)  # amax = mantissa 2**exponent, mantissa in [0.5, 1)
    return exponent - 9 + (1 if mantissa > 0.875 else 0)


def factor_exponents(e: int) -> tuple[int, int]:
    """The two power-of-two steps (a, b), a + b = -e, each a normal FP16 power of two (|step| <= 15), by which the
    kernel multiplies a block scale: ``a = min(-e, 15)``, ``b = -e - a`` (e >= -30 for any e4m3 scale)."""
    a = min(-e, F16_MAX_EXP)
    return a, -e - a


def fp8_operand_offset(row, unit):
    """Byte offset in an e4m3 operand tile [64 rows][128] of the 16-byte unit ``unit`` (elements 16 unit ..
    16 unit + 15) of row ``row``: K-major 128-byte swizzle, 128 bytes per row, unit XOR row within each 8-row,
    1024-byte group."""
    return row * 128 + (((unit & 7) ^ (row & 7)) << 4)


def fp8_operand_layout():
    """CuTe's layout of an e4m3 [64][128] wgmma operand tile with the 128 elements (bytes) contiguous (K-major)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float8E4M3FN, HEAD_DIM), cutlass.Float8E4M3FN)
    return cute.tile_to_shape(atom, (TILE_KEYS, HEAD_DIM), order=(0, 1))


def k_expand_unit(wg, wg_tid, r: int, warpgroups: int) -> tuple:
    """(32-key half, key within the half, NVFP4 chunk) of the K tile that thread ``wg_tid`` of warpgroup ``wg``
    expands in round ``r``: chunk t % 4 of key t / 4 of the half `warpgroup_half` gives it. A quarter-warp's 8 lanes
    (2 keys x 4 chunks) read 8 bank groups (64 key + 16 chunk) and store 8 (`fp8_operand_offset`: the two keys'
    128-byte rows differ in the swizzle's low bit): conflict-free, and cheaper in registers than v3's mapping
    (`prefill_wgmma.k_expand_unit`, which FP16's 256-byte rows need: v4w8 then needs 130 registers, 2 more than
    two CTAs per SM allow)."""
    return warpgroup_half(wg, r, warpgroups), wg_tid >> 2, wg_tid & 3


# --- traced pieces -----------------------------------------------------------------------------------------------

def max_scale_pairs(words: list) -> Uint32:
    """The per-16-bit-lane maximum of the e4m3 scale bytes in ``words`` (4 bytes each, non-negative scales: the
    byte order is the value order): a u16x2 of two candidate maxima."""
    best = None
    for word in words:
        pair = max_u16x2(word & Uint32(0x007F007F), (word >> 8) & Uint32(0x007F007F))
        best = pair if best is None else max_u16x2(best, pair)
    return best


def fold_max(pairs: Uint32, masks: tuple) -> Uint32:
    """`max_scale_pairs` over the lanes ``lane ^ m`` (shuffles with each mask in ``masks``) -> the largest scale
    byte, in the low 8 bits."""
    for mask in masks:
        pairs = max_u16x2(pairs, shuffle_xor_u32(pairs, mask))
    return max_u16x2(pairs, pairs >> 16) & Uint32(0xFF)


def pow2_factors(e: Uint32) -> tuple:
    """The f16x2 of 2**a and 2**b (`factor_exponents`) for the exponent ``e`` (two's complement): their product is
    2**-e; both steps are exact on a block scale (each product stays <= 448 / 6)."""
    biased = Uint32(F16_EXP_BIAS) - e  # 15 - e = 15 + a + b, >= 12
    a_biased = cutlass.min(biased, Uint32(F16_EXP_BIAS + F16_MAX_EXP))
    return a_biased * Uint32(F16X2_EXP_SHIFT), (biased - a_biased + Uint32(F16_EXP_BIAS)) * Uint32(F16X2_EXP_SHIFT)


def f32_pow2(biased) -> Float32:
    """2**(biased - 127) from its biased FP32 exponent (a Uint32 in 1 .. 254)."""
    return bits_to_f32(biased << 23)


def e2m1_word_f16x2_shift(word: Uint32):
    """A word of 8 e2m1 codes -> 4 f16x2 of their exact values (register j: codes j, j + 4; a generator, so the
    caller's use of each register is traced right after it), v3's way: the code's bits placed in FP16
    (`decode_layout.e2m1_word_to_f16x2`: value x 2**-14, 2 shifts and 2 masks) times 2**14 (one HMUL2 each)."""
    for j in range(4):
        yield mul_f16x2(lay.e2m1_word_to_f16x2(word, j), Uint32(lay.F16X2_TWO_POW_14))


def e2m1_lut_selectors(j: int) -> int:
    """The `prmt` selector that spreads the looked-up high bytes of codes j (from ``low``) and j + 4 (from
    ``high``) into an f16x2 (`e2m1_word_f16x2_lut`): bytes 1 and 3; bytes 0 and 2 are the sign of byte 0 of
    ``low`` (nibble 8), 0 since every table byte is below 0x80."""
    return 0x8 | (j << 4) | (0x8 << 8) | ((4 + j) << 12)


def e2m1_word_f16x2_lut(word: Uint32, lookup=prmt_var, permute=prmt):
    """`e2m1_word_f16x2_shift` by table look-up, without the 2**14 multiply: the FP16 of every e2m1 magnitude has
    only its high byte set, so one byte permute with the codes' magnitudes (3 bits each) as selectors looks up the
    high bytes of 4 codes in the 8-byte table `E2M1_F16_HIGH` (two for the word), one permute per register spreads
    codes j and j + 4 into an f16x2, and the sign bits are ORed in as in `decode_layout.e2m1_word_to_f16x2`.
    Per word 15 integer operations where v3's take 15 and 4 HMUL2. The same FP16 bits (-0 for code 8), so
    bit-exact with it (a generator as that one); ``lookup`` / ``permute``: the byte permutes (`ptx.prmt_var`,
    `ptx.prmt`, or the CPU tests' model)."""
    magnitudes = word & E2M1_MAGNITUDES  # (plain ints: the same function models the kernel on the CPU)
    low = lookup(*E2M1_F16_HIGH, magnitudes)  # high bytes of codes 0 .. 3
    high = lookup(*E2M1_F16_HIGH, magnitudes >> 16)  # of codes 4 .. 7
    for j in range(4):
        yield permute(low, high, e2m1_lut_selectors(j)) | ((word << (12 - 4 * j)) & F16X2_SIGNS)


def fp8_chunk_words(words: list, scale_pair: Uint32, factors: tuple, decode=e2m1_word_f16x2_shift) -> list:
    """A 16-byte NVFP4 chunk (32 elements: 4 words) and its two e4m3 block scales -> 8 words of e4m3
    (x / 2**e, `factors` from `pow2_factors`): v3's exact f16x2 expansion (`warp_mma.q_chunk_regs`' element order,
    register i -> bytes 2i, 2i + 1; ``decode`` a word's 4 registers of exact values) with the block scales times
    2**-e, then e4m3 per pair."""
    scales = mul_f16x2(mul_f16x2(e4m3x2_to_f16x2(scale_pair), factors[0]), factors[1])
    blocks = prmt(scales, scales, 0x1010), prmt(scales, scales, 0x3232)
    regs = []
    for word in range(lay.QK_REGS // 4):
        for exact in decode(words[word]):
            regs.append(mul_f16x2(exact, blocks[word // 2]))
    return [f16x2x2_to_e4m3x4(regs[2 * i], regs[2 * i + 1]) for i in range(len(regs) // 2)]


class PrefillSm90WgmmaFp8Qk(PrefillSm90Wgmma):
    """v4: `PrefillSm90Wgmma` with e4m3 Q / K operand tiles and QK on FP8 wgmma (``mpfa-qk8tile`` numerics).
    ``state`` carries, after v3's 4 entries, 2**(e_q - 7) of rows g, g + 8 and 2**e_k of the current tile."""

    qk_bytes = FP8_OPERAND_BYTES
    state_size = 7
    _ROW_SCALE, _TILE_SCALE = 4, 6
    score_scale_log2 = lay.SCORE_SCALE_LOG2  # the tile body's scores are S 2**-7 (v3's scale, which FP16 K needs;
    # lam_scaled carries 2**7); v6e: 0 (S itself, Delta_S unscaled: 16 FMUL fewer per tile, `score_init`)

    qk_dtype = cutlass.Float8E4M3FN  # QK on e4m3 ``m64n64k32``
    _unit_offset = staticmethod(fp8_operand_offset)
    _k_unit = staticmethod(k_expand_unit)  # this module's: conflict-free for e4m3 rows, fewer registers
    _k_decode = staticmethod(e2m1_word_f16x2_shift)  # e2m1 -> exact f16x2 in the K expansion (`fp8_chunk_words`)
    w8_stages = STAGES  # v4w8: 4 stages (92 KB) and 128 registers unbounded, as measured
    w8_min_ctas = 0
    any_group = False  # run and tested for group 4 only (as v5 and v6, which build on it)
    _p_operand = staticmethod(p_operand)  # P x 448 per value, as measured (v6k folds the 448 into the exponent)
    p_scale_log2 = 0.0
    l_scale = P_SCALE

    def _qk_layout(self):
        return fp8_operand_layout()

    def _row_exponents(self, state, q_scales, q_start, q_len, row0, head, g):
        """2**(e_q - 7) of the thread's rows g, g + 8 (from their 8 block scales each, as the
        expanding quad computes them in `_expand_q_chunk`)."""
        for r in range(2):
            query = row0 + g + 8 * r
            valid = Uint32(query < q_len)
            base = q_scales.iterator.toint() + (Int64(q_start + query) * self.num_q_heads + head) * sl.SCALE_ROW_BYTES
            pairs = [load_u16(base + 2 * k, valid, Uint32(0)) for k in range(4)]
            top = fold_max(max_scale_pairs([pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16)]), ())
            e = e4m3_pow2_exponent(top)
            state[self._ROW_SCALE + r] = f32_pow2(e + Uint32(127 - self.score_scale_log2))

    @cute.jit
    def _expand_q_chunk(self, q_tile, row, chunk, words, scales):
        """One chunk of Q to e4m3 with its row's power-of-two scale (the quad expanding the row reduces its block
        scales with two shuffles) in the warpgroup's e4m3 Q operand tile."""
        e = e4m3_pow2_exponent(fold_max(max_scale_pairs([scales]), (1, 2)))
        self._store_chunk(q_tile, row, chunk, fp8_chunk_words(words, scales, pow2_factors(e)))

    @cute.jit
    def _expand_k(self, stage, threads, smem, state: cute.Tensor):
        """The tile's K to e4m3 with the tile's power-of-two scale: each warp reduces the tile's 512 block scales
        (16 bytes per lane: lanes 0-15 the first 32-key half, 16-31 the second) to e_k, then expands v3's K
        chunks (`k_expand_unit`)."""
        state[self._TILE_SCALE] = f32_pow2(self._expand_k_e4m3(stage, threads, smem) + Uint32(127))

    def _expand_k_e4m3(self, stage, threads, smem) -> Uint32:
        """`_expand_k` without the state: the tile's K expanded to e4m3, its exponent e_k returned (v6's producer
        hands it to the consumers through shared memory)."""
        lane = threads[0] & 31
        tile_scales = load_shared_v4_u32(stage + (lane >> 4) * self.stage_bytes + sl.SCALE_OFFSET + 16 * (lane & 15))
        e = e4m3_pow2_exponent(fold_max(max_scale_pairs(tile_scales), (1, 2, 4, 8, 16)))
        self._expand_k_chunks(stage, threads, smem, functools.partial(fp8_chunk_words, factors=pow2_factors(e),
                                                                      decode=self._k_decode))
        return e

    def _qk_turn(self):
        """Before the QK wgmma is issued: nothing here; v6f's consumer ping-pong waits for its turn."""

    def _qk_issued(self):
        """After the QK wgmma is issued, before its wait: nothing here; v6f hands the turn to the other consumer."""

    def _qk_scores(self, masked: bool, tile, stage, mmas, state: cute.Tensor, ds_lane, limits, c) -> list:
        """S * 2**-7 = q8 k8^T 2**(e_q + e_k - 7) + Delta_S * 2**-7 (-inf where masked): the e4m3 QK wgmma from 0
        (or -inf), then one FFMA per score. Delta_S is not the accumulator's initial value as in v3: the FP8 wgmma
        accumulates with fewer bits than FP32, and a large initial value costs the products precision (measured:
        2.4-3.8e-3 rms from the oracle with Delta_S as the initial value, 1.5-2.3e-3 added after; NOTES)."""
        self._qk_issue(masked, tile, mmas, limits, c)
        warpgroup.wait_group(0)
        return self._qk_finish(stage, mmas, state, ds_lane)

    def _qk_issue(self, masked: bool, tile, mmas, limits, c, take_turn: bool = True, hand_over: bool = True) -> None:
        """The QK wgmma into a fresh accumulator (masked: onto 0, -inf where masked), issued and committed, not
        waited for. (Set to 0 by moves, a second accumulator of v6l's step was zeroed by 32 of them per tile.)
        ``take_turn`` / ``hand_over``: whether the ping-pong turn is taken before it / handed over after it (a step
        of several wgmmas takes its turn once: v7f)."""
        mma_qk, acc_s = mmas[0], mmas[3]
        t_q, t_k = mmas[2][0], mmas[2][1]
        if cutlass.const_expr(masked):
            seen = (limits[0] - tile - 2 * c, limits[1] - tile - 2 * c)
            for block in range(N_BLOCKS):
                init = tile_math.score_init(None, seen, block)  # 0, or -inf where masked
                for i in range(4):
                    acc_s[4 * block + i] = init[i]
        if take_turn:
            self._qk_turn()
        _gemm(mma_qk, acc_s, t_q, t_k, fresh=not masked, wait=False)
        if hand_over:
            self._qk_issued()

    def _qk_finish(self, stage, mmas, state: cute.Tensor, ds_lane) -> list:
        """The scores from the QK wgmma's accumulator (waited for by the caller): times the row and tile scales,
        plus Delta_S from ring stage ``stage``."""
        acc_s = mmas[3]
        ds_bits = self._ds_bits(stage, ds_lane)  # read after the MMA: no registers held across it
        scale = [state[self._ROW_SCALE + r] * state[self._TILE_SCALE] for r in range(2)]  # 2**(e_q + e_k - 7)
        if cutlass.const_expr(ds_bits is None):
            return [[acc_s[4 * block + i] * scale[i >> 1] for i in range(4)] for block in range(N_BLOCKS)]
        ds = [tile_math.score_init(ds_bits, None, block, self.score_scale_log2)  # Delta_S * 2**-7
              for block in range(N_BLOCKS)]
        return [[acc_s[4 * block + i] * scale[i >> 1] + ds[block][i] for i in range(4)] for block in range(N_BLOCKS)]
