"""The exact prefill kernel: the paper's numerics (``mpfa``) with both GEMMs on warpgroup MMA (wgmma): NVFP4 Q and K
dequantized exactly to FP16 for QK, Delta_S as an extra K column of QK, FP8 P times V exactly in FP16.

A CTA is two warpgroups (256 threads) over a 2-stage cp.async ring of 64-key tiles (`prefill_wgmma`); per tile:

* wait for the tile's copies + CTA barrier, issue the copies of a later tile (warpgroup w copies the 32-key half
  w with the 4-warp copy plan), expand K and V into shared-memory operand tiles shared by the warpgroups,
  ``fence.proxy.async`` (generic-proxy stores visible to wgmma) + CTA barrier, then per warpgroup QK, softmax, PV
  (each wgmma waited for before the next barrier, so the next expansion may overwrite the operand tiles). Each
  warpgroup skips the masked tiles none of its rows sees (only the earlier one, only at the start of the walk).
* K and V exactly to FP16: K as K * 2**-7 (`warp_mma.k_chunk_regs`, warpgroup w the K of half w, `k_expand_unit`),
  the e4m3 V (`v_expand_unit`), both [64 keys][128 dims] in the 128-byte-swizzled K-major layout of wgmma
  (`operand_offset`): K is QK's B operand, and the same layout read transposed is PV's B operand V^T with the
  dimensions contiguous (MN-major, allowed for 16-bit wgmma): no transpose. Q once per CTA, the same way
  (`warp_mma.q_chunk_regs`: the same element order within each 32-element chunk as K), into each warpgroup's Q
  tile: QK's A operand.
* S * 2**-7 = Q K^T * 2**-7 + Delta_S * 2**-7 on ``m64n64k16`` FP16 wgmma (8 k-steps from 0, or -inf for a
  masked score), plus one more k-step of the same wgmma group: Delta_S as an extra K column. An extra [64 keys][16]
  FP16 B tile shared by the CTA holds at key j the BF16 of the Delta_S words the ring stage holds
  (`prefill_staged_layout.ds_words`: columns 0-3, the group's 4 heads, for group 4; columns 0-1 for group 5's one
  head, the 2-head word it lies in), copied at each tile's expansion; an extra [64 rows][16] FP16 A tile per
  warpgroup, written once, holds 2**-7 in a row's head's column (h, + 1 where a one-head CTA's head is its word's
  second half, `prefill_staged_layout.ds_lead`) and 0 elsewhere. The other half of a one-head CTA's word is a
  neighbour head or an unwritten padding entry of the Delta_S row (`cache_layout.delta_s_row`), which may hold
  anything, NaN included: the widening clamps with the non-propagating min / max (``FMNMX``, not ``FMNMX.NAN``),
  so it is finite and its 0 in the one-hot column cancels it (0 x NaN would be NaN in the MMA). The direct build
  (``compensate=False``) has no Delta_S column. The FP16 products are exact; BF16 Delta_S is exact in FP16 for
  |Delta_S| in [2**-14, 65504] (smaller values round to FP16's subnormal grid, an absolute error below 2**-25 on a
  score; larger ones are clamped to 65504, a score that size already decides its row's softmax alone): the
  paper's numerics up to the FP32 summation order.
* Online softmax on the accumulator (exp2, lambda folded), P quantized to e4m3(448 P) with the 448 in the
  exponent (``P_SCALE_LOG2``: the exp2 gives 448 P and the row sums 448 l, one subtraction per row instead of a
  multiply per P; an e4m3 rounding of 448 P within ~4e-7 of a tie can move one step) and widened exactly to FP16:
  the register A operand of the PV wgmma (``m64n128k16``, 4 k-steps; `p_operand`); O in FP32 registers, rescaled
  by alpha before the MMA (skipped by a warp whose rows all keep their maximum: alpha is then exactly 1); O / l in
  BF16 (or FP32) at the end. e4m3 x e4m3 products are exact in FP32, so PV differs from the reference only by
  summation order.

Registers: ``.minnctapersm 2`` bounds ptxas to 128, so 2 CTAs of 8 warps share an SM: 16 warps. Shared memory: 2 Q
tiles, K, V (16 KB each), 2 ring stages and the Delta_S column tiles (2 KB per warpgroup + 2 KB): 96 KB.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.utils import LayoutEnum

from . import prefill_staged_layout as sl
from . import prefill_tile as tile_math
from .prefill_base import HEAD_DIM
from .prefill_wgmma import (HALVES, N_BLOCKS, OPERAND_ALIGN, P_SCALE_LOG2, THREADS, TILE_KEYS, WARPGROUPS,
                            PrefillSm90Wgmma, gemm, softmax_update, tile_row_query, warpgroup_half)
from .ptx import (bits_to_f32, cp_async_commit, cp_async_wait, e4m3x2_to_f16x2, f32x2_to_e4m3x2, load_shared_v4_u32,
                  load_u32)
from .smem_pipeline import load_shared_u16, store_shared_v4_u32
from .warp_mma import k_chunk_regs, q_chunk_regs, quad_sum

STAGES = 2  # ring stages: 96 KB, so 2 CTAs of 2 warpgroups fit an SM
OPERAND_BYTES = TILE_KEYS * HEAD_DIM * 2  # one FP16 operand tile [64][128]
V_UNITS = TILE_KEYS * HEAD_DIM // 16  # 16-byte e4m3 pieces of a V tile (512)
DS_COLUMNS = 16  # the extra k-step: FP16 wgmma's K
EXTRA_BYTES = TILE_KEYS * DS_COLUMNS * 2  # one [64][16] FP16 tile
ONE_HOT = 2.0 ** -7  # Q's extra column: the scale of the scores (S 2**-7)
FP16_MAX = 65504.0


def smem_offsets() -> tuple:
    """(Q tile of warpgroup 0 (warpgroup w's: + w `OPERAND_BYTES`), K tile, V tile, ring) in the CTA's shared
    memory: one Q operand tile per warpgroup, then the K and V operand tiles and the ring, which the warpgroups
    share."""
    k_offset = WARPGROUPS * OPERAND_BYTES
    return 0, k_offset, k_offset + OPERAND_BYTES, k_offset + 2 * OPERAND_BYTES


def k_expand_unit(wg, wg_tid, r: int, warpgroups: int) -> tuple:
    """(32-key half, key within the half, NVFP4 chunk) of the K tile that thread ``wg_tid`` of warpgroup ``wg``
    expands in round ``r``, in the half `warpgroup_half` gives it. Warp w takes keys 8 w .. 8 w + 7, its quarter-warps
    q (8 lanes each) keys 4 (q / 2) .. + 3 of those, two chunks each, chosen so that the 8 lanes of a quarter-warp
    touch 8 different 16-byte bank groups both when they read their chunks (byte 64 key + 16 chunk of the ring
    half) and when they store them (`operand_offset`: 4 FP16 units, swizzled by key & 7): no shared-memory bank
    conflict (`test_expansion_is_bank_conflict_free`)."""
    lane = wg_tid & 31
    quarter, row = lane >> 3, (lane & 7) >> 1
    key = ((wg_tid >> 5) << 3) + ((quarter >> 1) << 2) + row
    chunk = (lane & 1) + ((((row ^ (row >> 1)) ^ quarter) & 1) << 1)
    return warpgroup_half(wg, r, warpgroups), key, chunk


def v_expand_unit(tid, r: int, threads: int) -> tuple:
    """(32-key half, key within the half, 16-byte e4m3 piece) of the V tile that thread ``tid`` of the CTA expands
    in round ``r`` (``0 .. V_UNITS // threads - 1``): round r takes the ``threads / 8`` keys from ``threads / 8 r``
    (one half), warp w 4 of them, each quarter-warp an even key and the next one, 4 pieces of each (pieces 0-3 of
    one, 4-7 of the other): its 8 lanes read 8 different bank groups (the two keys share their `v_swizzle`) and
    store to 8 (the two keys' operand rows differ in the swizzle's low bit): no bank conflict."""
    keys = threads // 8 * r  # the round's first key, a multiple of threads / 8
    lane = tid & 31
    quarter, second = lane >> 3, (lane >> 2) & 1
    key = ((tid >> 5) << 2) + ((quarter >> 1) << 1) + second
    piece = (lane & 3) + ((second ^ (quarter & 1)) << 2)
    return keys // sl.TILE_KEYS, key + keys % sl.TILE_KEYS, piece


def operand_offset(row, chunk):
    """Byte offset in an FP16 operand tile [64 rows][128] of the 16-byte chunk ``chunk`` (elements 8 chunk ..
    8 chunk + 7) of row ``row``: the K-major 128-byte-swizzle layout (`operand_layout`): 64-element column halves of
    64 rows x 128 bytes, chunk XOR row within each 8-row, 1024-byte group."""
    return (chunk >> 3) * (TILE_KEYS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


def operand_layout():
    """CuTe's layout of an FP16 [64][128] wgmma operand tile with the 128 elements contiguous (K-major for Q and K,
    MN-major when read transposed as V^T): Swizzle<3,4,3> o ((8,8),(64,2)):((64,512),(1,4096))."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float16, HEAD_DIM), cutlass.Float16)
    return cute.tile_to_shape(atom, (TILE_KEYS, HEAD_DIM), order=(0, 1))


def extra_layout():
    """CuTe's layout of a [64][16] FP16 wgmma operand tile, the 16 elements contiguous (K-major, 32-byte swizzle)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float16, DS_COLUMNS), cutlass.Float16)
    return cute.tile_to_shape(atom, (TILE_KEYS, DS_COLUMNS), order=(0, 1))


def ds_first_column(heads: int, group: int, first_head):
    """Column of the Delta_S tiles holding the Delta_S of the CTA's first head ``first_head`` (head h of the CTA:
    this + h): the tile's columns are the BF16 of the ring's Delta_S words, from the word holding the CTA's first
    head (`prefill_staged_layout.ds_first_word` of its index in the group), so 1 where a one-head CTA's head is its
    word's second half (an even number of heads starts word-aligned)."""
    return 0 if heads % 2 == 0 else sl.ds_lead(first_head % group) >> 1


def p_operand(probs: list, words: cute.Tensor) -> None:
    """P of the tile (already times 448) -> the PV A operand (``words``: the A fragment as 16 f16x2 words):
    e4m3(P), exactly in FP16. Word ``r + 2 b + 4 k`` of k-step k holds row g + 8 r at keys 16 k + 8 b + 2c, + 1:
    S column block 2 k + b (the wgmma accumulator and A-fragment layouts)."""
    for k in range(N_BLOCKS // 2):
        for b in range(2):
            for r in range(2):
                lo, hi = probs[2 * k + b][2 * r], probs[2 * k + b][2 * r + 1]
                words[r + 2 * b + 4 * k] = e4m3x2_to_f16x2(f32x2_to_e4m3x2(lo, hi))


@cute.jit
def rescale(acc_o: cute.Tensor, alphas: list) -> None:
    """O *= alpha of each register's row, only where some row of the warp has a new maximum (alpha is exactly 1
    otherwise, ``exact_alpha``): walking the keys last to first, most tiles raise no row's maximum."""
    if cute.arch.vote_any_sync((alphas[0] != Float32(1.0)) | (alphas[1] != Float32(1.0))):
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * alphas[(i >> 1) & 1]


class PrefillSm90Exact(PrefillSm90Wgmma):
    """The exact prefill kernel (module docstring) for `prefill_wgmma.PrefillSm90Wgmma`'s shapes."""

    name = "exact"
    qk_dtype = cutlass.Float16  # QK on FP16 ``m64n64k16``
    min_ctas_per_sm = 2  # ``.minnctapersm 2``: ptxas bounds the registers to 128, 2 CTAs of 256 threads per SM
    _unit_offset = staticmethod(operand_offset)
    _k_unit = staticmethod(k_expand_unit)

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True):
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate)
        self.threads = THREADS * WARPGROUPS
        self.offsets = smem_offsets()
        self.smem_bytes = self.offsets[3] + STAGES * self.tile_bytes
        self.ds_columns = 2 * sl.ds_words(self.heads)  # BF16 Delta_S per key in the ring stage
        assert self.ds_columns <= DS_COLUMNS
        # (the warpgroups' one-hot Q tiles, then the CTA's Delta_S K tile), after the ring
        self.extra_offset = -(-self.smem_bytes // OPERAND_ALIGN) * OPERAND_ALIGN
        if self.compensate:
            self.smem_bytes = self.extra_offset + (WARPGROUPS + 1) * EXTRA_BYTES

    def _qk_layout(self):
        return operand_layout()

    @cute.jit
    def _attend(self, q_codes: cute.Tensor, q_scales: cute.Tensor, cache, page_table: cute.Tensor,
                cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, out: cute.Tensor, lam_scaled: Float32):
        """The kernel (``cache``: K codes, K scales, V, Delta_S)."""
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = self._warp_lane()
        c = lane & 3
        g = lane >> 2
        wg, wg_tid, wg_warp = warp >> 2, tid & (THREADS - 1), warp & 3  # (4 warps per warpgroup)
        head, kv_head, cta_heads, batch, q_start, q_len, kv_len, cta_row0 = self._sequence(cu_seqlens_q, seq_lens_k,
                                                                                           warp)
        row0, warp_row0, num_tiles, limits, common = self._warpgroup_plan(cta_row0, wg, wg_warp, q_len, kv_len, g)
        # the CTA walks the tiles its last row sees: those of the later warpgroup
        walk = self._walk(Int32(num_tiles), common, cta_row0, q_len, kv_len, g, TILE_KEYS)

        smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN)
        smem = smem_ptr.toint()
        q_offset, k_offset, v_offset, _ = self.offsets
        q_offset = cute.assume(q_offset + wg * OPERAND_BYTES, divby=OPERAND_BYTES)  # the warpgroup's own Q tile
        mma_qk, s_q, s_k = self._qk_operands(smem_ptr, q_offset, k_offset)
        mma_pv, s_vt = self._pv_operands(smem_ptr, v_offset)
        thr_qk = mma_qk.get_slice(wg_tid)
        thr_pv = mma_pv.get_slice(wg_tid)
        operands = (
            thr_qk.make_fragment_A(thr_qk.partition_A(s_q)),
            thr_qk.make_fragment_B(thr_qk.partition_B(s_k)),
            thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_KEYS))),
            thr_pv.make_fragment_B(thr_pv.partition_B(s_vt)),
            self._ds_column_operands(mma_qk, smem_ptr, wg, wg_tid),  # built once, before the tile loop
        )
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((64, TILE_KEYS)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, HEAD_DIM)), Float32)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = Float32(0.0)
        state = cute.make_rmem_tensor((4,), Float32)  # running max (S * 2**-7) of rows g, g + 8;
        state[0] = -math.inf  # lane-partial sums
        state[1] = -math.inf
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)

        self._expand_q(q_codes, q_scales, q_start, q_len, row0, cta_heads[0], wg_tid, smem + q_offset)
        if cutlass.const_expr(self.compensate):
            self._init_ds_column_tiles(cta_heads[0], wg_tid)
        mmas = (mma_qk, mma_pv, operands, acc_s, acc_o)
        self._run_tiles(walk, mmas, state, lam_scaled, cache, page_table, batch, kv_head,
                        cta_heads, kv_len, limits, (tid, wg, wg_tid, wg_warp), c, smem)
        self._store_rows(state, acc_o, out, q_start, q_len, warp_row0, head, g, c)

    def _pv_operands(self, smem_ptr, v_offset):
        """(PV's tiled MMA, its B operand in shared memory: V^T [dims][keys]): FP16 ``m64n128k16`` with P from
        registers and the V operand tile read transposed (MN-major, dimensions contiguous)."""
        layout = operand_layout()
        s_v = cute.make_tensor(cute.recast_ptr(smem_ptr + v_offset, layout.inner, dtype=cutlass.Float16),
                               layout.outer)
        s_vt = cute.composition(s_v, cute.make_ordered_layout((HEAD_DIM, TILE_KEYS), order=(1, 0)))
        mma_pv = sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K,
                                                   OperandMajorMode.MN, Float32, (1, 1, 1), (64, HEAD_DIM),
                                                   a_source=warpgroup.OperandSource.RMEM)
        return mma_pv, s_vt

    # --- operands in shared memory ---------------------------------------------------------------------------------

    @cute.jit
    def _expand_q_chunk(self, q_tile, row, chunk, words, scales):
        """One 16-byte NVFP4 chunk of Q (its codes ``words``, its two block scales) exactly to FP16 into the Q
        operand tile."""
        self._store_chunk(q_tile, row, chunk, q_chunk_regs(words, scales))

    def _extra_tile(self, smem_ptr, index):
        """Delta_S column tile ``index`` (warpgroup w's one-hot Q tile: w; the Delta_S K tile: ``WARPGROUPS``)."""
        layout = extra_layout()
        offset = self.extra_offset + index * EXTRA_BYTES
        if not isinstance(index, int):
            offset = cute.assume(offset, divby=EXTRA_BYTES)
        return cute.make_tensor(cute.recast_ptr(smem_ptr + offset, layout.inner, dtype=Float16), layout.outer)

    @cute.jit
    def _init_ds_column_tiles(self, first_head, wg_tid):
        """The warpgroup's one-hot tile and, by warpgroup 0, the Delta_S tile's zeros (its columns past
        ``ds_columns`` stay 0; the others are rewritten every tile)."""
        smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN)
        wg = cute.arch.thread_idx()[0] // THREADS
        one_hot = self._extra_tile(smem_ptr, wg)
        lead = ds_first_column(self.heads, self.group, first_head)  # the CTA's first head's column
        for r in cutlass.range_constexpr(TILE_KEYS * DS_COLUMNS // THREADS):
            unit = wg_tid + THREADS * r
            row, column = unit // DS_COLUMNS, unit % DS_COLUMNS
            hot = lead + tile_row_query(row, self.heads)[1]
            one_hot[row, column] = Float16(cutlass.select_(column == hot, Float32(ONE_HOT), Float32(0.0)))
        if wg == 0:
            ds_tile = self._extra_tile(smem_ptr, WARPGROUPS)
            for r in cutlass.range_constexpr(TILE_KEYS * DS_COLUMNS // THREADS):
                unit = wg_tid + THREADS * r
                ds_tile[unit // DS_COLUMNS, unit % DS_COLUMNS] = Float16(0.0)

    def _ds_column_operands(self, mma_qk, smem_ptr, wg, wg_tid):
        """The extra k-step of QK (compensated): ((warpgroup's one-hot tile, the Delta_S tile),), None for the
        direct build. Built once before the tile loop (built in the loop, their descriptors cost ~12 instructions
        on every tile)."""
        if not self.compensate:
            return None
        thr_qk = mma_qk.get_slice(wg_tid)
        return ((thr_qk.make_fragment_A(thr_qk.partition_A(self._extra_tile(smem_ptr, wg))),
                 thr_qk.make_fragment_B(thr_qk.partition_B(self._extra_tile(smem_ptr, WARPGROUPS)))),)

    @cute.jit
    def _expand_kv(self, stage, threads, smem):
        """The 64-key tile in ring stage ``stage`` (two 32-key halves) -> the K and V operand tiles (K chunks by
        `k_expand_unit`, V pieces by `v_expand_unit`, the CTA's threads ``threads`` = (tid, warpgroup, thread and
        warp in the warpgroup) sharing the work), then (compensated) the tile's Delta_S into columns 0 ..
        ``ds_columns`` - 1 of the Delta_S tile. Keys past the sequence end were zero-filled by the copy."""
        self._expand_k_chunks(stage, threads, smem, k_chunk_regs)
        self._expand_v(stage, threads, smem)
        if cutlass.const_expr(self.compensate):
            ds_tile = self._extra_tile(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN), WARPGROUPS)
            units = TILE_KEYS * self.ds_columns
            for r in cutlass.range_constexpr(-(-units // self.threads)):
                unit = threads[0] + self.threads * r
                if cutlass.const_expr(units % self.threads == 0):
                    self._widen_ds(stage, ds_tile, unit)
                else:
                    if unit < units:  # a part-round (one head: 128 values for 256 threads)
                        self._widen_ds(stage, ds_tile, unit)

    @cute.jit
    def _expand_v(self, stage, threads, smem):
        """e4m3 V of the tile exactly to FP16."""
        tid = threads[0]
        v_offset = self.offsets[2]
        for r in cutlass.range_constexpr(V_UNITS // self.threads):
            half, in_half, piece = v_expand_unit(tid, r, self.threads)
            raw = stage + half * self.stage_bytes
            words = load_shared_v4_u32(raw + sl.V_OFFSET + sl.V_ROW_BYTES * in_half
                                       + 16 * (piece ^ sl.v_swizzle(in_half)))
            regs = []
            for word in cutlass.range_constexpr(4):
                regs += [e4m3x2_to_f16x2(words[word]), e4m3x2_to_f16x2(words[word] >> 16)]
            for quad in cutlass.range_constexpr(2):
                store_shared_v4_u32(smem + v_offset + operand_offset(sl.TILE_KEYS * half + in_half, 2 * piece + quad),
                                    *regs[4 * quad:4 * quad + 4])

    @cute.jit
    def _widen_ds(self, stage, ds_tile, unit):
        """Delta_S ``unit`` (key ``unit // ds_columns``, column ``unit % ds_columns``) of the ring stage -> FP16,
        clamped with the non-propagating min / max (a NaN becomes finite; module docstring)."""
        key, column = unit // self.ds_columns, unit % self.ds_columns
        half, in_half = key // sl.TILE_KEYS, key % sl.TILE_KEYS
        # the ring's Delta_S row of a key: its ds_words 4-byte words (`prefill_staged_layout.copy_arrays`)
        bits = load_shared_u16(stage + half * self.stage_bytes + sl.DS_OFFSET + 4 * sl.ds_words(self.heads) * in_half
                               + 2 * column)
        # max(min(x, M), -M) on the non-propagating max alone: min(x, M) = -max(-x, -M)
        below = -cute.arch.fmax(-bits_to_f32(bits << 16), Float32(-FP16_MAX))
        value = cute.arch.fmax(below, Float32(-FP16_MAX))
        ds_tile[key, column] = Float16(value)

    # --- the tile loop: the ring, 64-key tiles ---------------------------------------------------------------------

    @cute.jit
    def _run_tiles(self, walk, mmas, state: cute.Tensor, lam_scaled, cache, page_table: cute.Tensor, batch, kv_head,
                   cta_heads, kv_len, limits, threads, c, smem):
        """The CTA's tiles (``walk``: tiles the CTA walks, leading keys all its rows see, tiles this warpgroup's
        rows see) through the ``STAGES``-deep ring (`prefill_staged_layout.ring_*`, one 64-key tile per stage),
        masked tiles first, then whole ones."""
        cta_tiles, cta_common, num_tiles = walk
        sources = self._cache_sources(cache, kv_head, cta_heads[0] - kv_head * self.group)
        table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
        ring = smem + self.offsets[3]
        page = cute.make_rmem_tensor((1,), Int32)
        for index in cutlass.range_constexpr(STAGES - 1):
            tile_index, stage = sl.ring_prologue(index, cta_tiles)
            if tile_index >= 0:
                self._copy_wgmma_tile(tile_index, Int32(load_u32(self._page_entry(table_row, HALVES * tile_index))),
                                      ring + stage * self.tile_bytes, kv_len, threads, sources, True)
            cp_async_commit()
        self._fetch_page(page, table_row, HALVES * sl.ring_copy(0, cta_tiles, STAGES)[0])
        masked_tiles, full_tiles = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        for step in cutlass.range(masked_tiles, unroll=1):
            self._step(True, step, cta_tiles, num_tiles, page, table_row, ring, kv_len, threads, sources, mmas, state,
                       lam_scaled, limits, c, smem)
        for step in cutlass.range(full_tiles, unroll=1):
            self._step(False, masked_tiles + step, cta_tiles, num_tiles, page, table_row, ring, kv_len, threads,
                       sources, mmas, state, lam_scaled, limits, c, smem)
        cp_async_wait(0)

    @cute.jit
    def _step(self, masked: cutlass.Constexpr, step, cta_tiles, num_tiles, page: cute.Tensor, table_row, ring, kv_len,
              threads, sources, mmas, state: cute.Tensor, lam_scaled, limits, c, smem):
        """Step ``step`` of the CTA's walk: ring bookkeeping and K / V expansion (the CTA), then QK, softmax and PV
        (each warpgroup, `_tile`). Both barriers are the CTA's: the first also keeps the expansion from
        overwriting K / V before every warpgroup has waited for its PV wgmma of the previous step."""
        cp_async_wait(sl.ring_wait(STAGES, False))
        cute.arch.barrier()  # the tile has landed; every thread is done with the previous step (stage, operands)
        copy_index, copy_stage = sl.ring_copy(step, cta_tiles, STAGES)
        if copy_index >= 0:
            self._copy_wgmma_tile(copy_index, page[0], ring + copy_stage * self.tile_bytes, kv_len, threads, sources,
                                  masked)
        cp_async_commit()
        self._fetch_page(page, table_row, HALVES * sl.ring_copy(step + 1, cta_tiles, STAGES)[0])
        tile_index, compute_stage, _ = sl.ring_compute(step, cta_tiles, STAGES)
        stage = ring + compute_stage * self.tile_bytes
        self._expand_kv(stage, threads, smem)
        cute.arch.fence_proxy("async.shared", space="cta")  # the operand stores, visible to wgmma
        cute.arch.barrier()
        if cutlass.const_expr(masked):
            # The CTA walks the later warpgroup's tiles: the first one (the last tile) may lie past every row of
            # the earlier warpgroup, which then skips it (warpgroup-uniform; bit-identical to masking it whole).
            # Whole tiles are seen by every row of the CTA.
            if tile_index < num_tiles:
                self._tile(masked, tile_index * TILE_KEYS, mmas, state, lam_scaled, limits, c)
        else:
            self._tile(masked, tile_index * TILE_KEYS, mmas, state, lam_scaled, limits, c)

    @cute.jit
    def _tile(self, masked: cutlass.Constexpr, tile, mmas, state: cute.Tensor, lam_scaled, limits, c):
        """One warpgroup on the tile of keys ``tile`` .. + 63 (K / V operand tiles filled): S = Delta_S + Q K^T
        (-inf where masked), online softmax, O = alpha O + e4m3(448 P) V, both wgmmas waited for."""
        scores = self._qk_scores(masked, tile, mmas, limits, c)
        probs, alphas = softmax_update(scores, state, lam_scaled, P_SCALE_LOG2)
        self._pv(mmas, probs, alphas)

    @cute.jit
    def _pv(self, mmas, probs: list, alphas: list):
        """O = alpha O + e4m3(448 P) V: O rescaled in place (skipped where alpha is 1), then the PV wgmma
        accumulating onto O, waited for."""
        mma_pv, operands, acc_o = mmas[1], mmas[2], mmas[4]
        rescale(acc_o, alphas)
        p_operand(probs, cute.recast_tensor(operands[2], Uint32))
        gemm(mma_pv, acc_o, operands[2], operands[3])

    def _qk_scores(self, masked: bool, tile, mmas, limits, c) -> list:
        """S * 2**-7 = Q K^T * 2**-7 + Delta_S * 2**-7 (the extra k-step; -inf where masked) on the QK wgmma -> the
        thread's scores [column block][4] (rows g, g + 8 x keys 8 j + 2c, + 1)."""
        mma_qk, acc_s = mmas[0], mmas[3]
        t_q, t_k = mmas[2][0], mmas[2][1]
        seen = (limits[0] - tile - 2 * c, limits[1] - tile - 2 * c) if masked else None
        for block in range(N_BLOCKS):
            init = tile_math.score_init(None, seen, block)
            for i in range(4):
                acc_s[4 * block + i] = init[i]
        gemm(mma_qk, acc_s, t_q, t_k, extra=mmas[2][4])
        return [[acc_s[4 * block + i] for i in range(4)] for block in range(N_BLOCKS)]

    def _row_sum(self, state: cute.Tensor, acc_o: cute.Tensor, r: int):
        """Row g + 8 r's softmax denominator: the quad's sum of the lanes' partial sums in ``state``."""
        return quad_sum(state[2 + r])
