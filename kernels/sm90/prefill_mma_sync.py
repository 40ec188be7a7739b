"""The mma-sync prefill kernel: MpFA prefill attention over the paged MpFA cache on warp-level ``mma.sync``, the
paper's numerics, for the shapes the wgmma kernels refuse (GQA groups other than 4 and 5, pages of 32 keys, an odd
number of query heads).

A CTA of 4 warps owns ``heads`` query heads of one GQA group x ``row_blocks`` blocks of 16 query rows
(`prefill_base`). Every warp owns 16 rows and walks the 32-key tiles its rows can see last to first
(``mpfa.kernels.reference.attention`` with ``block_n`` 32; a tile none of its rows sees is skipped, which is
bit-identical to masking it) and, per tile,

    S = Q_c K_c^T + Delta_S   FP16 m16n8k16 on exactly dequantized NVFP4; Delta_S, or -inf for a masked
                              score, is the accumulator's initial value
    m = max(m, rowmax S);  P = exp2(lam S - lam m);  l = alpha l + rowsum P
    O^T = alpha O^T + V^T e4m3(448 P)^T   e4m3 m16n8k32; V rows transposed in registers, P^T straight from
                                          the QK accumulators (the decode kernel's fragments, `decode_layout`)

and writes O / (448 l). The tiles reaching past the sequence end or past the diagonal of one of the warp's rows come
first (masked scores), then those all its rows see whole (no masking). Register layout of a warp (lane = 4 g + c):

* Q rows ``g`` and ``g + 8`` of the warp: chunk c of each row (32 elements) as 16 f16x2 registers, supplied to
  A (a0/a2 row g, a1/a3 row g + 8) in the same order as K chunk c is supplied to B, like decode.
* S n-tile n: rows g, g + 8 at keys 8 n + 2c, 8 n + 2c + 1 (``score_key``).
* O^T: 2 query n-tiles (rows 0-7, 8-15) x 8 dimension m-tiles; lane (g, c) holds dimensions 16g..16g+15 of query
  rows 8 nq + 2c and 8 nq + 2c + 1 (`prefill_tile.acc_index`).

The register math of a tile is in `prefill_tile` (plain functions, run on a NumPy model of the warp by
tests/kernels/sm90/test_prefill_layout.py). A tile's operands come through a ``STAGES``-deep cp.async ring of
32-key tiles in shared memory, copied once per CTA and read by all its warps (`prefill_staged_layout`: the stage
layout, the copy plan, the read map and the schedule; cp.async zero-fills keys past the sequence end). One CTA
barrier per tile: wait for the own copies, barrier, issue the copies of tile p + STAGES - 1 into the stage tile
p - 1 used, compute tile p. The NVFP4 -> FP16 expansion of K is done once per CTA: at step p, after the barrier,
warp w expands n-tile w of tile p + 1 (`warp_mma.k_fragments`) into one of two fragment buffers, and
every warp reads tile p's B registers from the other (16 conflict-free LDS.128 per lane); the ring therefore
waits for one tile more ahead. The CTA walks the tiles its last row sees; a warp skips the tiles none of its rows
sees (only with ``row_blocks > 1``), but still does its share of copies and K expansion.

Registers: ~255 per thread (0 spills), 2 CTAs per SM; shared memory per CTA 42 KB (4 ring stages of 6.5 KB + 2
fragment buffers of 8 KB). Why 32-key tiles: everything lives in registers, and 64-key tiles made ptxas hoist a
whole tile's loads to the top of the loop and spill.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from . import prefill_staged_layout as sl
from . import prefill_tile as tile_math
from .prefill_base import HEAD_DIM, PrefillSm90Base
from .ptx import (cp_async_commit, cp_async_wait, f32x2_to_bf16x2, load_shared_v4_u32, load_u16, load_u32, load_v4_u32,
                  store_v4_f32, store_v4_u32)
from .smem_pipeline import load_shared_u16, store_shared_v4_u32
from .warp_mma import k_fragments, q_chunk_regs, transpose_v

TILE_KEYS = sl.TILE_KEYS
N_TILES = sl.N_TILES
WARP_ROWS = sl.WARP_ROWS
STAGES = 4


class PrefillSm90MmaSync(PrefillSm90Base):
    """The mma-sync prefill kernel (module docstring) for `PrefillSm90Base`'s shape."""

    min_ctas_per_sm = 0  # ptxas unbounded: ~255 registers, 2 CTAs per SM

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True):
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate)
        self.block_m = WARP_ROWS * self.row_blocks  # query rows per CTA
        self.threads = 32 * sl.CTA_WARPS
        self.smem_bytes = STAGES * self.stage_bytes + 2 * sl.FRAG_BUFFER_BYTES

    @cute.jit
    def _attend(self, q_codes: cute.Tensor, q_scales: cute.Tensor, cache, page_table: cute.Tensor,
                cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, out: cute.Tensor, lam_scaled: Float32):
        """The kernel (``cache``: K codes, K scales, V, Delta_S)."""
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = self._warp_lane()
        g = lane >> 2
        c = lane & 3
        head, kv_head, cta_heads, batch, q_start, q_len, kv_len, cta_row0 = self._sequence(cu_seqlens_q, seq_lens_k,
                                                                                           warp)
        row0 = cta_row0 + self._warp_row(warp)
        rows = (row0 + g, row0 + g + 8)

        num_tiles, limits, common = tile_math.warp_plan(row0, q_len, kv_len, g, causal=self.causal,
                                                        tile_keys=TILE_KEYS, warp_rows=WARP_ROWS)
        num_tiles = Int32(num_tiles)
        walk = self._walk(num_tiles, common, cta_row0, q_len, kv_len, g, TILE_KEYS)

        q_regs = []  # rows g, g + 8: chunk c exactly dequantized to FP16
        for r in cutlass.range_constexpr(2):
            valid = Uint32(rows[r] < q_len)
            q_row = Int64(q_start + rows[r]) * self.num_q_heads + head
            words = load_v4_u32(q_codes.iterator.toint() + q_row * sl.K_ROW_BYTES + 16 * c, valid)
            scale_pair = load_u16(q_scales.iterator.toint() + q_row * sl.SCALE_ROW_BYTES + 2 * c, valid, Uint32(0))
            q_regs.append(q_chunk_regs(words, scale_pair))
        a_steps = tile_math.qk_a_steps(q_regs[0], q_regs[1])

        state = cute.make_rmem_tensor((4,), Float32)  # running max (S * 2**-7) of rows g, g + 8; lane-partial sums
        state[0] = -math.inf
        state[1] = -math.inf
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)
        acc = cute.make_rmem_tensor((tile_math.ACC_REGS,), Float32)
        for i in cutlass.range_constexpr(tile_math.ACC_REGS):
            acc[i] = Float32(0.0)

        self._run_tiles(walk, a_steps, state, acc, lam_scaled, cache, page_table, batch,
                        kv_head, cta_heads, kv_len, limits, tid, warp, lane, g, c)
        self._store(state, acc, out, q_start, q_len, row0, head, g, c)

    # --- the tile loop: the ring --------------------------------------------------------------------------------

    @cute.jit
    def _run_tiles(self, walk, a_steps, state: cute.Tensor, acc: cute.Tensor, lam_scaled, cache,
                   page_table: cute.Tensor, batch, kv_head, cta_heads, kv_len, limits, tid, warp, lane, g, c):
        """The CTA's tiles through the ``STAGES``-deep cp.async ring (prologue, then one `_step` per tile)."""
        cta_tiles, cta_common, num_tiles = walk
        first_head, head_in_cta = cta_heads
        heads = self.heads
        stages = STAGES
        smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=sl.STAGE_ALIGN).toint()
        group_first = first_head - kv_head * self.group  # the CTA's first head in its KV head's Delta_S row
        sources = self._cache_sources(cache, kv_head, group_first)
        lane_bases = (sl.ds_lane_base(heads, group_first, head_in_cta, c), sl.v_lane_base(g, c))
        table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
        page = cute.make_rmem_tensor((1,), Int32)  # page-table entry of the next tile to copy

        # Prologue: tiles 0 .. STAGES - 2 of the walk (last to first) in flight, the next one's page requested, then
        # step 0's K expanded (step p expands the K of step p + 1).
        for index in cutlass.range_constexpr(stages - 1):
            tile_index, stage = sl.ring_prologue(index, cta_tiles)
            if tile_index >= 0:
                self._copy_tile(tile_index, Int32(load_u32(self._page_entry(table_row, tile_index))),
                                smem + stage * self.stage_bytes, kv_len, tid, warp, sources, True)
            cp_async_commit()
        self._fetch_page(page, table_row, sl.ring_copy(0, cta_tiles, stages)[0])
        cp_async_wait(stages - 2)
        cute.arch.barrier()
        first_index, first_stage, first_buffer = sl.ring_compute(0, cta_tiles, stages)
        if first_index >= 0:
            self._expand_k(smem, first_stage, first_buffer, warp, lane)

        # Tiles reaching past the sequence end or some row's diagonal (masked scores), then whole tiles.
        masked_tiles, full_tiles = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        for step in cutlass.range(masked_tiles, unroll=1):
            self._step(True, step, cta_tiles, num_tiles, page, table_row, smem, kv_len, tid, sources, a_steps, state,
                       acc, lam_scaled, lane_bases, limits, warp, lane, c)
        for step in cutlass.range(full_tiles, unroll=1):
            self._step(False, masked_tiles + step, cta_tiles, num_tiles, page, table_row, smem, kv_len, tid,
                       sources, a_steps, state, acc, lam_scaled, lane_bases, limits, warp, lane, c)
        cp_async_wait(0)  # only empty groups can be pending here

    @cute.jit
    def _step(self, masked: cutlass.Constexpr, step, cta_tiles, num_tiles, page: cute.Tensor, table_row, smem, kv_len,
              tid, sources, a_steps, state, acc, lam_scaled, lane_bases, limits, warp, lane, c):
        """Step ``step`` of the walk (`prefill_staged_layout.ring_copy` / `ring_compute`)."""
        stages = STAGES
        # This thread's copies of this step's tile and of the next one (whose K is expanded now) have landed.
        cp_async_wait(sl.ring_wait(stages, True))
        cute.arch.barrier()  # everyone's have; every warp is done with the previous step's stage
        copy_index, copy_stage = sl.ring_copy(step, cta_tiles, stages)  # into the previous step's stage
        if copy_index >= 0:  # in the whole-tile loop, later tiles are whole too: no zero fill to decide
            self._copy_tile(copy_index, page[0], smem + copy_stage * self.stage_bytes, kv_len, tid, warp, sources,
                            masked)
        cp_async_commit()
        self._fetch_page(page, table_row, sl.ring_copy(step + 1, cta_tiles, stages)[0])
        next_index, next_stage, next_buffer = sl.ring_compute(step + 1, cta_tiles, stages)
        if next_index >= 0:
            self._expand_k(smem, next_stage, next_buffer, warp, lane)
        tile_index, compute_stage, buffer = sl.ring_compute(step, cta_tiles, stages)
        stage = smem + compute_stage * self.stage_bytes
        fragments = smem + sl.frag_lane_base(stages, self.heads, buffer, lane, self.compensate)
        if cutlass.const_expr(self.row_blocks > 1):
            if tile_index < num_tiles:  # some row of this warp sees the tile
                self._tile(masked, a_steps, state, acc, lam_scaled, tile_index * TILE_KEYS, stage, fragments,
                           lane_bases, limits, lane, c)
        else:
            self._tile(masked, a_steps, state, acc, lam_scaled, tile_index * TILE_KEYS, stage, fragments, lane_bases,
                       limits, lane, c)

    @cute.jit
    def _expand_k(self, smem, raw_stage, buffer, warp, lane):
        """K of the tile in ring stage ``raw_stage`` to FP16 B registers in fragment buffer ``buffer``: warp w the
        lane's B registers of n-tile w (`warp_mma.k_fragments`)."""
        stage = smem + raw_stage * self.stage_bytes
        words = load_shared_v4_u32(stage + sl.k_read(warp, lane))
        regs = k_fragments(words, load_shared_u16(stage + sl.scale_read(warp, lane)))
        fragments = smem + sl.frag_lane_base(STAGES, self.heads, buffer, lane, self.compensate)
        for quad in cutlass.range_constexpr(sl.FRAG_QUADS):
            store_shared_v4_u32(fragments + sl.frag_offset(warp, quad), *regs[4 * quad:4 * quad + 4])

    # --- one tile of one warp ---------------------------------------------------------------------------------------

    @cute.jit
    def _tile(self, masked: cutlass.Constexpr, a_steps, state: cute.Tensor, acc: cute.Tensor, lam_scaled, tile, stage,
              fragments, lane_bases, limits, lane, c):
        """S = Q K^T + Delta_S (-inf where masked; no Delta_S in the direct build), online softmax, acc = alpha acc
        + V^T e4m3(448 P)^T over the 32-key tile at key ``tile``. Keys past the end read zeros."""
        ds_lane, v_lane = lane_bases
        k_regs, ds_bits = [], None
        for n_tile in cutlass.range_constexpr(N_TILES):  # K already expanded: this lane's B registers
            regs = []
            for quad in cutlass.range_constexpr(sl.FRAG_QUADS):
                regs += load_shared_v4_u32(fragments + sl.frag_offset(n_tile, quad))
            k_regs.append(regs)
        if cutlass.const_expr(self.compensate):
            ds_bits = []
            for n_tile in cutlass.range_constexpr(N_TILES):
                for half in cutlass.range_constexpr(2):
                    ds_bits.append(load_shared_u16(stage + ds_lane + sl.ds_read(self.heads, n_tile, half)))
        seen = (limits[0] - tile - 2 * c, limits[1] - tile - 2 * c) if masked else None
        scores = tile_math.qk_scores(a_steps, k_regs, ds_bits, seen)
        v_rows = []
        for k_half in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(4):
                v_rows.append(load_shared_v4_u32(stage + v_lane + sl.v_read(tile_math.pv_tile_key(0, k_half, 0, j))))
        probs, regs = self._softmax(scores, state, acc, lam_scaled, c)
        regs = tile_math.pv_step(regs, probs, transpose_v(v_rows), 0)
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
