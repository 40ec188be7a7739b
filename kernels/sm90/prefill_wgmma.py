"""MpFA prefill v3: both GEMMs on warpgroup MMA (wgmma), v1's numerics (the default for GQA group 4, pages >= 64).

v1 / v2 (`prefill`, `prefill_staged`) are latency-bound chains of per-warp ``mma.sync`` with a CTA barrier per
32-key tile (profiles/NOTES.md, "Prefill v2.1"). v3 keeps v2's CTA (the 4 query heads of one GQA group x 16 rows),
its cp.async ring and its order, and replaces the tile's arithmetic with two wgmma GEMMs of one warpgroup:

* CTA = one warpgroup (128 threads) = a 64-row wgmma tile: M row ``16 h + i`` is query head ``first_head + h``,
  query row ``row0 + i``. Warp h then owns head h's 16 rows and thread (g, c) of it the rows g and g + 8, exactly
  v1's per-warp rows, so v1's online softmax (`prefill_tile.online_softmax`) runs unchanged on the accumulator.
* 64-key tiles (``TILE_KEYS``), walked last to first; the first the masked tiles (past the diagonal of a row or the
  sequence end), then the whole ones, as v1. A ring stage holds a 64-key tile as two of v2's 32-key stages
  (`prefill_staged_layout`; v2's `_copy_tile` fills them), so pages must hold 64 keys.
* Per tile the warpgroup expands the tile's NVFP4 K exactly to FP16 (K * 2**-7, `warp_mma.k_chunk_regs`) and its
  e4m3 V exactly to FP16 into two shared-memory operand tiles, both [64 keys][128 dims] in the 128-byte-swizzled
  K-major layout of wgmma (`operand_offset`): K is QK's B operand (K-major) and the same layout read transposed
  is PV's B operand V^T with the dimensions contiguous (MN-major, allowed for 16-bit wgmma): no transpose.
  Q is expanded once, the same way (`warp_mma.q_chunk_regs`: the same element order within each 32-element
  chunk as K, so the dot products pair the right elements), into a third tile: QK's A operand.
* S * 2**-7 = Q K^T * 2**-7 on ``m64n64k16`` FP16 wgmma (8 k-steps) with the accumulator initialised to
  Delta_S * 2**-7, or -inf for a masked score (`prefill_tile.score_init`): the compensation enters through the MMA
  as in v1 (the direct build, ``compensate=False``, copies no Delta_S and starts at 0). The FP16 products are
  exact; only the FP32 summation order differs from v1's mma.sync chain.
* Online softmax on the accumulator (exp2, lambda folded, as v1), P quantized to e4m3(448 P) as v1 and widened
  exactly to FP16: the register A operand of the PV wgmma (``m64n128k16``, 4 k-steps; `p_operand`); O in FP32
  registers, rescaled by alpha before the MMA (skipped by a warp whose rows all keep their maximum: alpha is then
  exactly 1); O / (448 l) in BF16 (or FP32) at the end, as v1. e4m3 x e4m3 products are exact in FP32, so PV
  differs from v1's only by summation order. Since session 19 the 448 rides in the exponent (``p_scale_log2``:
  the exp2 gives 448 P and the row sums 448 l, one subtraction per row instead of a multiply per P; v3w8c's tile
  loop 659 -> 631 SASS instructions), which moves an e4m3 rounding of 448 P only where it sits within ~4e-7 of a
  tie.
* Synchronisation per tile: wait for the tile's copies + barrier, issue the copies of a later tile, expand K / V,
  ``fence.proxy.async`` (generic-proxy stores must be visible to wgmma) + barrier, QK, softmax, PV (each wgmma
  waited for before the next barrier, so the next expansion may overwrite the operand tiles).

v3w8 (``warpgroups=2``): the same kernel with two warpgroups (256 threads) per CTA. Warpgroup w computes the 64
wgmma rows "4 heads x 16 rows" of query rows ``row0 + 16 w + i`` (v3's rows, 16 w rows on), from its own Q tile; the
K / V operand tiles and the ring are shared. The warpgroups split each tile's ring copies and its K / V expansion:
warpgroup w copies the 32-key half w of the tile with v2's 4-warp copy plan (`warpgroup_half`) and expands the K of
that half (`k_expand_unit`), and each thread expands half as many V pieces as in v3 (`v_expand_unit`); per query row
the copies and the expansion are done half as often. The barriers are the CTA's (``bar.sync`` of 256 threads); each
warpgroup waits for its own wgmmas before it arrives at the next barrier, after which the expansion may overwrite
the K and V tiles. The CTA walks the tiles its last row sees and splits masked / whole tiles on the keys its first
row sees (v2w8's walk, `_walk`); each warpgroup masks with its own rows' limits and skips the masked tiles none of
its rows sees (only the earlier warpgroup, only at the start of the walk). Each warpgroup thus runs v3's arithmetic
on v3's tiles in v3's order (a tile masked here that v3 runs whole has every score visible: the same initial
scores), so the output is v3's bit for bit. v3w8 runs 16 warps per SM, what made v4w8 1.4x v3: a 2-stage ring
(2 Q tiles + K + V + 2 stages = 90 KB) and ``.minnctapersm 2`` (`min_ctas_per_sm`: ptxas bounds the registers to
128; unbounded it gives 129) let 2 CTAs of 8 warps share an SM; with 4 stages (116 KB) it held 1.

Other GQA groups (session 19): the warpgroup's 64 rows are v2's 4-warp CTA (`prefill_staged_layout.cta_shape`,
`tile_row_query`): group 5 (40:8) -> one head x 64 rows, warp w rows 16 w .. + 15, each warp masking with its own
rows' limits; the walk and the warpgroup-uniform skips follow the warpgroup's 64 rows. The launcher takes groups 4
and 5 (`prefill_launch.WGMMA_GROUPS`); both pass the GPU tests. Shared memory (v3): Q, K, V operand tiles (16 KB
each) and a 4-stage ring of 13 KB stages: 100 KB per CTA, 2 CTAs per SM.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.utils import LayoutEnum

from mpfa.kernels.sm90 import prefill_grid
from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90 import prefill_tile as tile_math
from mpfa.kernels.sm90.prefill_staged import PrefillSm90Staged
from mpfa.kernels.sm90.ptx import (
    cp_async_commit,
    cp_async_wait,
    e4m3x2_to_f16x2,
    f32x2_to_bf16x2,
    f32x2_to_e4m3x2,
    load_shared_v4_u32,
    load_u16,
    load_u32,
    load_v4_u32,
    store_u32,
    store_v2_f32,
)
from mpfa.kernels.sm90.smem_pipeline import load_shared_u16, store_shared_v4_u32
from mpfa.kernels.sm90.warp_mma import k_chunk_regs, p_pair, q_chunk_regs, quad_sum, P_SCALE

HEAD_DIM = sl.HEAD_DIM
TILE_KEYS = 64  # keys per wgmma tile: two of v2's 32-key ring stages
HALVES = TILE_KEYS // sl.TILE_KEYS
N_BLOCKS = TILE_KEYS // 8  # 8-key column blocks of the S accumulator (v1's n-tiles)
GROUP = 4  # heads of a 64-row warpgroup tile "4 heads x 16 rows" (the FP8 and v6 kernels' only shape)
ROWS = sl.WARP_ROWS  # query rows per warpgroup (per head)
THREADS = 128  # one warpgroup
WARPGROUPS = (1, 2)  # warpgroups per CTA: v3, v3w8
STAGES = 4  # ring stages of v3 (one warpgroup per CTA)
W8_STAGES = 2  # of v3w8: 90 KB, so 2 CTAs of 2 warpgroups fit an SM
OPERAND_BYTES = TILE_KEYS * HEAD_DIM * 2  # one FP16 operand tile [64][128]
OPERAND_ALIGN = 1024  # the 128-byte swizzle repeats every 8 rows of 128 bytes
CHUNK_ELEMS = 32  # elements of a 16-byte NVFP4 chunk (2 blocks): the unit of Q / K expansion
V_UNITS = TILE_KEYS * HEAD_DIM // 16  # 16-byte e4m3 pieces of a V tile (512)


def smem_offsets(warpgroups: int, qk_bytes: int = OPERAND_BYTES, v_bytes: int = OPERAND_BYTES) -> tuple:
    """(Q tile of warpgroup 0 (warpgroup w's: + w ``qk_bytes``), K tile, V tile, ring) in the CTA's shared
    memory: one Q operand tile per warpgroup, then the K and V operand tiles and the ring, which the warpgroups
    share. ``qk_bytes`` / ``v_bytes``: the bytes of a Q / K and of the V operand tile (FP16: `OPERAND_BYTES`;
    v4's e4m3 Q / K and v5's e4m3 V^T: half)."""
    k_offset = warpgroups * qk_bytes
    return 0, k_offset, k_offset + qk_bytes, k_offset + qk_bytes + v_bytes


def warpgroup_half(wg, r: int, warpgroups: int):
    """The 32-key half of a 64-key tile that warpgroup ``wg`` copies into the ring (v2's 4-warp copy plan) and
    whose K it expands, in round ``r`` (``0 .. 2 // warpgroups - 1``): the halves h with h % warpgroups == wg
    (one warpgroup: both; two: half w for warpgroup w)."""
    return wg + warpgroups * r


def k_expand_unit(wg, wg_tid, r: int, warpgroups: int) -> tuple:
    """(32-key half, key within the half, NVFP4 chunk) of the K tile that thread ``wg_tid`` of warpgroup ``wg``
    expands in round ``r``, in the half `warpgroup_half` gives it. Warp w takes keys 8 w .. 8 w + 7, its quarter-warps
    q (8 lanes each) keys 4 (q / 2) .. + 3 of those, two chunks each, chosen so that the 8 lanes of a quarter-warp
    touch 8 different 16-byte bank groups both when they read their chunks (byte 64 key + 16 chunk of the ring
    half) and when they store them (`operand_offset`: 4 FP16 units; v4's `fp8_operand_offset`: 2 e4m3 units; both
    swizzled by key & 7): no shared-memory bank conflict (`test_expansion_is_bank_conflict_free`)."""
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


def tile_row_query(row, heads: int) -> tuple:
    """(query row from the warpgroup's first, head of the CTA) of row ``row`` of a 64-row wgmma tile: warp
    ``row // 16`` is head ``warp % heads``, rows ``16 (warp // heads)`` .. + 15 (`prefill_staged.PrefillSm90Staged`'s
    warps; 4 heads: row 16 h + i is head h, query i; 1 head: row i is query i)."""
    warp = row >> 4
    return ((warp // heads) << 4) + (row & (ROWS - 1)), warp % heads


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


def p_operand(probs: list, words: cute.Tensor, scale: float = P_SCALE) -> None:
    """P of the tile -> the PV A operand (``words``: the A fragment as 16 f16x2 words): e4m3(``scale`` P), exactly
    in FP16 (``scale`` 1: P already carries the 448, `p_operand_prescaled`). Word ``v1 + 2 v2 + 4 k`` of k-step k
    holds row g + 8 v1 at keys 16 k + 8 v2 + 2c, + 1: S column block 2 k + v2 (the wgmma accumulator and
    A-fragment layouts)."""
    for k in range(N_BLOCKS // 2):
        for v2 in range(2):
            for v1 in range(2):
                lo, hi = probs[2 * k + v2][2 * v1], probs[2 * k + v2][2 * v1 + 1]
                pair = p_pair(lo, hi) if scale == P_SCALE else f32x2_to_e4m3x2(lo, hi)
                words[v1 + 2 * v2 + 4 * k] = e4m3x2_to_f16x2(pair)


def p_operand_prescaled(probs: list, words: cute.Tensor) -> None:
    """`p_operand` of a P that already carries the 448 (the softmax's ``p_scale_log2``): no multiply."""
    p_operand(probs, words, scale=1.0)


class PrefillSm90Wgmma(PrefillSm90Staged):
    """Compile-time shape of the v3 prefill: `prefill.PrefillSm90`'s arguments (no ablations; ``compensate``
    False: the direct build) and ``warpgroups`` per CTA (1: v3, 2: v3w8; warpgroup w computes the CTA's query rows
    ``wg_rows`` w .. + ``wg_rows`` - 1 of each of its heads: 16 rows of 4 heads for group 4, 64 of 1 for group 5).
    v2's launch, CTA order, heads and ring copies; the kernel body is replaced."""

    tile_keys = TILE_KEYS  # the CTA's walk (`_walk`) in 64-key tiles
    qk_dtype = cutlass.Float16  # QK's operand type (`_qk_operands`)
    _unit_offset = staticmethod(operand_offset)  # 16-byte unit of a Q / K operand tile row (`_store_chunk`)
    _k_unit = staticmethod(k_expand_unit)  # the K chunks a thread expands
    _p_operand = staticmethod(p_operand_prescaled)  # P -> the PV wgmma's register A fragment
    qk_bytes = OPERAND_BYTES  # one Q / K operand tile
    v_bytes = OPERAND_BYTES  # the V operand tile
    state_size = 4  # per-thread softmax state: running max of rows g, g + 8, lane-partial sums
    w8_stages = W8_STAGES  # ring stages with 2 warpgroups per CTA
    w8_min_ctas = 2  # ``.minnctapersm`` with 2 warpgroups per CTA (0: ptxas unbounded)
    any_group = True  # any GQA group (`prefill_staged_layout.cta_shape`); False: 4 heads x 16 rows only
    # e4m3(448 P)'s 448 folded into the exponent (session 19): P' = 2**(lam S - (lam m - log2 448)) = 448 P from the
    # same exp2, one subtraction per row instead of a multiply per P; l' = 448 l, O / l' at the end. log2(448) in
    # FP32 makes P' = 448.00016 P, which O = sum P' V / sum P' cancels; an e4m3 rounding of P' within ~4e-7 of a
    # tie can come out one step apart from e4m3(448 P)'s.
    p_scale_log2 = math.log2(P_SCALE)  # the softmax's P and l times 2**this
    l_scale = 1.0  # the output's O / (l_scale l): the factor P carries that l does not

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True, warpgroups: int = 1):
        if page_size < TILE_KEYS:
            raise ValueError(f"the v3 (wgmma) prefill needs page_size >= {TILE_KEYS}, got {page_size}")
        if warpgroups not in WARPGROUPS:
            raise ValueError(f"warpgroups per CTA must be one of {WARPGROUPS}, got {warpgroups}")
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, warps=4,
                         stages=self.w8_stages if warpgroups == 2 else STAGES,
                         shared_dequant=False, compensate=compensate)
        if self.heads != GROUP and not self.any_group:
            raise ValueError(f"{type(self).__name__} supports GQA group {GROUP} only (4 heads x 16 rows = one 64-row "
                             f"warpgroup tile), got {group}")
        self.warpgroups = warpgroups
        self.wg_rows = sl.warpgroup_rows(group)  # a warpgroup's query rows of each of its heads
        assert self.wg_rows == ROWS * self.row_blocks
        self.row_blocks *= warpgroups
        self.block_m = ROWS * self.row_blocks
        self.threads = THREADS * warpgroups
        self.tile_bytes = HALVES * self.stage_bytes  # one 64-key ring stage
        self.offsets = smem_offsets(warpgroups, self.qk_bytes, self.v_bytes)
        self.smem_bytes = self.offsets[3] + self.stages * self.tile_bytes

    @property
    def min_ctas_per_sm(self) -> int:
        """CTAs per SM ptxas bounds the registers for: ``w8_min_ctas`` with 2 warpgroups per CTA (one warpgroup
        fits 2 CTAs by shared memory whatever its registers)."""
        return self.w8_min_ctas if self.warpgroups == 2 else 0

    @cute.kernel
    def kernel(
        self,
        q_codes: cute.Tensor,
        q_scales: cute.Tensor,
        k_codes: cute.Tensor,
        k_scales: cute.Tensor,
        v: cute.Tensor,
        delta_s: cute.Tensor,
        page_table: cute.Tensor,
        cu_seqlens_q: cute.Tensor,
        seq_lens_k: cute.Tensor,
        out: cute.Tensor,
        lam_scaled: Float32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = self._warp_lane(tid)
        c = lane & 3
        g = lane >> 2
        wg, wg_tid, wg_warp = self._warpgroup(tid, warp)
        block_head, m_block, batch = prefill_grid.cta(self.cta_order, cute.arch.block_idx(), cute.arch.grid_dim())
        head, kv_head, cta_heads = self._heads(block_head, warp)
        q_start = cu_seqlens_q[batch]
        q_len = cu_seqlens_q[batch + 1] - q_start
        kv_len = seq_lens_k[batch]
        cta_row0 = m_block * self.block_m
        row0, warp_row0, num_tiles, limits, common = self._warpgroup_plan(cta_row0, wg, wg_warp, q_len, kv_len, g)
        # the CTA walks the tiles its last row sees (v2w8's walk): with 2 warpgroups, the tiles of the later one
        walk = self._walk(Int32(num_tiles), common, cta_row0, q_len, kv_len, g)

        smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN)
        smem = smem_ptr.toint()
        q_offset, k_offset, v_offset, _ = self.offsets
        if cutlass.const_expr(self.warpgroups > 1):  # the warpgroup's own Q tile
            q_offset = cute.assume(q_offset + wg * self.qk_bytes, divby=self.qk_bytes)
        mma_qk, s_q, s_k = self._qk_operands(smem_ptr, q_offset, k_offset)
        mma_pv, s_vts = self._pv_operands(smem_ptr, v_offset)
        thr_qk = mma_qk.get_slice(wg_tid)
        thr_pv = mma_pv.get_slice(wg_tid)
        operands = (
            thr_qk.make_fragment_A(thr_qk.partition_A(s_q)),
            thr_qk.make_fragment_B(thr_qk.partition_B(s_k)),
            thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_KEYS))),
            tuple(thr_pv.make_fragment_B(thr_pv.partition_B(s_vt)) for s_vt in s_vts),
            self._qk_extra_operands(mma_qk, smem_ptr, wg, wg_tid),  # built once, before the tile loop
        )
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((64, TILE_KEYS)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, HEAD_DIM)), Float32)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = Float32(0.0)
        state = cute.make_rmem_tensor((self.state_size,), Float32)  # running max (S * 2**-7) of rows g, g + 8;
        state[0] = -math.inf  # lane-partial sums (v4: + the requantization exponents)
        state[1] = -math.inf
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)
        self._row_exponents(state, q_scales, q_start, q_len, warp_row0, head, g)

        self._expand_q(q_codes, q_scales, q_start, q_len, row0, cta_heads[0], wg_tid, smem + q_offset)
        mmas = (mma_qk, mma_pv, operands, acc_s, acc_o)
        self._run_wgmma_tiles(walk, mmas, state, lam_scaled, (k_codes, k_scales, v, delta_s), page_table, batch,
                              kv_head, cta_heads, kv_len, limits, (tid, wg, wg_tid, wg_warp), c, smem)
        self._store_rows(state, acc_o, out, q_start, q_len, warp_row0, head, g, c)

    def _warpgroup_plan(self, cta_row0, wg, wg_warp, q_len, kv_len, g) -> tuple:
        """(the warpgroup's first row (of each of its heads), the warp's first row, the tiles the warpgroup's rows
        see, (last key row g sees, row g + 8's) of the warp's rows, leading keys all the warpgroup's rows see):
        with fewer heads than warps (group 5: one head x 64 rows) each warp masks with its own 16 rows' limits."""
        row0 = cta_row0 + self.wg_rows * wg
        num_tiles, limits, common = tile_math.warp_plan(row0, q_len, kv_len, g, causal=self.causal,
                                                        tile_keys=TILE_KEYS, warp_rows=self.wg_rows)
        warp_row0 = row0
        if self.wg_rows > ROWS:
            warp_row0 = row0 + self._warp_row(wg_warp)
            _, limits, _ = tile_math.warp_plan(warp_row0, q_len, kv_len, g, causal=self.causal, tile_keys=TILE_KEYS,
                                               warp_rows=ROWS)
        return row0, warp_row0, num_tiles, limits, common

    def _qk_operands(self, smem_ptr, q_offset, k_offset):
        """(QK's tiled MMA, Q and K operand tiles in shared memory) in ``qk_dtype`` (v3: FP16 ``m64n64k16`` in
        `operand_layout`), K-major both."""
        layout = self._qk_layout()
        s_q, s_k = [cute.make_tensor(cute.recast_ptr(smem_ptr + offset, layout.inner, dtype=self.qk_dtype),
                                     layout.outer) for offset in (q_offset, k_offset)]
        mma_qk = sm90_utils.make_trivial_tiled_mma(self.qk_dtype, self.qk_dtype, OperandMajorMode.K,
                                                   OperandMajorMode.K, Float32, (1, 1, 1), (64, TILE_KEYS))
        return mma_qk, s_q, s_k

    def _qk_layout(self):
        return operand_layout()

    def _pv_operands(self, smem_ptr, v_offset):
        """(PV's tiled MMA, its B operands in shared memory: V^T [dims][keys], one tensor per MMA N tile): v3's FP16
        ``m64n128k16`` with P from registers and the V operand tile read transposed (MN-major, dimensions
        contiguous)."""
        layout = operand_layout()
        s_v = cute.make_tensor(cute.recast_ptr(smem_ptr + v_offset, layout.inner, dtype=cutlass.Float16),
                               layout.outer)
        s_vt = cute.composition(s_v, cute.make_ordered_layout((HEAD_DIM, TILE_KEYS), order=(1, 0)))
        mma_pv = sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K,
                                                   OperandMajorMode.MN, Float32, (1, 1, 1), (64, HEAD_DIM),
                                                   a_source=warpgroup.OperandSource.RMEM)
        return mma_pv, (s_vt,)

    @property
    def fill_warpgroups(self) -> int:
        """Warpgroups that share a tile's ring copies and K / V expansion (`_copy_wgmma_tile`, `_expand_kv`): all
        of the CTA's here; v6's one producer warpgroup."""
        return self.warpgroups

    @property
    def fill_threads(self) -> int:
        """Threads that share a tile's V expansion (`_expand_v`): the CTA's here; v6's producer warpgroup."""
        return self.threads

    def _row_exponents(self, state, q_scales, q_start, q_len, row0, head, g):
        """v4's per-row Q requantization exponents into ``state``; v3 has none."""

    def _warpgroup(self, tid, warp):
        """(warpgroup of the CTA, thread and warp index within it): (0, tid, warp) with one warpgroup."""
        if self.warpgroups == 1:
            return 0, tid, warp
        return warp >> 2, tid & (THREADS - 1), warp & 3  # 4 warps per warpgroup

    # --- operands in shared memory ---------------------------------------------------------------------------------

    @cute.jit
    def _expand_q(self, q_codes: cute.Tensor, q_scales: cute.Tensor, q_start, q_len, row0, first_head, wg_tid,
                  q_tile):
        """Q of the warpgroup's 64 rows exactly to FP16 in its Q operand tile ``q_tile``: thread ``wg_tid`` of the
        warpgroup expands the 16-byte chunks ``wg_tid`` and ``wg_tid + 128`` (row ``unit >> 2``, chunk
        ``unit & 3``; `tile_row_query`); rows past the sequence are zeros."""
        for r in cutlass.range_constexpr(2):
            unit = wg_tid + THREADS * r
            row, chunk = unit >> 2, unit & 3
            query, head = tile_row_query(row, self.heads)
            valid = Uint32(row0 + query < q_len)
            q_row = Int64(q_start + row0 + query) * self.num_q_heads + first_head + head
            words = load_v4_u32(q_codes.iterator.toint() + q_row * sl.K_ROW_BYTES + 16 * chunk, valid)
            scales = load_u16(q_scales.iterator.toint() + q_row * sl.SCALE_ROW_BYTES + 2 * chunk, valid, Uint32(0))
            self._expand_q_chunk(q_tile, row, chunk, words, scales)

    @cute.jit
    def _expand_q_chunk(self, q_tile, row, chunk, words, scales):
        """One 16-byte NVFP4 chunk of Q (its codes ``words``, its two block scales) into the Q operand tile."""
        self._store_chunk(q_tile, row, chunk, q_chunk_regs(words, scales))

    @cute.jit
    def _store_chunk(self, tile, row, chunk, words: list):
        """The words of NVFP4 chunk ``chunk`` expanded (32 elements: 16 f16x2 here, v4's 8 e4m3x4) -> their 16-byte
        units of ``row`` of an operand tile (`_unit_offset`)."""
        units = len(words) // 4
        for unit in cutlass.range_constexpr(units):
            store_shared_v4_u32(tile + self._unit_offset(row, units * chunk + unit), *words[4 * unit:4 * unit + 4])

    @cute.jit
    def _expand_kv(self, stage, threads, smem, state: cute.Tensor):
        """The 64-key tile in ring stage ``stage`` (two 32-key halves) -> the K and V operand tiles, the CTA's
        threads ``threads`` = (tid, warpgroup, thread and warp in the warpgroup) sharing the work: K chunks by
        `k_expand_unit`, V pieces by `v_expand_unit`. Keys past the sequence end were zero-filled by the copy."""
        self._expand_k(stage, threads, smem, state)
        self._expand_v(stage, threads, smem)

    @cute.jit
    def _expand_k(self, stage, threads, smem, state: cute.Tensor):
        """K of the tile exactly to FP16 (K * 2**-7, `k_chunk_regs`)."""
        self._expand_k_chunks(stage, threads, smem, k_chunk_regs)

    @cute.jit
    def _expand_k_chunks(self, stage, threads, smem, convert):
        """The thread's K chunks of the tile (`_k_unit`: its 16 bytes of codes and its two block scales in the ring
        stage) through ``convert(words, scales)`` into the K operand tile."""
        _, wg, wg_tid, _ = threads
        for r in cutlass.range_constexpr(HALVES // self.fill_warpgroups):
            half, key, chunk = self._k_unit(wg, wg_tid, r, self.fill_warpgroups)
            raw = stage + half * self.stage_bytes
            words = load_shared_v4_u32(raw + sl.K_OFFSET + sl.K_ROW_BYTES * key + 16 * chunk)
            scales = load_shared_u16(raw + sl.SCALE_OFFSET + sl.SCALE_ROW_BYTES * key + 2 * chunk)
            self._store_chunk(smem + self.offsets[1], sl.TILE_KEYS * half + key, chunk, convert(words, scales))

    @cute.jit
    def _expand_v(self, stage, threads, smem):
        """e4m3 V of the tile exactly to FP16."""
        tid = threads[0]
        v_offset = self.offsets[2]
        for r in cutlass.range_constexpr(V_UNITS // self.fill_threads):
            half, in_half, piece = v_expand_unit(tid, r, self.fill_threads)
            raw = stage + half * self.stage_bytes
            words = load_shared_v4_u32(raw + sl.V_OFFSET + sl.V_ROW_BYTES * in_half
                                       + 16 * (piece ^ sl.v_swizzle(in_half)))
            regs = []
            for word in cutlass.range_constexpr(4):
                regs += [e4m3x2_to_f16x2(words[word]), e4m3x2_to_f16x2(words[word] >> 16)]
            for quad in cutlass.range_constexpr(2):
                store_shared_v4_u32(smem + v_offset + operand_offset(sl.TILE_KEYS * half + in_half, 2 * piece + quad),
                                    *regs[4 * quad:4 * quad + 4])

    # --- the tile loop: v2's ring, 64-key tiles -------------------------------------------------------------------

    @cute.jit
    def _run_wgmma_tiles(self, walk, mmas, state: cute.Tensor, lam_scaled, cache, page_table: cute.Tensor, batch,
                         kv_head, cta_heads, kv_len, limits, threads, c, smem):
        """The CTA's tiles (``walk``: tiles the CTA walks, leading keys all its rows see, tiles this warpgroup's
        rows see) through the ``stages``-deep ring (`prefill_staged_layout.ring_*`, one 64-key tile per stage),
        masked tiles first, then whole ones (as v1)."""
        cta_tiles, cta_common, num_tiles = walk
        k_codes, k_scales, v, delta_s = cache
        first_head, head_in_cta = cta_heads
        group_first = first_head - kv_head * self.group
        head_slot = kv_head * k_scales.shape[1]
        sources = (
            (k_codes.iterator.toint() + kv_head * sl.K_ROW_BYTES, 0),
            (v.iterator.toint() + kv_head * HEAD_DIM, 0),
            (k_scales.iterator.toint(), head_slot),
            (delta_s.iterator.toint() + 4 * sl.ds_first_word(group_first), head_slot),
        )
        ds_lane = sl.ds_lane_base(self.heads, group_first, head_in_cta, c)
        table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
        ring = smem + self.offsets[3]
        page = cute.make_rmem_tensor((1,), Int32)
        for index in cutlass.range_constexpr(self.stages - 1):
            tile_index, stage = sl.ring_prologue(index, cta_tiles)
            if tile_index >= 0:
                self._copy_wgmma_tile(tile_index, Int32(load_u32(self._page_entry(table_row, HALVES * tile_index))),
                                      ring + stage * self.tile_bytes, kv_len, threads, sources, True)
            cp_async_commit()
        self._fetch_page(page, table_row, HALVES * sl.ring_copy(0, cta_tiles, self.stages)[0])
        masked_tiles, full_tiles = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        for step in cutlass.range(masked_tiles, unroll=1):
            self._wgmma_step(True, step, cta_tiles, num_tiles, page, table_row, ring, kv_len, threads, sources,
                             mmas, state, lam_scaled, ds_lane, limits, c, smem)
        for step in cutlass.range(full_tiles, unroll=1):
            self._wgmma_step(False, masked_tiles + step, cta_tiles, num_tiles, page, table_row, ring, kv_len,
                             threads, sources, mmas, state, lam_scaled, ds_lane, limits, c, smem)
        cp_async_wait(0)

    @cute.jit
    def _copy_wgmma_tile(self, tile_index, page, stage, kv_len, threads, sources, ragged: cutlass.Constexpr):
        """cp.async 64-key tile ``tile_index`` as two of v2's 32-key tiles (one page holds both), each by one
        warpgroup with v2's 4-warp copy plan (`prefill_staged_layout.copy_plan`): the halves `warpgroup_half`
        gives it (v3w8: half w, so a thread computes the cache addresses of one half only)."""
        _, wg, wg_tid, wg_warp = threads
        for r in cutlass.range_constexpr(HALVES // self.fill_warpgroups):
            half = warpgroup_half(wg, r, self.fill_warpgroups)
            self._copy_tile(HALVES * tile_index + half, page, stage + half * self.stage_bytes, kv_len, wg_tid, wg_warp,
                            sources, ragged, THREADS)

    @cute.jit
    def _wgmma_step(self, masked: cutlass.Constexpr, step, cta_tiles, num_tiles, page: cute.Tensor, table_row, ring,
                    kv_len, threads, sources, mmas, state: cute.Tensor, lam_scaled, ds_lane, limits, c, smem):
        """Step ``step`` of the CTA's walk: ring bookkeeping and K / V expansion (the CTA), then QK, softmax and PV
        (each warpgroup, `_wgmma_tile`). Both barriers are the CTA's: the first also keeps the expansion from
        overwriting K / V before every warpgroup has waited for its PV wgmma of the previous step."""
        cp_async_wait(sl.ring_wait(self.stages, False))
        cute.arch.barrier()  # the tile has landed; every thread is done with the previous step (stage, operands)
        copy_index, copy_stage = sl.ring_copy(step, cta_tiles, self.stages)
        if copy_index >= 0:
            self._copy_wgmma_tile(copy_index, page[0], ring + copy_stage * self.tile_bytes, kv_len, threads, sources,
                                  masked)
        cp_async_commit()
        self._fetch_page(page, table_row, HALVES * sl.ring_copy(step + 1, cta_tiles, self.stages)[0])
        tile_index, compute_stage, _ = sl.ring_compute(step, cta_tiles, self.stages)
        stage = ring + compute_stage * self.tile_bytes
        self._expand_kv(stage, threads, smem, state)
        cute.arch.fence_proxy("async.shared", space="cta")  # the operand stores, visible to wgmma
        cute.arch.barrier()
        if cutlass.const_expr(masked and self.warpgroups > 1):
            # The CTA walks the later warpgroup's tiles: the first one (the last tile) may lie past every row of
            # the earlier warpgroup, which then skips it (warpgroup-uniform; bit-identical to masking it whole, as
            # v1 / v2w8 skip). Whole tiles are seen by every row of the CTA.
            if tile_index < num_tiles:
                self._wgmma_tile(masked, tile_index * TILE_KEYS, stage, mmas, state, lam_scaled, ds_lane, limits, c)
        else:
            self._wgmma_tile(masked, tile_index * TILE_KEYS, stage, mmas, state, lam_scaled, ds_lane, limits, c)

    @cute.jit
    def _wgmma_tile(self, masked: cutlass.Constexpr, tile, stage, mmas, state: cute.Tensor, lam_scaled, ds_lane,
                    limits, c):
        """One warpgroup on the tile of keys ``tile`` .. + 63 (K / V operand tiles filled, Delta_S in ring stage
        ``stage``): S = Delta_S + Q K^T (-inf where masked), online softmax, O = alpha O + e4m3(448 P) V, both
        wgmmas waited for."""
        scores = self._qk_scores(masked, tile, stage, mmas, state, ds_lane, limits, c)
        probs, alphas = softmax_update(scores, state, lam_scaled, self.p_scale_log2)
        self._pv(mmas, probs, alphas)

    @cute.jit
    def _pv(self, mmas, probs: list, alphas: list):
        """O = alpha O + e4m3(448 P) V: O rescaled in place (skipped where alpha is 1), then the PV wgmma
        accumulating onto O, waited for."""
        mma_pv, operands, acc_o = mmas[1], mmas[2], mmas[4]
        rescale(acc_o, alphas)
        self._p_operand(probs, cute.recast_tensor(operands[2], Uint32))
        _gemm(mma_pv, acc_o, operands[2], operands[3][0])

    def _ds_bits(self, stage, ds_lane):
        """The thread's Delta_S of the tile (bf16 bits, 2 per 8-key column block), None for the direct build."""
        ds_bits = None
        if self.compensate:
            ds_bits = []
            for block in range(N_BLOCKS):
                for half in range(2):
                    ds_bits.append(load_shared_u16(stage + (block // 4) * self.stage_bytes + ds_lane
                                                   + sl.ds_read(self.heads, block % 4, half)))
        return ds_bits

    def _qk_scores(self, masked: bool, tile, stage, mmas, state: cute.Tensor, ds_lane, limits, c) -> list:
        """S * 2**-7 = Delta_S * 2**-7 + Q K^T * 2**-7 (-inf where masked) on the QK wgmma -> the thread's scores
        [column block][4] (rows g, g + 8 x keys 8 j + 2c, + 1)."""
        mma_qk, acc_s = mmas[0], mmas[3]
        t_q, t_k = mmas[2][0], mmas[2][1]
        ds_bits = self._ds_bits(stage, ds_lane)
        seen = (limits[0] - tile - 2 * c, limits[1] - tile - 2 * c) if masked else None
        for block in range(N_BLOCKS):
            init = tile_math.score_init(ds_bits, seen, block)
            for i in range(4):
                acc_s[4 * block + i] = init[i]
        _gemm(mma_qk, acc_s, t_q, t_k, extra=mmas[2][4])
        return [[acc_s[4 * block + i] for i in range(4)] for block in range(N_BLOCKS)]

    def _qk_extra_operands(self, mma_qk, smem_ptr, wg, wg_tid):
        """(A, B) fragment pairs QK's wgmma group also runs after Q K^T, built once before the tile loop (built in
        the loop, their descriptors cost ~12 instructions on every tile of v3w8c): none; v3c's Delta_S k-step."""
        return None

    # --- epilogue ---------------------------------------------------------------------------------------------------

    def _row_sum(self, state: cute.Tensor, acc_o: cute.Tensor, r: int):
        """Row g + 8 r's softmax denominator: the quad's sum of the lanes' partial sums in ``state``."""
        return quad_sum(state[2 + r])

    @cute.jit
    def _store_rows(self, state: cute.Tensor, acc_o: cute.Tensor, out: cute.Tensor, q_start, q_len, row0, head, g,
                    c):
        """O / (448 l) of rows g, g + 8 (0 for a row that saw no key): dimensions 8 j + 2c, + 1 of accumulator
        column block j; rows past the sequence are not written."""
        elem_bytes = 4 if self.out_f32 else 2
        for r in cutlass.range_constexpr(2):
            l_row = self._row_sum(state, acc_o, r)
            inv = Float32(cutlass.select_(l_row > Float32(0.0), Float32(1.0) / (l_row * Float32(self.l_scale)),
                                          Float32(0.0)))
            row = row0 + g + 8 * r
            if row < q_len:
                base = out.iterator.toint() + (Int64(q_start + row) * self.num_q_heads + head) * HEAD_DIM * elem_bytes
                for j in cutlass.range_constexpr(HEAD_DIM // 8):
                    lo, hi = acc_o[4 * j + 2 * r] * inv, acc_o[4 * j + 2 * r + 1] * inv
                    address = base + (8 * j + 2 * c) * elem_bytes
                    if cutlass.const_expr(self.out_f32):
                        store_v2_f32(address, lo, hi)
                    else:
                        store_u32(address, f32x2_to_bf16x2(lo, hi))


def softmax_update(scores: list, state: cute.Tensor, lam_scaled, p_scale_log2: float = 0.0,
                   lane_max: list | None = None, poly_every: int = 0, exp2=None) -> tuple:
    """The online softmax of one tile's scores (exact alpha), rows' maxima and sums updated in ``state[0:4]``
    -> (P in the scores' layout, alphas); P and the sums times 2**``p_scale_log2``; ``lane_max``: the scores' lane
    maxima if taken already, ``poly_every``: every n-th P on the FMA pipe, ``exp2``: the timing ablations'
    replacement (`prefill_tile.online_softmax`)."""
    probs, alphas, m_rows, l_rows = tile_math.online_softmax(scores, [state[0], state[1]], [state[2], state[3]],
                                                             lam_scaled, exp2=exp2, exact_alpha=True,
                                                             p_scale_log2=p_scale_log2, lane_max=lane_max,
                                                             poly_every=poly_every)
    for r in range(2):
        state[r] = m_rows[r]
        state[2 + r] = l_rows[r]
    return probs, alphas


@cute.jit
def rescale(acc_o: cute.Tensor, alphas: list) -> None:
    """O *= alpha of each register's row, only where some row of the warp has a new maximum (alpha is exactly 1
    otherwise, ``exact_alpha``): walking the keys last to first, most tiles raise no row's maximum."""
    if cute.arch.vote_any_sync((alphas[0] != Float32(1.0)) | (alphas[1] != Float32(1.0))):
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * alphas[(i >> 1) & 1]


@cute.jit
def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor,
          fresh: cutlass.Constexpr = False, wait: cutlass.Constexpr = True, extra=None) -> None:
    """acc += A B over the k-steps on wgmma (accumulating onto acc's current value; ``fresh``: acc = A B, the
    first k-step ignoring acc), then ``extra``'s (A, B) fragment pairs' k-steps in the same group, waited for
    (``wait`` False: committed only; the caller waits with ``warpgroup.wait_group(0)`` before reading acc)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    for k in cutlass.range_constexpr(cute.size(frag_a.shape[2])):
        atom.set(warpgroup.Field.ACCUMULATE, not (fresh and k == 0))
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
    if cutlass.const_expr(extra is not None):
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for extra_a, extra_b in extra:
            for k in cutlass.range_constexpr(cute.size(extra_a.shape[2])):
                cute.gemm(atom, acc, extra_a[None, None, k], extra_b[None, None, k], acc)
    warpgroup.commit_group()
    if cutlass.const_expr(wait):
        warpgroup.wait_group(0)
