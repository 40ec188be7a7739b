"""MpFA prefill v5: v4 (`prefill_wgmma_fp8qk`, QK^T on FP8 wgmma) with PV on FP8 (e4m3) wgmma too.

Numerics: v4's, the reference variant ``mpfa-qk8tile`` (`kernels/reference.py`): P is e4m3(448 P) (FP32 P, round to
nearest even, saturating; `warp_mma.P_SCALE`) and V the cache's e4m3 values in both, and their products are exact
in FP32. What changes is who sums them: Hopper's FP8 wgmma adds a k-step's products with ~14 bits aligned to the
largest addend (measured for v4's QK, `profiles/NOTES.md`), not in FP32 as the FP16 wgmma of v3 / v4 does. So by
default (``fresh_pv``) each tile's P V goes into a fresh accumulator (the first k-step ignores its value) and is
added to O in FP32, as the reference forms each tile's P V and sums the tiles in FP32 -- the accumulation error of a
tile stays that of its 64 products, not of O's whole history. O is rescaled first as in v3 / v4 (skipped where
alpha is 1), then PV runs as two ``m64n64k32`` halves of the dims, each into S's accumulator (free once P is
packed: no extra registers) followed by 32 FADD into O. ``fresh_pv=False`` accumulates onto O in the wgmma as v3 /
v4 do (64 FADD fewer per tile, but O's low bits are lost at every tile).

Registers: v5w8 (2 CTAs of 256 threads per SM, v4w8's 16 warps) needs <= 128; ptxas gives the build 173 unbounded,
so it is launched with ``min_blocks_per_mp=2`` (``.minnctapersm 2``): 128, no local memory traffic in the tile loops
(24 bytes of values the epilogue needs are parked before them). Measured alternatives: `profiles/NOTES.md`.

Layouts (pure-Python models below, checked in `tests/kernels_sm90/test_prefill_v5_layout.py`):

* FP8 wgmma needs both operands K-major. For PV, K is the tile's keys, so B is V^T [128 dims][64 keys], keys
  contiguous: an 8 KB e4m3 tile in CuTe's 64-byte-swizzle K-major layout (`vt_layout`, `vt_offset`; 64 keys = 64
  bytes per row).
* P stays in registers. The FP32 accumulator of S gives thread (g, c) of a warp the keys 8 j + 2c, + 1 of rows g,
  g + 8; the e4m3 A fragment of ``m64nNk32`` wants in each 32-bit register 4 consecutive k positions 4c .. 4c + 3
  (+ 16 for the second register of a row, + 32 per k-step). Instead of moving P between lanes, the k positions are
  relabelled: position 16 G + 4c + b holds key 16 G + 2c + (b & 1) + 8 (b >> 1) (`pv_key`), so the thread packs its
  own accumulator values of column blocks 2 G and 2 G + 1 into one register (`p_operand_fp8`: 2 cvt per 4 keys,
  the second merging into the first's register), and V^T is written in the same key order.
* The V transpose (replacing v3 / v4's FP8 -> FP16 V expansion, done by all the CTA's threads): per 16 keys x 16
  dims block, `ldmatrix.trans` of the two 8x8 matrices of 16-bit elements (keys 16 G .. + 7 and + 8 .. + 15, 16
  bytes of dims each, from the ring's V rows) gives lane (g, c) the bytes V[key 2c, 2c + 1][dims 2g, 2g + 1] of
  each; one byte permute per output register gathers dim 2g (or 2g + 1) of keys 2c, 2c + 1, 8 + 2c, 9 + 2c: exactly
  k positions 4c .. 4c + 3 of row 2g (2g + 1) in `pv_key`'s order, which `stmatrix` (8x8 16-bit matrices, rows =
  dims) writes to V^T. A warp moves 2 blocks per ``ldmatrix.x4`` / 4 ``prmt`` / ``stmatrix.x4`` (`v_transpose_lane`);
  a v5w8 thread does that twice per tile (v4w8: 2 x (1 LDS.128, 8 FP8 -> FP16 conversions, 2 STS.128) and shifts).

Shared memory: v4's minus 8 KB (the V tile is e4m3): v5 76 KB, v5w8 84 KB.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.utils import LayoutEnum

from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90.prefill_wgmma import HEAD_DIM, N_BLOCKS, TILE_KEYS, _gemm, rescale
from mpfa.kernels.sm90.prefill_wgmma_fp8qk import PrefillSm90WgmmaFp8Qk
from mpfa.kernels.sm90.ptx import f32x4_to_e4m3x4, ldmatrix_x4_trans, prmt, stmatrix_x4
from mpfa.kernels.sm90.warp_mma import P_SCALE

VT_BYTES = HEAD_DIM * TILE_KEYS  # the e4m3 V^T tile [128 dims][64 keys]
VT_ROW_BYTES = TILE_KEYS
BLOCK = 16  # a transpose block: 16 keys x 16 dims (two 8x8 matrices of 16-bit elements)
KEY_GROUPS = TILE_KEYS // BLOCK  # 4
DIM_PIECES = HEAD_DIM // BLOCK  # 8 (16-byte pieces of a V row in the ring)
BLOCKS = KEY_GROUPS * DIM_PIECES  # 32 per tile
BLOCKS_PER_WARP_STEP = 2  # one ldmatrix.x4 / stmatrix.x4
EVEN_BYTES, ODD_BYTES = 0x6420, 0x7531  # prmt selectors: bytes 0, 2, 4, 6 / 1, 3, 5, 7 of {b, a}


# --- pure-Python models (the CPU tests check them; the kernel traces the same functions) -----------------------

def pv_key(position):
    """The key (0 .. 63 in the tile) whose P / V sits at k position ``position`` of the PV wgmma: within each 16
    keys, position 4c + b holds key 2c + (b & 1) + 8 (b >> 1)."""
    return (position & ~15) + (((position >> 2) & 3) << 1) + (position & 1) + (((position >> 1) & 1) << 3)


def vt_offset(dim, unit):
    """Byte offset in the V^T tile of the 16-byte unit ``unit`` (k positions 16 unit .. + 15) of row ``dim``: CuTe's
    64-byte-swizzle K-major layout (`vt_layout`): 64 bytes per row, unit XOR (row / 2) % 4."""
    return dim * VT_ROW_BYTES + ((unit ^ ((dim >> 1) & 3)) << 4)


def vt_layout(dims: int = HEAD_DIM):
    """CuTe's layout of the e4m3 V^T tile [``dims`` dims][64 keys], keys contiguous (K-major for PV); rows from a
    multiple of 8 on are the same layout from that row's offset (`vt_offset`)."""
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


def p_operand_fp8(probs: list, words, scale: float = P_SCALE) -> None:
    """P of the tile -> the e4m3 A fragment of the PV wgmma (``words``: 8 registers of 4 e4m3): word
    ``v1 + 2 v2 + 4 k`` holds row g + 8 v1 at k positions 32 k + 16 v2 + 4c .. + 3 = keys (`pv_key`) 2c, 2c + 1 of
    S column block 4 k + 2 v2 and of the next block; e4m3(``scale`` P) (1: P already carries the 448)."""
    for k in range(N_BLOCKS // 4):
        for v2 in range(2):
            for v1 in range(2):
                lo, hi = probs[4 * k + 2 * v2], probs[4 * k + 2 * v2 + 1]
                scaled = [x * Float32(scale) if scale != 1 else x
                          for x in (lo[2 * v1], lo[2 * v1 + 1], hi[2 * v1], hi[2 * v1 + 1])]
                words[v1 + 2 * v2 + 4 * k] = f32x4_to_e4m3x4(*scaled)


def p_operand_fp8_prescaled(probs: list, words) -> None:
    """`p_operand_fp8` of a P that already carries the 448 (the softmax's ``p_scale_log2``): no multiply."""
    p_operand_fp8(probs, words, scale=1.0)


class PrefillSm90WgmmaFp8Pv(PrefillSm90WgmmaFp8Qk):
    """v5: `PrefillSm90WgmmaFp8Qk` (v4) with PV on e4m3 wgmma (two ``m64n64k32`` halves of the dims), P from
    registers and V transposed into an e4m3 V^T tile (``warpgroups`` 2: v5w8). Class attributes for comparison
    builds: ``fresh_pv`` (True, the build: each tile's P V in a fresh accumulator, added to O in FP32; False: one
    ``m64n128k32`` accumulating onto O) and ``pv_n`` (64, the build: halves into S's accumulator; 32 / 128: a
    fresh accumulator of that many dims)."""

    v_bytes = VT_BYTES
    _p_operand = staticmethod(p_operand_fp8)
    fresh_pv = True  # each tile's P V in a fresh accumulator, added to O in FP32
    pv_n = 64  # PV's wgmma N: 64 = two m64n64k32 halves of the dims into S's accumulator; 32 / 128: a fresh one

    w8_min_ctas = 2  # v5w8: ptxas bounded to 128 registers (unbounded 173), 2 CTAs of 256 threads per SM
    # (v4w8's occupancy); v5 fits 2 CTAs by shared memory whatever its registers

    def _pv_operands(self, smem_ptr, v_offset):
        """PV on e4m3 ``m64n{pv_n}k32`` (2 k-steps; ``m64n128k32`` without ``fresh_pv``), P from registers, V^T
        K-major (`vt_layout`): one B tensor per N tile of V^T's rows."""
        e4m3 = cutlass.Float8E4M3FN
        n_tile = self.pv_n if self.fresh_pv else HEAD_DIM  # accumulating onto O: one MMA over all dims
        layout = vt_layout(n_tile)
        s_vts = tuple(cute.make_tensor(cute.recast_ptr(smem_ptr + v_offset + vt_offset(n, 0), layout.inner,
                                                       dtype=e4m3), layout.outer)
                      for n in range(0, HEAD_DIM, n_tile))
        mma_pv = sm90_utils.make_trivial_tiled_mma(e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                   (1, 1, 1), (64, n_tile), a_source=warpgroup.OperandSource.RMEM)
        return mma_pv, s_vts

    @cute.jit
    def _expand_v(self, stage, threads, smem):
        """The tile's e4m3 V [keys][dims] from the ring -> V^T [dims][k positions] (`pv_key` order): per warp and
        round one ldmatrix.x4.trans, 4 byte permutes, one stmatrix.x4 (module docstring)."""
        tid = threads[0]
        vt = smem + self.offsets[2]
        for r in cutlass.range_constexpr(BLOCKS // BLOCKS_PER_WARP_STEP // (self.fill_threads // 32)):
            half, key, piece = v_load_lane(tid, r, self.fill_threads)
            m = ldmatrix_x4_trans(stage + half * self.stage_bytes + sl.V_OFFSET + sl.V_ROW_BYTES * key
                                  + ((piece ^ sl.v_swizzle(key)) << 4))
            dim, unit = v_store_lane(tid, r, self.fill_threads)
            stmatrix_x4(vt + vt_offset(dim, unit), prmt(m[0], m[1], EVEN_BYTES), prmt(m[0], m[1], ODD_BYTES),
                        prmt(m[2], m[3], EVEN_BYTES), prmt(m[2], m[3], ODD_BYTES))

    @cute.jit
    def _pv(self, mmas, probs: list, alphas: list):
        """O = alpha O + e4m3(448 P) V^T on the FP8 wgmma. ``fresh_pv``: O rescaled as v3 (skipped where alpha is
        1), then per ``pv_n`` dims the tile's P V from a fresh accumulator -- S's, free once P is packed, for
        ``pv_n`` 64 -- added to O (O's registers 32 n .. 32 n + 31 are dims 64 n .. 64 n + 63); else v3's
        (accumulated onto O by the wgmma)."""
        if cutlass.const_expr(not self.fresh_pv):
            PrefillSm90WgmmaFp8Qk._pv(self, mmas, probs, alphas)
        else:
            mma_pv, operands, acc_s, acc_o = mmas[1], mmas[2], mmas[3], mmas[4]
            rescale(acc_o, alphas)
            self._p_operand(probs, cute.recast_tensor(operands[2], Uint32))
            acc_pv = acc_s
            if cutlass.const_expr(self.pv_n != TILE_KEYS):
                acc_pv = cute.make_rmem_tensor(mma_pv.get_slice(0).partition_shape_C((64, self.pv_n)), Float32)
            size = cute.size(acc_pv)
            for n in cutlass.range_constexpr(HEAD_DIM // self.pv_n):
                _gemm(mma_pv, acc_pv, operands[2], operands[3][n], fresh=True)
                for i in cutlass.range_constexpr(size):
                    acc_o[size * n + i] = acc_o[size * n + i] + acc_pv[i]
