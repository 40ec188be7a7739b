"""MpFA prefill attention over the paged MpFA cache (centered NVFP4 Q/K + Delta_S, FP8 V and P), CuTe DSL, mma.sync.

A first, FlashAttention-2-shaped version: a CTA of ``WARPS`` warps owns ``BLOCK_M`` query rows of one query head
(heads fastest in the grid, `prefill_grid.HEADS_FASTEST`, so the GQA group's CTAs run together and share K/V in
L2; the heaviest causal row blocks first). Every warp owns 16 rows and runs on its own, without shared memory or
barriers: it walks the ``TILE_KEYS``-key tiles its rows can see last to first (``mpfa.kernels.reference.attention``
with ``block_n = TILE_KEYS``; tiles a warp's rows cannot see are skipped, which is bit-identical to masking them)
and, per tile,

    S = Q_c K_c^T + Delta_S   FP16 m16n8k16 on exactly dequantized NVFP4; Delta_S, or -inf for a masked
                              score, is the accumulator's initial value
    m = max(m, rowmax S);  P = exp2(lam S - lam m);  l = alpha l + rowsum P
    O^T = alpha O^T + V^T e4m3(448 P)^T   e4m3 m16n8k32; V rows transposed in registers, P^T straight from
                                          the QK accumulators (the decode kernel's fragments, `decode_layout`)

and writes O / (448 l). K, its scales, Delta_S and V are read through the page table straight into registers
(one page-table entry per tile: pages hold a whole number of tiles); the four warps of a CTA read the same tiles,
so all but the first read come from L1. A warp runs two loops: first the tiles that reach past the sequence end
or past the diagonal of one of its rows (predicated loads, masked scores), then the tiles all its rows see whole
(no predicates, no masking: ~15% fewer instructions, and nearly every tile of a long causal prefill). Register
layout of a warp (lane = 4 g + c):

* Q rows ``g`` and ``g + 8`` of the warp: chunk c of each row (32 elements) as 16 f16x2 registers, supplied to
  A (a0/a2 row g, a1/a3 row g + 8) in the same order as K chunk c is supplied to B, like decode.
* S n-tile n: rows g, g + 8 at keys 8 n + 2c, 8 n + 2c + 1 (``score_key``).
* O^T: 2 query n-tiles (rows 0-7, 8-15) x 8 dimension m-tiles; lane (g, c) holds dimensions 16g..16g+15 of query
  rows 8 nq + 2c and 8 nq + 2c + 1 (`prefill_tile.acc_index`).

Why 32-key tiles: everything lives in registers, and with 64-key tiles ptxas hoists the whole tile's K, Delta_S
and V loads to the top of the loop and spills (255 registers + 88 bytes of stack); 32-key tiles compile to 255
registers without local memory (see tests/kernels_sm90/test_prefill_compile.py). The register math of a tile is
in `prefill_tile` (plain functions, run on a NumPy model of the warp by tests/kernels_sm90/test_prefill_layout.py).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from mpfa.kernels.cache_layout import delta_s_row
from mpfa.kernels.sm90 import ablation as abl
from mpfa.kernels.sm90 import prefill_grid
from mpfa.kernels.sm90 import prefill_tile as tile_math
from mpfa.kernels.sm90.ptx import f32x2_to_bf16x2, load_u16, load_u32, load_v4_u32, store_v4_f32, store_v4_u32
from mpfa.kernels.sm90.warp_mma import q_chunk_regs, transpose_v

HEAD_DIM = 128
K_ROW_BYTES = HEAD_DIM // 2
SCALE_ROW_BYTES = HEAD_DIM // 16
TILE_KEYS = 32
N_TILES = TILE_KEYS // 8  # QK n-tiles per KV tile
PV_STEPS = TILE_KEYS // 32  # 32-key PV steps per KV tile
WARPS = 4
WARP_ROWS = 16
BLOCK_M = WARPS * WARP_ROWS
OUT_DTYPES = ("BFloat16", "Float32")


class PrefillSm90:
    """Compile-time shape of one prefill kernel: ``num_kv_heads``, GQA ``group``, ``page_size`` (a power of two
    holding whole tiles), ``causal`` and the output dtype name (``BFloat16`` or ``Float32``). ``ablation``: pieces
    of the tile work removed for timing (`ablation.Ablation`; the default, `ablation.FULL`, is the real kernel).
    ``compensate`` False: the direct build, which reads no Delta_S and starts every visible score at 0 (the output
    of an all-zero Delta_S), to measure what the compensation costs.
    v2 (`prefill_staged`) reuses the launch, the kernel's prologue (Q, softmax state) and epilogue (`_store`) and
    replaces the CTA's shape and order (the attributes below, `_warp_lane`, `_heads`, `_warp_row`, `_walk`) and
    the tile loop, `_run_tiles`."""

    heads = 1  # query heads per CTA (the grid has Hq / heads head blocks)
    threads = 32 * WARPS
    block_m = BLOCK_M  # query rows per CTA
    cta_order = prefill_grid.HEADS_FASTEST  # a GQA group's CTAs (one per head) side by side
    min_ctas_per_sm = 0  # > 1: ``.minnctapersm`` (ptxas bounds the registers for that many CTAs per SM)

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 ablation: abl.Ablation = abl.FULL, compensate: bool = True):
        if num_kv_heads <= 0 or group <= 0:
            raise ValueError(f"need positive num_kv_heads and group, got {num_kv_heads} and {group}")
        if page_size < TILE_KEYS or page_size & (page_size - 1):
            raise ValueError(f"the sm90 prefill kernel needs a power-of-two page_size >= {TILE_KEYS}, got {page_size}")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"prefill output must be one of {OUT_DTYPES}, got {out_dtype!r}")
        self.num_kv_heads = num_kv_heads
        self.group = group
        self.num_q_heads = num_kv_heads * group
        self.ds_row = delta_s_row(group)  # BF16 entries of a (KV head, slot) Delta_S row
        self.page_size = page_size
        self.page_shift = page_size.bit_length() - 1
        self.causal = causal
        self.out_f32 = out_dtype == "Float32"
        if not isinstance(ablation, abl.Ablation):
            raise TypeError(f"ablation must be an Ablation, got {ablation!r}")
        self.ablation = ablation
        self.compensate = bool(compensate)
        # dynamic shared memory per CTA: none, or unused bytes that hold an ablated kernel to the full kernel's 2
        # CTAs per SM
        self.smem_bytes = 0 if ablation.is_full else abl.OCCUPANCY_PAD_BYTES

    @cute.jit
    def __call__(
        self,
        q_codes: cute.Tensor,  # uint8 [total_q, Hq, 64]
        q_scales: cute.Tensor,  # uint8 [total_q, Hq, 8]
        k_codes: cute.Tensor,  # uint8 [slots, Hkv, 64]
        k_scales: cute.Tensor,  # uint8 [Hkv, slots, 8]
        v: cute.Tensor,  # uint8 [slots, Hkv, 128]
        delta_s: cute.Tensor,  # bf16 [Hkv, slots, ds_row]
        page_table: cute.Tensor,  # int32 [B, max_pages]
        cu_seqlens_q: cute.Tensor,  # int32 [B + 1]
        seq_lens_k: cute.Tensor,  # int32 [B]
        out: cute.Tensor,  # bf16 / fp32 [total_q, Hq, 128]
        lam_scaled: Float32,  # log2(e) * sm_scale * 2**7 (the MMA yields S * 2**-7)
        num_m_blocks: Int32,  # ceil(max q_len / block_m)
        stream,
    ):
        self.kernel(
            q_codes, q_scales, k_codes, k_scales, v, delta_s, page_table, cu_seqlens_q, seq_lens_k, out, lam_scaled,
        ).launch(grid=prefill_grid.grid(self.cta_order, self.num_q_heads // self.heads, num_m_blocks,
                                        seq_lens_k.shape[0]),
                 block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream,
                 min_blocks_per_mp=self.min_ctas_per_sm)

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
        g = lane >> 2
        c = lane & 3
        block_head, m_block, batch = prefill_grid.cta(self.cta_order, cute.arch.block_idx(), cute.arch.grid_dim())
        head, kv_head, cta_heads = self._heads(block_head, warp)
        q_start = cu_seqlens_q[batch]
        q_len = cu_seqlens_q[batch + 1] - q_start
        kv_len = seq_lens_k[batch]
        cta_row0 = m_block * self.block_m
        row0 = cta_row0 + self._warp_row(warp)
        rows = (row0 + g, row0 + g + 8)

        num_tiles, limits, common = tile_math.warp_plan(row0, q_len, kv_len, g, causal=self.causal,
                                                        tile_keys=TILE_KEYS, warp_rows=WARP_ROWS)
        num_tiles = Int32(num_tiles)
        walk = self._walk(num_tiles, common, cta_row0, q_len, kv_len, g)

        q_regs = []  # rows g, g + 8: chunk c exactly dequantized to FP16
        for r in cutlass.range_constexpr(2):
            valid = Uint32(rows[r] < q_len)
            q_row = Int64(q_start + rows[r]) * self.num_q_heads + head
            words = load_v4_u32(q_codes.iterator.toint() + q_row * K_ROW_BYTES + 16 * c, valid)
            scale_pair = load_u16(q_scales.iterator.toint() + q_row * SCALE_ROW_BYTES + 2 * c, valid, Uint32(0))
            if cutlass.const_expr(self.ablation.dequant):
                q_regs.append(q_chunk_regs(words, scale_pair))
            else:
                q_regs.append(abl.raw_q_regs(words, scale_pair))
        a_steps = tile_math.qk_a_steps(q_regs[0], q_regs[1])

        state = cute.make_rmem_tensor((4,), Float32)  # running max (S * 2**-7) of rows g, g + 8; lane-partial sums
        state[0] = -math.inf
        state[1] = -math.inf
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)
        acc = cute.make_rmem_tensor((tile_math.ACC_REGS,), Float32)
        for i in cutlass.range_constexpr(tile_math.ACC_REGS):
            acc[i] = Float32(0.0)

        self._run_tiles(walk, a_steps, state, acc, lam_scaled, (k_codes, k_scales, v, delta_s), page_table, batch,
                        kv_head, head, cta_heads, kv_len, limits, tid, warp, lane, g, c)
        self._store(state, acc, out, q_start, q_len, row0, head, g, c)

    # --- the CTA's shape (v2 overrides these) --------------------------------------------------------------------

    def _warp_lane(self, tid):
        """(warp, lane) of thread ``tid``."""
        return tid // 32, tid % 32

    def _heads(self, block_head, warp):
        """(query head, KV head, anything else `_run_tiles` needs about the CTA's heads) of ``warp`` in the CTA of
        grid x ``block_head``: v1, one head per CTA."""
        return block_head, block_head // self.group, None

    def _warp_row(self, warp):
        """First query row of ``warp`` within the CTA's block of rows."""
        return warp * WARP_ROWS

    def _walk(self, num_tiles, common, cta_row0, q_len, kv_len, g):
        """The tiles `_run_tiles` walks: v1, each warp its own (``num_tiles`` its rows see, the first ``common`` keys
        every row of the warp sees whole)."""
        return num_tiles, common

    # --- the tile loop --------------------------------------------------------------------------------------------

    @cute.jit
    def _run_tiles(self, walk, a_steps, state: cute.Tensor, acc: cute.Tensor, lam_scaled, cache,
                   page_table: cute.Tensor, batch, kv_head, head, cta_heads, kv_len, limits, tid, warp, lane, g, c):
        """The warp's tiles, each loaded straight into registers."""
        num_tiles, common = walk
        k_codes, k_scales, v, delta_s = cache
        head_slot = Int64(kv_head * k_scales.shape[1])  # head-major K scales / Delta_S: the KV head's slot 0
        bases = (
            k_codes.iterator.toint() + kv_head * K_ROW_BYTES + 16 * c,
            k_scales.iterator.toint() + head_slot * SCALE_ROW_BYTES + 2 * c,
            delta_s.iterator.toint() + (head_slot * self.ds_row + head - kv_head * self.group) * 2,
            v.iterator.toint() + kv_head * HEAD_DIM + 16 * g,
        )
        table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
        # Tiles run last to first: first those reaching past the sequence end or some row's diagonal (predicated
        # loads, masked scores), then those every row of the warp sees whole (no predicates, no masking).
        full_tiles = cutlass.min(common // TILE_KEYS, num_tiles)
        for step in cutlass.range(num_tiles - full_tiles, unroll=1):
            tile = (num_tiles - 1 - step) * TILE_KEYS
            self._tile(True, a_steps, state, acc, lam_scaled, tile, table_row, kv_len, limits, g, c, bases)
        for step in cutlass.range(full_tiles, unroll=1):
            tile = (full_tiles - 1 - step) * TILE_KEYS
            self._tile(False, a_steps, state, acc, lam_scaled, tile, table_row, kv_len, limits, g, c, bases)

    # --- pieces of one tile (the register math is in `prefill_tile`) ---------------------------------------------

    @cute.jit
    def _tile(self, masked: cutlass.Constexpr, a_steps, state, acc, lam_scaled, tile, table_row, kv_len, limits, g,
              c, bases):
        """One KV tile; ``masked``: the tile reaches past the sequence or the diagonal of some row of the warp."""
        page = Int64(Int32(load_u32(table_row + Int64(tile >> self.page_shift) * 4)))
        slot0 = page * self.page_size + (tile & (self.page_size - 1))  # a tile never straddles pages
        scores = self._qk_tile(masked, a_steps, tile, slot0, kv_len, limits, g, c, bases)
        v_rows = self._load_v(masked, 0, tile, slot0, kv_len, c, bases[3])  # in flight during the softmax
        self._softmax_pv(masked, scores, state, acc, v_rows, lam_scaled, tile, slot0, kv_len, c, bases[3])

    @cute.jit
    def _qk_tile(self, masked: cutlass.Constexpr, a_steps, tile, slot0, kv_len, limits, g, c, bases):
        """Load the lane's K chunks and scale pairs (keys 8 n + g) and Delta_S (keys 8 n + 2c + half; none in the
        direct build), then S; keys past the end read nothing. One base address per operand and tile with the keys
        at constant offsets: per-key 64-bit addresses would be loop invariants that the compiler keeps in
        registers."""
        k_base, ks_base, ds_base, _ = bases
        k_stride, ks_stride, ds_stride = self.num_kv_heads * K_ROW_BYTES, SCALE_ROW_BYTES, self.ds_row * 2
        k_row = k_base + (slot0 + Int64(g)) * k_stride
        ks_row = ks_base + (slot0 + Int64(g)) * ks_stride
        ds_row = ds_base + (slot0 + Int64(2 * c)) * ds_stride
        k_left = kv_len - tile - g  # key 8 n + g exists iff 8 n < k_left
        ds_left = kv_len - tile - 2 * c
        k_words, k_scale_pairs, ds_bits = [], [], None
        for n_tile in cutlass.range_constexpr(N_TILES):
            valid = Uint32(k_left > 8 * n_tile) if masked else Uint32(1)
            k_words.append(load_v4_u32(k_row + 8 * n_tile * k_stride, valid))
            k_scale_pairs.append(load_u16(ks_row + 8 * n_tile * ks_stride, valid, Uint32(0)))
        if cutlass.const_expr(self.compensate):
            ds_bits = []
            for n_tile in cutlass.range_constexpr(N_TILES):
                for half in cutlass.range_constexpr(2):
                    valid = Uint32(ds_left > 8 * n_tile + half) if masked else Uint32(1)
                    ds_bits.append(load_u16(ds_row + (8 * n_tile + half) * ds_stride, valid, Uint32(0)))
        seen = (limits[0] - tile - 2 * c, limits[1] - tile - 2 * c) if masked else None
        if cutlass.const_expr(self.ablation.dequant):
            return tile_math.qk_scores(a_steps, k_words, k_scale_pairs, ds_bits, seen)
        return tile_math.qk_scores(a_steps, k_words, k_scale_pairs, ds_bits, seen, ntile=abl.qk_ntile_raw)

    @cute.jit
    def _load_v(self, masked: cutlass.Constexpr, step, tile, slot0, kv_len, c, v_base):
        """V chunk g (16 bytes) of PV step ``step``'s keys ``pv_tile_key(step, k_half, c, j)``, index 4 k_half + j;
        zeros past the end (their P is 0, and 0 * V must stay finite)."""
        stride = self.num_kv_heads * HEAD_DIM
        row = v_base + (slot0 + Int64(2 * c)) * stride
        left = kv_len - tile - 2 * c
        v_rows = []
        for k_half in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(4):
                offset = tile_math.pv_tile_key(step, k_half, 0, j)  # the key is offset + 2c
                v_rows.append(load_v4_u32(row + offset * stride, Uint32(left > offset) if masked else Uint32(1)))
        return v_rows

    @cute.jit
    def _softmax_pv(self, masked: cutlass.Constexpr, scores, state: cute.Tensor, acc: cute.Tensor, v_rows, lam_scaled,
                    tile, slot0, kv_len, c, v_base):
        """Online softmax of rows g, g + 8, then acc = alpha acc + V^T e4m3(448 P)^T; the next PV step's V loads
        are issued before this step's MMAs."""
        if cutlass.const_expr(not self.ablation.is_full):
            self._softmax_pv_ablated(masked, scores, state, acc, v_rows, lam_scaled, tile, slot0, kv_len, c, v_base)
        else:
            probs, regs = self._softmax(scores, state, acc, lam_scaled, c)
            for step in cutlass.range_constexpr(PV_STEPS):
                transposed = transpose_v(v_rows)
                if cutlass.const_expr(step + 1 < PV_STEPS):
                    v_rows = self._load_v(masked, step + 1, tile, slot0, kv_len, c, v_base)
                regs = tile_math.pv_step(regs, probs, transposed, step)
            for i in cutlass.range_constexpr(tile_math.ACC_REGS):
                acc[i] = regs[i]

    @cute.jit
    def _softmax(self, scores, state: cute.Tensor, acc: cute.Tensor, lam_scaled, c):
        """Online softmax of rows g, g + 8 (``state`` updated) -> (P, alpha acc as a list of registers)."""
        probs, alphas, m_rows, l_rows = tile_math.online_softmax(scores, [state[0], state[1]], [state[2], state[3]],
                                                                 lam_scaled)
        for r in cutlass.range_constexpr(2):
            state[r] = m_rows[r]
            state[2 + r] = l_rows[r]
        return probs, tile_math.rescale([acc[i] for i in range(tile_math.ACC_REGS)], alphas, c)

    @cute.jit
    def _softmax_pv_ablated(self, masked: cutlass.Constexpr, scores, state: cute.Tensor, acc: cute.Tensor, v_rows,
                            lam_scaled, tile, slot0, kv_len, c, v_base):
        """`_softmax_pv` with the pieces ``self.ablation`` removes replaced as `ablation` describes (timing only)."""
        ablation = self.ablation
        exp2 = tile_math.exp2_approx if ablation.exp2 else abl.no_exp2
        regs = [acc[i] for i in range(tile_math.ACC_REGS)]
        if cutlass.const_expr(ablation.rowstats):
            probs, alphas, m_rows, l_rows = tile_math.online_softmax(scores, [state[0], state[1]],
                                                                     [state[2], state[3]], lam_scaled, exp2=exp2)
            for r in cutlass.range_constexpr(2):
                state[r] = m_rows[r]
                state[2 + r] = l_rows[r]
            regs = tile_math.rescale(regs, alphas, c)
        else:
            probs = abl.plain_probs(scores, lam_scaled, exp2)
        if cutlass.const_expr(ablation.pv):
            for step in cutlass.range_constexpr(PV_STEPS):
                transposed = transpose_v(v_rows)
                if cutlass.const_expr(step + 1 < PV_STEPS):
                    v_rows = self._load_v(masked, step + 1, tile, slot0, kv_len, c, v_base)
                regs = tile_math.pv_step(regs, probs, transposed, step)
        else:
            for step in cutlass.range_constexpr(PV_STEPS):
                if cutlass.const_expr(step > 0):
                    v_rows = self._load_v(masked, step, tile, slot0, kv_len, c, v_base)
                regs = abl.fold_without_pv(regs, probs, v_rows)
        for i in cutlass.range_constexpr(tile_math.ACC_REGS):
            acc[i] = regs[i]

    @cute.jit
    def _store(self, state: cute.Tensor, acc: cute.Tensor, out: cute.Tensor, q_start, q_len, row0, head, g, c):
        """O / (448 l) of query rows 8 nq + 2c + w, dimensions 16g..16g+15 (32 or 64 contiguous bytes); rows past
        the sequence are not written."""
        elem_bytes = 4 if self.out_f32 else 2
        out_base = out.iterator.toint()
        rows = tile_math.output_rows([acc[i] for i in range(tile_math.ACC_REGS)], [state[2], state[3]], c)
        for index in cutlass.range_constexpr(4):
            nq, w, values = rows[index]
            row = row0 + 8 * nq + 2 * c + w
            if row < q_len:
                address = out_base + ((Int64(q_start + row) * self.num_q_heads + head) * HEAD_DIM + 16 * g) * elem_bytes
                if cutlass.const_expr(self.out_f32):
                    for quad in cutlass.range_constexpr(4):
                        store_v4_f32(address + 16 * quad, *values[4 * quad:4 * quad + 4])
                else:
                    words = [f32x2_to_bf16x2(values[2 * i], values[2 * i + 1]) for i in range(8)]
                    store_v4_u32(address, *words[:4])
                    store_v4_u32(address + 16, *words[4:])
