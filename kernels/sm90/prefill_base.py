"""What the three sm90 prefill kernels share: the compile-time shape, the CTA's heads and rows, its walk over the
KV tiles and the cp.async copies of a 32-key tile of the paged cache into a shared-memory ring stage.

Every kernel's CTA is built from the 4-warp block of `prefill_staged_layout.cta_shape`: ``heads`` query heads of
one GQA group x ``row_blocks`` blocks of 16 query rows (group 4: the whole group x 16 rows; group 5: one head x 64
rows); warp w is query head ``first_head + w % heads``, rows ``16 (w // heads)`` .. + 15. The grid is (row blocks,
head blocks, batch) (`prefill_grid`): one KV head's K / V stays resident in L2 while its row blocks run, the
heaviest causal row blocks first. Tiles are walked last to first (the reference's tile order).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..cache_layout import delta_s_row
from . import prefill_grid
from . import prefill_staged_layout as sl
from . import prefill_tile as tile_math
from .ptx import cp_async_4, cp_async_16
from .smem_pipeline import cp_async_8, load_u32_if

HEAD_DIM = sl.HEAD_DIM
OUT_DTYPES = ("BFloat16", "Float32")


class PrefillSm90Base:
    """Compile-time shape of a prefill kernel: ``num_kv_heads``, GQA ``group``, ``page_size`` (a power of two
    holding whole 32-key tiles), ``causal``, the output dtype name (``BFloat16`` or ``Float32``) and
    ``compensate`` (False: the direct build, which reads no Delta_S and starts every visible score at 0, the
    output of an all-zero Delta_S; it exists to time what the compensation costs)."""

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True):
        if num_kv_heads <= 0 or group <= 0:
            raise ValueError(f"need positive num_kv_heads and group, got {num_kv_heads} and {group}")
        if page_size < sl.TILE_KEYS or page_size & (page_size - 1):
            raise ValueError(f"the sm90 prefill kernel needs a power-of-two page_size >= {sl.TILE_KEYS}, "
                             f"got {page_size}")
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
        self.compensate = bool(compensate)
        self.heads, self.row_blocks = sl.cta_shape(group)
        self.stage_bytes = sl.stage_bytes(self.heads, self.compensate)  # one 32-key ring stage

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
        """The launch of a kernel that reads the cache (the subclass's `_attend`, ``threads``, ``smem_bytes`` and
        ``min_ctas_per_sm``)."""
        self.kernel(
            q_codes, q_scales, k_codes, k_scales, v, delta_s, page_table, cu_seqlens_q, seq_lens_k, out, lam_scaled,
        ).launch(grid=prefill_grid.grid(self.num_q_heads // self.heads, num_m_blocks,
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
        self._attend(q_codes, q_scales, (k_codes, k_scales, v, delta_s), page_table, cu_seqlens_q, seq_lens_k, out,
                     lam_scaled)

    # --- the CTA's heads and rows ----------------------------------------------------------------------------------

    def _warp_lane(self):
        """(warp of the CTA, lane)."""
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()), cute.arch.lane_idx()

    def _heads(self, block_head, warp):
        """Warp w is query head ``first_head + w % heads`` of the CTA at grid head block ``block_head``
        -> (head, KV head, (first_head, w % heads))."""
        first_head = block_head * self.heads
        kv_head = first_head // self.group
        head_in_cta = warp % self.heads
        return first_head + head_in_cta, kv_head, (first_head, head_in_cta)

    def _sequence(self, cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, warp) -> tuple:
        """The CTA's place in the grid and its sequence -> (``warp``'s query head, KV head, the CTA's heads as
        `_heads` gives them, batch index, the sequence's first query, its queries, its keys, the CTA's first row)."""
        block_head, m_block, batch = prefill_grid.cta(cute.arch.block_idx(), cute.arch.grid_dim())
        head, kv_head, cta_heads = self._heads(block_head, warp)
        q_start = cu_seqlens_q[batch]
        q_len = cu_seqlens_q[batch + 1] - q_start
        kv_len = seq_lens_k[batch]
        return head, kv_head, cta_heads, batch, q_start, q_len, kv_len, m_block * self.block_m

    def _warp_row(self, warp):
        """First query row of ``warp`` within its block of rows."""
        return (warp // self.heads) * sl.WARP_ROWS

    def _walk(self, num_tiles, common, cta_row0, q_len, kv_len, g, tile_keys: int):
        """(tiles the CTA walks, leading keys all its rows see, tiles this warp's rows see) from this warp's
        `prefill_tile.warp_plan`: the CTA walks the ``tile_keys``-key tiles its last row sees."""
        cta_tiles, cta_common = num_tiles, common
        if self.row_blocks > 1:
            cta_tiles, _, cta_common = tile_math.warp_plan(cta_row0, q_len, kv_len, g, causal=self.causal,
                                                           tile_keys=tile_keys, warp_rows=self.block_m)
            cta_tiles = Int32(cta_tiles)
        return cta_tiles, cta_common, num_tiles

    # --- 32-key tiles of the paged cache into a ring stage ---------------------------------------------------------

    def _page_entry(self, table_row, tile_index):
        """Address of the page-table entry of 32-key tile ``tile_index``."""
        return table_row + Int64((tile_index * sl.TILE_KEYS) >> self.page_shift) * 4

    @cute.jit
    def _fetch_page(self, page: cute.Tensor, table_row, tile_index):
        """Request the page-table entry of ``tile_index`` (nothing read when it is negative: no tile left)."""
        page[0] = Int32(load_u32_if(self._page_entry(table_row, cutlass.max(tile_index, 0)),
                                    Uint32(tile_index >= 0)))

    def _cache_sources(self, cache, kv_head, group_first):
        """(first byte, first slot) of KV head ``kv_head``'s rows of each cache array (`_copy_tile`'s ``sources``):
        the head's bytes of slot 0 in the token-major K codes and V, the arrays from the head's slot 0 in the
        head-major K scales and Delta_S (from the word holding query head ``group_first`` of the group)."""
        k_codes, k_scales, v, delta_s = cache
        head_slot = kv_head * k_scales.shape[1]
        return ((k_codes.iterator.toint() + kv_head * sl.K_ROW_BYTES, 0),
                (v.iterator.toint() + kv_head * HEAD_DIM, 0),
                (k_scales.iterator.toint(), head_slot),
                (delta_s.iterator.toint() + 4 * sl.ds_first_word(group_first), head_slot))

    @cute.jit
    def _copy_tile(self, tile_index, page, stage, kv_len, tid, warp, sources, ragged: cutlass.Constexpr):
        """cp.async the KV head's bytes of 32-key tile ``tile_index`` into ``stage`` by 4 warps (``tid``, ``warp``
        numbered among them), every warp its slots of each array (`prefill_staged_layout.copy_plan`; Delta_S only
        with ``compensate``); keys past ``kv_len`` copy 0 bytes (zero fill; ``ragged`` false: the tile is known to
        be whole). A tile never straddles pages."""
        tile = tile_index * sl.TILE_KEYS
        slot0 = Int64(page) * self.page_size + (tile & (self.page_size - 1))
        left = kv_len - tile  # key k of the tile exists iff k < left
        hkv = self.num_kv_heads
        strides = (hkv * sl.K_ROW_BYTES, hkv * HEAD_DIM, sl.SCALE_ROW_BYTES, self.ds_row * 2)  # cache rows per slot
        copies = {16: cp_async_16, 8: cp_async_8, 4: cp_async_4}
        rows = {name: (stride, source + (slot0 + first_slot) * stride)  # the tile's first cache row of each array
                for (name, _, _, _), stride, (source, first_slot) in zip(sl.copy_arrays(self.heads), strides, sources)}
        warps = sl.CTA_WARPS
        for (name, _, size, copy_map), r, first_warp, end_warp in sl.copy_plan(self.heads, self.compensate):
            stride, first = rows[name]
            key, offset, smem_offset = copy_map(tid, r)
            src_bytes = Uint32(cutlass.select_(key < left, size, 0)) if ragged else Uint32(size)
            address = first + Int64(key * stride + offset)
            if cutlass.const_expr(first_warp == 0 and end_warp == warps):
                copies[size](stage + smem_offset, address, src_bytes)
            else:
                if Uint32(warp - first_warp) < Uint32(end_warp - first_warp):  # warp-uniform
                    copies[size](stage + smem_offset, address, src_bytes)
