"""MpFA prefill v2 ("staged"): v1's warps and numerics (`prefill.PrefillSm90`), fed from a CTA-wide cp.async ring in
shared memory instead of per-warp global loads, with K expanded to FP16 once per CTA instead of once per warp.

v1 was bound by its loads (profiles/NOTES.md, "Characterization"): every warp fetched every K / V / Delta_S tile
from global memory straight into registers, 4x over within a CTA and once more per query head of a GQA group,
with two warps per scheduler to hide the latency. v2 changes where a tile's operands come from:

* A CTA of 4 (default) or 8 warps owns ``heads`` query heads of one GQA group x ``row_blocks`` blocks of 16
  query rows (`prefill_staged_layout.cta_shape`: group 4 -> the whole group x 16 rows, or x 32 with 8 warps;
  group 5 -> 1 head x 64 rows); warp w is query head ``first_head + w % heads``, rows ``16 (w // heads)`` .. + 15
  of the CTA's block. Each K / V / scale / Delta_S tile is copied once per CTA and read by all its warps (v1:
  loaded by every warp, 4 per head). 8 warps halve the copies and the K expansion per row (and the CTAs of a
  launch) but hold 1 CTA per SM instead of 2 (255 registers): the same 8 warps per SM, all behind one barrier.
* The copy is a ``STAGES``-deep ring of 32-key tiles (`prefill_staged_layout` has the stage layout, the copy
  plan, the read map and the schedule; cp.async zero-fills keys past the sequence end, which is what v1's
  predicated loads returned). One CTA barrier per tile: wait for the own copies, barrier, issue the copies of
  tile p + STAGES - 1 into the stage tile p - 1 used, compute tile p. Each warp copies whole warp slots of 32
  units (`copy_plan`: at most 4 per tile with 4 warps, 2 with 8). The page-table entry of the next tile to copy
  is fetched one tile ahead.
* ``shared_dequant`` (default): the NVFP4 -> FP16 expansion of K (v1: ~270 of ~800 instructions per warp and
  tile, the same work in each of the 4 warps) is done once per CTA: at step p, after the barrier, the warps
  expand tile p + 1 (`prefill_staged_tile.k_fragments`, v1's expansion; one n-tile per warp with 4 warps, half
  of one with 8, `expand_unit`) into one of two fragment buffers, and read tile p's B registers from the other
  (16 conflict-free LDS.128 per lane). The ring then waits for one more tile ahead (``ring_wait``). ~675 SASS
  instructions per warp and whole tile (v1 ~800).
* Per warp and tile the arithmetic is v1's, operand for operand (`prefill_tile`, `warp_mma`): the same 32-key
  tiles in the same (reverse) order, the same predicated-tile / whole-tile split, the same FP16 B registers, so
  the output is bit-identical to v1 (tests/kernels_sm90/test_prefill_staged_gpu.py compares them exactly). The
  CTA walks the tiles its last row sees; a warp skips the tiles none of its rows sees (only when
  ``row_blocks > 1``; bit-identical, as in v1), but still does its share of copies and K expansion.
* The grid is (row blocks, Hq / heads, batch) (`prefill_grid.ROWS_FASTEST`): the row blocks of one head block
  run together, the heaviest causal row blocks first, so the resident CTAs share one KV head's K / V in L2 (in
  v1's heads-fastest order v2's CTAs spread over all KV heads, 109 MB at 64K, twice the L2: 126.6 GB of DRAM
  reads at 64K causal 32:8, v1 6.5 GB). The launch signature is v1's (`prefill_launch` picks the kernel,
  ``MPFA_PREFILL_KERNEL=v1|v2|v2w8``, and sizes ``num_m_blocks`` with the kernel's block of rows,
  `prefill_staged_layout.cta_shape`).
* The code is a subclass of v1's: the launch, the kernel signature, the prologue (Q, softmax state), the online
  softmax and the epilogue are v1's; the CTA's shape and order (attributes and `_warp_lane` / `_heads` /
  `_warp_row` / `_walk`) and the tile loop (`_run_tiles`) are replaced.

Registers: ~255 per thread as v1 (0 spills), so 2 CTAs of 4 warps or 1 of 8 per SM; shared memory per CTA 42 KB
(4 ring stages of 6.5 KB + 2 fragment buffers of 8 KB), 26 KB without ``shared_dequant``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from mpfa.kernels.sm90 import prefill_grid
from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90 import prefill_tile as tile_math
from mpfa.kernels.sm90.prefill import PrefillSm90
from mpfa.kernels.sm90.prefill_staged_tile import k_fragment_part, qk_ntile_from_fragments
from mpfa.kernels.sm90.ptx import cp_async_4, cp_async_16, cp_async_commit, cp_async_wait, load_shared_v4_u32, load_u32
from mpfa.kernels.sm90.smem_pipeline import cp_async_8, load_shared_u16, load_u32_if, store_shared_v4_u32
from mpfa.kernels.sm90.warp_mma import transpose_v

HEAD_DIM = sl.HEAD_DIM
K_ROW_BYTES = sl.K_ROW_BYTES
SCALE_ROW_BYTES = sl.SCALE_ROW_BYTES
TILE_KEYS = sl.TILE_KEYS
N_TILES = sl.N_TILES
WARP_ROWS = sl.WARP_ROWS
STAGES = 4
SHARED_DEQUANT = True  # expand each K tile to FP16 once per CTA (shared by the warps), not in every warp


class PrefillSm90Staged(PrefillSm90):
    """Compile-time shape of one staged prefill kernel: as `prefill.PrefillSm90` (``num_kv_heads``, GQA ``group``,
    ``page_size``, ``causal``, output dtype name; no ablations), plus ``warps`` per CTA (4 or 8, for groups whose
    4-warp CTA holds 4 heads; the CTA's heads x 16-row blocks: `prefill_staged_layout.cta_shape`), ``stages``
    (depth of the shared-memory ring, a power of two >= 2, >= 4 with ``shared_dequant``) and ``shared_dequant``
    (K expanded once per CTA; None: ``SHARED_DEQUANT``) and ``compensate`` (False: the direct build, no Delta_S
    copied, as v1's). v1's launch, signature, prologue and epilogue with the CTA's shape and order and the tile
    loop, `_run_tiles`, replaced."""

    cta_order = prefill_grid.ROWS_FASTEST  # a head block's row blocks side by side: one KV head resident at a time
    tile_keys = TILE_KEYS  # keys per tile of the CTA's walk (`_walk`)

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 warps: int = sl.CTA_WARPS, stages: int = STAGES, shared_dequant: bool | None = None,
                 compensate: bool = True):
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate=compensate)
        if (num_kv_heads * group) % 2:
            raise ValueError("the staged prefill copies Delta_S as 4-byte words: needs an even number of query heads")
        shared_dequant = SHARED_DEQUANT if shared_dequant is None else bool(shared_dequant)
        if stages < 2 + shared_dequant or stages & (stages - 1):
            raise ValueError(f"stages must be a power of two >= {2 + shared_dequant}, got {stages}")
        if warps not in sl.CTA_WARP_CHOICES:
            raise ValueError(f"warps per CTA must be one of {sl.CTA_WARP_CHOICES}, got {warps}")
        self.heads, self.row_blocks = sl.cta_shape(group, warps)
        self.block_m = WARP_ROWS * self.row_blocks
        self.stages = stages
        self.threads = 32 * self.heads * self.row_blocks
        self.stage_bytes = sl.stage_bytes(self.heads, self.compensate)
        self.shared_dequant = shared_dequant
        self.smem_bytes = stages * self.stage_bytes + (2 * sl.FRAG_BUFFER_BYTES if shared_dequant else 0)

    # --- the CTA's shape: ``heads`` query heads x ``row_blocks`` blocks of 16 rows ---------------------------------

    def _warp_lane(self, tid):
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()), cute.arch.lane_idx()

    def _heads(self, block_head, warp):
        """Warp w is query head ``first_head + w % heads``; -> (head, KV head, (first_head, w % heads))."""
        first_head = block_head * self.heads
        kv_head = first_head // self.group
        head_in_cta = warp % self.heads
        return first_head + head_in_cta, kv_head, (first_head, head_in_cta)

    def _warp_row(self, warp):
        return (warp // self.heads) * WARP_ROWS

    def _walk(self, num_tiles, common, cta_row0, q_len, kv_len, g):
        """(tiles the CTA walks, leading keys all its rows see, tiles this warp's rows see): the CTA walks the
        tiles its last row sees."""
        cta_tiles, cta_common = num_tiles, common
        if self.row_blocks > 1:
            cta_tiles, _, cta_common = tile_math.warp_plan(cta_row0, q_len, kv_len, g, causal=self.causal,
                                                           tile_keys=self.tile_keys, warp_rows=self.block_m)
            cta_tiles = Int32(cta_tiles)
        return cta_tiles, cta_common, num_tiles

    # --- the tile loop: the ring ------------------------------------------------------------------------------

    @cute.jit
    def _run_tiles(self, walk, a_steps, state: cute.Tensor, acc: cute.Tensor, lam_scaled, cache,
                   page_table: cute.Tensor, batch, kv_head, head, cta_heads, kv_len, limits, tid, warp, lane, g, c):
        """The CTA's tiles through the ``stages``-deep cp.async ring (prologue, then one `_step` per tile)."""
        cta_tiles, cta_common, num_tiles = walk
        k_codes, k_scales, v, delta_s = cache
        first_head, head_in_cta = cta_heads
        heads = self.heads
        stages = self.stages
        smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=sl.STAGE_ALIGN).toint()
        group_first = first_head - kv_head * self.group  # the CTA's first head in its KV head's Delta_S row
        head_slot = kv_head * k_scales.shape[1]  # head-major K scales / Delta_S: the KV head's slot 0
        # (address, first slot) of the KV head's rows (+ slot x row stride): the head's bytes of slot 0 in the
        # token-major K codes / V, the array from slot head_slot in the head-major K scales / Delta_S.
        sources = (
            (k_codes.iterator.toint() + kv_head * K_ROW_BYTES, 0),
            (v.iterator.toint() + kv_head * HEAD_DIM, 0),
            (k_scales.iterator.toint(), head_slot),
            (delta_s.iterator.toint() + 4 * sl.ds_first_word(group_first), head_slot),
        )
        lane_bases = (sl.ds_lane_base(heads, group_first, head_in_cta, c), sl.v_lane_base(g, c))
        table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
        page = cute.make_rmem_tensor((1,), Int32)  # page-table entry of the next tile to copy

        # Prologue: tiles 0 .. STAGES - 2 of the walk (last to first) in flight, the next one's page requested.
        for index in cutlass.range_constexpr(stages - 1):
            tile_index, stage = sl.ring_prologue(index, cta_tiles)
            if tile_index >= 0:
                self._copy_tile(tile_index, Int32(load_u32(self._page_entry(table_row, tile_index))),
                                smem + stage * self.stage_bytes, kv_len, tid, warp, sources, True)
            cp_async_commit()
        self._fetch_page(page, table_row, sl.ring_copy(0, cta_tiles, stages)[0])
        if cutlass.const_expr(self.shared_dequant):  # expand step 0's K (step p expands the K of step p + 1)
            cp_async_wait(stages - 2)
            cute.arch.barrier()
            first_index, first_stage, first_buffer = sl.ring_compute(0, cta_tiles, stages)
            if first_index >= 0:
                self._expand_k(smem, first_stage, first_buffer, warp, lane)

        # Tiles reaching past the sequence end or some row's diagonal (masked scores), then whole tiles (as v1).
        masked_tiles, full_tiles = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        for step in cutlass.range(masked_tiles, unroll=1):
            self._step(True, step, cta_tiles, num_tiles, page, table_row, smem, kv_len, tid, sources, a_steps, state,
                       acc, lam_scaled, lane_bases, limits, warp, lane, c)
        for step in cutlass.range(full_tiles, unroll=1):
            self._step(False, masked_tiles + step, cta_tiles, num_tiles, page, table_row, smem, kv_len, tid,
                       sources, a_steps, state, acc, lam_scaled, lane_bases, limits, warp, lane, c)
        cp_async_wait(0)  # only empty groups can be pending here

    # --- the ring ---------------------------------------------------------------------------------------------

    def _page_entry(self, table_row, tile_index):
        return table_row + Int64((tile_index * TILE_KEYS) >> self.page_shift) * 4

    @cute.jit
    def _fetch_page(self, page: cute.Tensor, table_row, tile_index):
        """Request the page-table entry of ``tile_index`` (nothing read when it is negative: no tile left)."""
        page[0] = Int32(load_u32_if(self._page_entry(table_row, cutlass.max(tile_index, 0)),
                                    Uint32(tile_index >= 0)))

    @cute.jit
    def _step(self, masked: cutlass.Constexpr, step, cta_tiles, num_tiles, page: cute.Tensor, table_row, smem, kv_len,
              tid, sources, a_steps, state, acc, lam_scaled, lane_bases, limits, warp, lane, c):
        """Step ``step`` of the walk (`prefill_staged_layout.ring_copy` / `ring_compute`)."""
        stages = self.stages
        # This thread's copies of this step's tile (and, expanding K a step ahead, of the next one) have landed.
        cp_async_wait(sl.ring_wait(stages, self.shared_dequant))
        cute.arch.barrier()  # everyone's have; every warp is done with the previous step's stage
        copy_index, copy_stage = sl.ring_copy(step, cta_tiles, stages)  # into the previous step's stage
        if copy_index >= 0:  # in the whole-tile loop, later tiles are whole too: no zero fill to decide
            self._copy_tile(copy_index, page[0], smem + copy_stage * self.stage_bytes, kv_len, tid, warp, sources,
                            masked)
        cp_async_commit()
        self._fetch_page(page, table_row, sl.ring_copy(step + 1, cta_tiles, stages)[0])
        fragments = None
        if cutlass.const_expr(self.shared_dequant):
            next_index, next_stage, next_buffer = sl.ring_compute(step + 1, cta_tiles, stages)
            if next_index >= 0:
                self._expand_k(smem, next_stage, next_buffer, warp, lane)
        tile_index, compute_stage, buffer = sl.ring_compute(step, cta_tiles, stages)
        stage = smem + compute_stage * self.stage_bytes
        if cutlass.const_expr(self.shared_dequant):
            fragments = smem + sl.frag_lane_base(stages, self.heads, buffer, lane, self.compensate)
        if cutlass.const_expr(self.row_blocks > 1):
            if tile_index < num_tiles:  # some row of this warp sees the tile
                self._tile(masked, a_steps, state, acc, lam_scaled, tile_index * TILE_KEYS, stage, fragments,
                           lane_bases, limits, lane, c)
        else:
            self._tile(masked, a_steps, state, acc, lam_scaled, tile_index * TILE_KEYS, stage, fragments, lane_bases,
                       limits, lane, c)

    @cute.jit
    def _copy_tile(self, tile_index, page, stage, kv_len, tid, warp, sources, ragged: cutlass.Constexpr,
                   threads: cutlass.Constexpr = None):
        """cp.async the KV head's bytes of tile ``tile_index`` into ``stage``, every warp its slots of each array
        (`prefill_staged_layout.copy_plan`; Delta_S only with ``compensate``); keys past ``kv_len`` copy 0 bytes
        (zero fill; ``ragged`` false: the tile is known to be whole). A tile never straddles pages. ``threads``:
        the threads that copy the tile (``tid``, ``warp`` numbered among them; None: the CTA's)."""
        tile = tile_index * TILE_KEYS
        slot0 = Int64(page) * self.page_size + (tile & (self.page_size - 1))
        left = kv_len - tile  # key k of the tile exists iff k < left
        hkv = self.num_kv_heads
        threads = self.threads if threads is None else threads
        strides = (hkv * K_ROW_BYTES, hkv * HEAD_DIM, SCALE_ROW_BYTES, self.ds_row * 2)  # cache rows per slot
        copies = {16: cp_async_16, 8: cp_async_8, 4: cp_async_4}
        rows = {name: (stride, source + (slot0 + first_slot) * stride)  # the tile's first cache row of each array
                for (name, _, _, _), stride, (source, first_slot) in zip(sl.copy_arrays(self.heads), strides, sources)}
        warps = threads // 32
        for (name, _, size, copy_map), r, first_warp, end_warp in sl.copy_plan(self.heads, warps, self.compensate):
            stride, first = rows[name]
            key, offset, smem_offset = copy_map(tid, r)
            src_bytes = Uint32(cutlass.select_(key < left, size, 0)) if ragged else Uint32(size)
            address = first + Int64(key * stride + offset)
            if cutlass.const_expr(first_warp == 0 and end_warp == warps):
                copies[size](stage + smem_offset, address, src_bytes)
            else:
                if Uint32(warp - first_warp) < Uint32(end_warp - first_warp):  # warp-uniform
                    copies[size](stage + smem_offset, address, src_bytes)

    @cute.jit
    def _expand_k(self, smem, raw_stage, buffer, warp, lane):
        """K of the tile in ring stage ``raw_stage`` to FP16 B registers in fragment buffer ``buffer``: warp w the
        expansion units u with u % warps == w (`prefill_staged_layout.expand_unit`)."""
        warps = self.threads // 32
        parts = sl.expand_parts(warps)
        units = sl.N_TILES * parts
        stage = smem + raw_stage * self.stage_bytes
        for round_ in cutlass.range_constexpr((units + warps - 1) // warps):
            unit = warp + round_ * warps
            if cutlass.const_expr((round_ + 1) * warps <= units):
                self._expand_unit(smem, stage, buffer, unit, parts, lane)
            else:
                if unit < units:
                    self._expand_unit(smem, stage, buffer, unit, parts, lane)

    @cute.jit
    def _expand_unit(self, smem, stage, buffer, unit, parts: cutlass.Constexpr, lane):
        """Expansion unit ``unit`` (warp-uniform, `prefill_staged_layout.expand_unit`): the lane's B registers of
        the unit's part of its n-tile, into fragment buffer ``buffer``."""
        n_tile, part = sl.expand_unit(unit, parts)
        words = load_shared_v4_u32(stage + sl.k_read(n_tile, lane))
        regs = k_fragment_part(words, load_shared_u16(stage + sl.scale_read(n_tile, lane)), part, parts)
        fragments = smem + sl.frag_lane_base(self.stages, self.heads, buffer, lane, self.compensate)
        for index, quad in enumerate(sl.part_quads(part, parts)):
            store_shared_v4_u32(fragments + sl.frag_offset(n_tile, quad), *regs[4 * index:4 * index + 4])

    # --- one tile of one warp: v1's arithmetic, operands from shared memory ----------------------------------------

    @cute.jit
    def _tile(self, masked: cutlass.Constexpr, a_steps, state: cute.Tensor, acc: cute.Tensor, lam_scaled, tile, stage,
              fragments, lane_bases, limits, lane, c):
        """S = Q K^T + Delta_S (-inf where masked; no Delta_S in the direct build), online softmax, acc = alpha acc
        + V^T e4m3(448 P)^T: exactly `prefill.PrefillSm90._tile` with one 32-key PV step. Keys past the end read
        zeros (as v1's loads)."""
        ds_lane, v_lane = lane_bases
        k_words, k_scale_pairs, ds_bits = [], [], None
        if cutlass.const_expr(self.shared_dequant):  # K already expanded: this lane's B registers
            for n_tile in cutlass.range_constexpr(N_TILES):
                regs = []
                for quad in cutlass.range_constexpr(sl.FRAG_QUADS):
                    regs += load_shared_v4_u32(fragments + sl.frag_offset(n_tile, quad))
                k_words.append(regs)
                k_scale_pairs.append(None)
        else:
            for n_tile in cutlass.range_constexpr(N_TILES):
                k_words.append(load_shared_v4_u32(stage + sl.k_read(n_tile, lane)))
                k_scale_pairs.append(load_shared_u16(stage + sl.scale_read(n_tile, lane)))
        if cutlass.const_expr(self.compensate):
            ds_bits = []
            for n_tile in cutlass.range_constexpr(N_TILES):
                for half in cutlass.range_constexpr(2):
                    ds_bits.append(load_shared_u16(stage + ds_lane + sl.ds_read(self.heads, n_tile, half)))
        seen = (limits[0] - tile - 2 * c, limits[1] - tile - 2 * c) if masked else None
        scores = tile_math.qk_scores(a_steps, k_words, k_scale_pairs, ds_bits, seen,
                                     ntile=qk_ntile_from_fragments if self.shared_dequant else None)
        v_rows = []
        for k_half in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(4):
                v_rows.append(load_shared_v4_u32(stage + v_lane + sl.v_read(tile_math.pv_tile_key(0, k_half, 0, j))))
        probs, regs = self._softmax(scores, state, acc, lam_scaled, c)
        regs = tile_math.pv_step(regs, probs, transpose_v(v_rows), 0)
        for i in cutlass.range_constexpr(tile_math.ACC_REGS):
            acc[i] = regs[i]
