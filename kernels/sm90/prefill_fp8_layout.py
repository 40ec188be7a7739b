"""The fp8 prefill kernel's operand layouts and requantization math: plain functions that the kernel and its
operand pass trace (`prefill_fp8`, `prefill_fp8_pass`) and the CPU tests run on Python ints or NumPy arrays.

* Requantization (the reference's ``mpfa-qk8tile``, `formats.fake_quant_fp8_pow2`): Q and K are the exactly
  dequantized centered NVFP4 values requantized to e4m3 with a power-of-two scale 2**e, Q per (query row, head), K
  per 64-key tile of a KV head. The exponent is the smallest e with amax / 2**e <= 448, amax taken as 6 x the
  largest NVFP4 block scale of the group (`exponent_from_scale`, `ptx.e4m3_pow2_exponent`): NVFP4 quantization
  gives the largest element of every nonzero block the code 6, so that *is* the group's largest magnitude. The
  expansion is the exact NVFP4 -> f16x2 (e2m1 x block scale) with the block scale multiplied by 2**-e in two exact
  power-of-two steps (`pow2_factors`: 2**-e can exceed FP16's 2**15), then ``cvt.rn.satfinite.e4m3x2.f16x2``
  (`fp8_chunk_words`), into e4m3 operand tiles [64 rows][128], K-major with the 128-byte swizzle
  (`fp8_operand_offset`, CuTe's `fp8_operand_layout`). Exact in FP16, so bit-exact with `fake_quant_fp8_pow2` for
  the same exponent.
* V^T: FP8 wgmma needs both operands K-major, so PV's B is V^T [dims][64 keys], keys contiguous, in CuTe's 64-byte
  swizzle (`vt_layout`, `vt_offset`). P stays in registers: the S accumulator gives thread (g, c) keys 8 j + 2c,
  + 1 of rows g, g + 8, and the e4m3 A fragment of ``m64nNk32`` wants 4 consecutive k positions 4c .. 4c + 3 per
  register, so the k positions are relabelled: position 16 G + 4c + b holds key 16 G + 2c + (b & 1) + 8 (b >> 1)
  (`pv_key`), the thread packs its own values (`p_operand_fp8`) and V^T is written in the same key order: per
  16 keys x 16 dims block, ``ldmatrix.trans`` of the two 8x8 matrices of 16-bit elements gives lane (g, c) the bytes
  V[key 2c, 2c + 1][dims 2g, 2g + 1] of each; one byte permute per output register gathers dim 2g (or 2g + 1) of
  keys 2c, 2c + 1, 8 + 2c, 9 + 2c, exactly `pv_key`'s order, which ``stmatrix`` writes to V^T (`v_load_lane`,
  `v_store_lane`).
* Row sums on the tensor cores: V^T has 8 more rows (PV's wgmma is m64n136k32): row 128 all e4m3 1.0, rows 129 ..
  135 zeros (`ROW_SUM_COLUMNS`), so column 128 of the PV accumulator is the row's sum of the e4m3 P the MMA
  consumed (the reference's ``mpfa-qk8tile-psum``).
* Delta_S in FP32, in the consumers' order (`ds_staged_offset`): one 16-byte word per (head, 16 keys, lane c).
* The operand image (`image_bytes`): one 64-key tile of one KV head as the attention kernel's consumers read it: e4m3
  K [64 keys][128], e4m3 V^T [136 rows][64 keys], the group's FP32 Delta_S, the tile's 2**e_k as FP32 bits in the
  image's last 16 bytes (`exponent_offset`). 18 KB for GQA groups 1-5 (`IMAGE_BYTES`), 19 KB for groups 6-8, whose
  Delta_S (256 bytes a head) reaches the 18 KB image's end (group 6) or runs past it (groups 7, 8).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int64, Uint32
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from . import decode_layout as lay
from . import dispatch
from .prefill_base import HEAD_DIM
from .prefill_wgmma import N_BLOCKS, OPERAND_ALIGN, TILE_KEYS, warpgroup_half
from .ptx import (bits_to_f32, e4m3x2_to_f16x2, f16x2x2_to_e4m3x4, f32x4_to_e4m3x4, max_u16x2, mul_f16x2, prmt,
                  prmt_var, shuffle_xor_u32)

FP8_OPERAND_BYTES = TILE_KEYS * HEAD_DIM  # one e4m3 operand tile [64][128]
F16_EXP_BIAS = 15
F16_MAX_EXP = 15  # 2**15: the largest power of two in FP16
F16X2_EXP_SHIFT = 0x04000400  # (biased exponent) * this = the f16x2 of 2**(exponent - 15) in both halves
E2M1_F16_HIGH = (0x3E3C3800, 0x46444240)  # high bytes of the FP16 of e2m1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6
E2M1_MAGNITUDES = 0x77777777  # the 3 magnitude bits of each of a word's 8 e2m1 codes
F16X2_SIGNS = 0x80008000

ROW_SUM_COLUMNS = 8  # V^T rows 128 .. 135 (the PV wgmma's N grows by 8): a row of ones, then zeros
PV_N = HEAD_DIM + ROW_SUM_COLUMNS  # the PV wgmma's N: O and the row sums
E4M3_ONES = 0x38383838  # four e4m3 1.0
ROW_SUM_UNITS = ROW_SUM_COLUMNS * TILE_KEYS // 16  # 16-byte units of those rows
VT_BYTES = PV_N * TILE_KEYS  # the e4m3 V^T tile [136 rows][64 keys]
VT_ROW_BYTES = TILE_KEYS
BLOCK = 16  # a transpose block: 16 keys x 16 dims (two 8x8 matrices of 16-bit elements)
BLOCKS = (TILE_KEYS // BLOCK) * (HEAD_DIM // BLOCK)  # 32 per tile
BLOCKS_PER_WARP_STEP = 2  # one ldmatrix.x4 / stmatrix.x4
EVEN_BYTES, ODD_BYTES = 0x6420, 0x7531  # prmt selectors: bytes 0, 2, 4, 6 / 1, 3, 5, 7 of {b, a}

GROUPS = dispatch.WGMMA_GROUPS  # the GQA groups the kernel takes (1 .. 8)


# --- the requantization ---------------------------------------------------------------------------------------

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
    128-byte rows differ in the swizzle's low bit): conflict-free."""
    return warpgroup_half(wg, r, warpgroups), wg_tid >> 2, wg_tid & 3


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
    caller's use of each register is traced right after it): the code's bits placed in FP16
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
    Per word 15 integer operations where the shift's take 15 and 4 HMUL2. The same FP16 bits (-0 for code 8), so
    bit-exact with it (a generator as that one); ``lookup`` / ``permute``: the byte permutes (`ptx.prmt_var`,
    `ptx.prmt`, or the CPU tests' model)."""
    magnitudes = word & E2M1_MAGNITUDES  # (plain ints: the same function models the kernel on the CPU)
    low = lookup(*E2M1_F16_HIGH, magnitudes)  # high bytes of codes 0 .. 3
    high = lookup(*E2M1_F16_HIGH, magnitudes >> 16)  # of codes 4 .. 7
    for j in range(4):
        yield permute(low, high, e2m1_lut_selectors(j)) | ((word << (12 - 4 * j)) & F16X2_SIGNS)


def fp8_chunk_words(words: list, scale_pair: Uint32, factors: tuple, decode=e2m1_word_f16x2_shift) -> list:
    """A 16-byte NVFP4 chunk (32 elements: 4 words) and its two e4m3 block scales -> 8 words of e4m3
    (x / 2**e, `factors` from `pow2_factors`): the exact f16x2 expansion (`warp_mma.q_chunk_regs`' element order,
    register i -> bytes 2i, 2i + 1; ``decode`` a word's 4 registers of exact values) with the block scales times
    2**-e, then e4m3 per pair."""
    scales = mul_f16x2(mul_f16x2(e4m3x2_to_f16x2(scale_pair), factors[0]), factors[1])
    blocks = prmt(scales, scales, 0x1010), prmt(scales, scales, 0x3232)
    regs = []
    for word in range(lay.QK_REGS // 4):
        for exact in decode(words[word]):
            regs.append(mul_f16x2(exact, blocks[word // 2]))
    return [f16x2x2_to_e4m3x4(regs[2 * i], regs[2 * i + 1]) for i in range(len(regs) // 2)]


# --- V^T and P ----------------------------------------------------------------------------------------------------

def pv_key(position):
    """The key (0 .. 63 in the tile) whose P / V sits at k position ``position`` of the PV wgmma: within each 16
    keys, position 4c + b holds key 2c + (b & 1) + 8 (b >> 1)."""
    return (position & ~15) + (((position >> 2) & 3) << 1) + (position & 1) + (((position >> 1) & 1) << 3)


def vt_offset(dim, unit):
    """Byte offset in the V^T tile of the 16-byte unit ``unit`` (k positions 16 unit .. + 15) of row ``dim``: CuTe's
    64-byte-swizzle K-major layout (`vt_layout`): 64 bytes per row, unit XOR (row / 2) % 4."""
    return dim * VT_ROW_BYTES + ((unit ^ ((dim >> 1) & 3)) << 4)


def vt_layout(dims: int = PV_N):
    """CuTe's layout of the e4m3 V^T tile [``dims`` rows][64 keys], keys contiguous (K-major for PV)."""
    e4m3 = cutlass.Float8E4M3FN
    atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, e4m3, TILE_KEYS),
                                           e4m3)
    return cute.tile_to_shape(atom, (dims, TILE_KEYS), order=(0, 1))


def v_transpose_block(tid, r: int, threads: int):
    """(key group G, dim piece p) of the 16 x 16 block that lane ``tid & 31``'s ldmatrix / stmatrix address serves
    in round ``r`` (``0 .. BLOCKS / (2 warps) - 1``), and the lane's matrix i = lane / 8 (of the x4): warp slot
    s = warps r + warp moves blocks 2s (matrices 0, 1) and 2s + 1 (matrices 2, 3); block b is (b / 8, b % 8)."""
    warps = threads // 32
    lane, warp = tid & 31, tid >> 5
    matrix = lane >> 3
    block = BLOCKS_PER_WARP_STEP * (warps * r + warp) + (matrix >> 1)
    return block >> 3, block & 7, matrix


def v_load_lane(tid, r: int, threads: int) -> tuple:
    """(32-key half, key in the half, dim piece) whose 16-byte ring row the lane addresses for `ldmatrix_x4_trans`:
    matrix i = 2 m + n of the x4 holds block m's keys 16 G + 8 n .. + 7 (row = lane % 8), dims 16 p .. + 15."""
    group, piece, matrix = v_transpose_block(tid, r, threads)
    key = group * BLOCK + ((matrix & 1) << 3) + (tid & 7)
    return key >> 5, key & 31, piece


def v_store_lane(tid, r: int, threads: int) -> tuple:
    """(dim, 16-byte unit) of the V^T row the lane addresses for `stmatrix_x4`: matrix 2 m + parity holds block m's
    dims 16 p + 2 row + parity (row = lane % 8), k positions 16 G .. + 15."""
    group, piece, matrix = v_transpose_block(tid, r, threads)
    return piece * BLOCK + ((tid & 7) << 1) + (matrix & 1), group


def p_operand_fp8(probs: list, words) -> None:
    """P of the tile (already times 448) -> the e4m3 A fragment of the PV wgmma (``words``: 8 registers of 4 e4m3):
    word ``r + 2 b + 4 k`` holds row g + 8 r at k positions 32 k + 16 b + 4c .. + 3 = keys (`pv_key`) 2c, 2c + 1
    of S column block 4 k + 2 b and of the next block."""
    for k in range(N_BLOCKS // 4):
        for b in range(2):
            for r in range(2):
                lo, hi = probs[4 * k + 2 * b], probs[4 * k + 2 * b + 1]
                words[r + 2 * b + 4 * k] = f32x4_to_e4m3x4(lo[2 * r], lo[2 * r + 1], hi[2 * r], hi[2 * r + 1])


# --- Delta_S in the consumers' order ------------------------------------------------------------------------------

def ds_staged_offset(head, key):
    """Byte offset of (head, key)'s FP32 Delta_S in an image: one 16-byte word per (head, 16 keys, lane c) holding
    keys 16 i + 2c, + 1, 16 i + 8 + 2c, + 1 (the lane's scores of column blocks 2i, 2i + 1)."""
    return ((((head * (TILE_KEYS // 16) + (key >> 4)) * 4 + ((key >> 1) & 3)) * 16) + ((key >> 3) & 1) * 8
            + (key & 1) * 4)


def ds_staged_read(head, c, i: int):
    """Offset of the 16-byte word of lane ``c`` of head ``head``'s warp for column blocks 2i, 2i + 1 (key
    16 i + 8 b + 2c + half at word slot 2b + half)."""
    return ds_staged_offset(head, 16 * i + 2 * c)


# --- the operand images -------------------------------------------------------------------------------------------

def image_ds_bytes(group: int) -> int:
    """Bytes of an image's FP32 Delta_S: every query head of the KV head x 64 keys."""
    return 4 * group * TILE_KEYS


def _aligned_image(group: int) -> int:
    """K, V^T with the row-sum rows, the group's Delta_S and the exponent's 16 bytes, 1 KB-aligned (K's swizzle)."""
    stage = FP8_OPERAND_BYTES + VT_BYTES + image_ds_bytes(group) + EXPONENT_BYTES
    return -(-stage // OPERAND_ALIGN) * OPERAND_ALIGN


EXPONENT_BYTES = 16  # the image's last 16 bytes: the tile's 2**e_k as FP32 bits (4 used)
IMAGE_BYTES = _aligned_image(5)  # 18432: the image of GQA groups 1-5


def image_bytes(group: int) -> int:
    """Bytes of one operand image of GQA ``group`` (module docstring): 18 KB (`IMAGE_BYTES`) for groups 1-5, 19 KB
    for groups 6-8, whose Delta_S ends at byte 18,432, 18,688 or 18,944 of the image: over the 18 KB image's
    exponent (bytes 18,416 .. 18,419) and, at groups 7 and 8, past its end."""
    return max(IMAGE_BYTES, _aligned_image(group))


def exponent_offset(group: int) -> int:
    """Byte offset in an image of GQA ``group`` of the tile's 2**e_k (FP32 bits): the image's last 16 bytes, after
    the whole group's Delta_S."""
    return image_bytes(group) - EXPONENT_BYTES


assert all(image_bytes(group) == IMAGE_BYTES for group in GROUPS if group <= 5)
assert all(FP8_OPERAND_BYTES + VT_BYTES + image_ds_bytes(group) <= exponent_offset(group) for group in GROUPS)


def image_row(start, kv_head, tile, rows_per_head):
    """Row of the images tensor holding tile ``tile`` of KV head ``kv_head`` of the sequence whose tiles start at
    row ``start`` of each KV head's block (its ``image_starts`` entry)."""
    return Int64(kv_head) * rows_per_head + start + tile
