"""The fp8 prefill kernel's operand pass: once per prefill, every 64-key tile of every KV head expanded from the
cache into an **operand image** in global memory (`prefill_fp8_layout.image_bytes`), which the attention kernel
(`prefill_fp8`) copies into its operand stages as it is.

One 128-thread CTA per (tile, KV head, sequence): cp.async of the raw tile into a ring stage (the 4-warp copy plan
of `prefill_staged_layout`, both 32-key halves, the whole group's Delta_S), then the K expansion to the e4m3 operand
tile with the tile's power-of-two exponent (`prefill_fp8_layout.fp8_chunk_words`, e2m1 decoded by table look-up),
the V transpose to V^T (``ldmatrix.trans`` / byte permutes / ``stmatrix``), the Delta_S of every query head of the
KV head widened to FP32 in the consumers' order, V^T's row-sum rows and the exponent, all in shared memory; then the
image is stored to global memory. The images: uint8 [KV heads x ``rows_per_head``, `image_bytes`(group)]
(`prefill_fp8_layout.image_row`): each KV head's block holds every sequence's tiles, sequence b's from row
``image_starts[b]`` = the tiles of the sequences before it (int32 [B], on the device:
`prefill_launch.image_layout`). A tile past a sequence's end is not written and never read. The direct build
(``compensate=False``) leaves the images' Delta_S unwritten (the attention kernel does not read it).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from . import prefill_staged_layout as sl
from .prefill_base import HEAD_DIM
from .prefill_fp8_layout import (BLOCKS, BLOCKS_PER_WARP_STEP, E4M3_ONES, EVEN_BYTES, FP8_OPERAND_BYTES, IMAGE_BYTES,
                                 ODD_BYTES, ROW_SUM_UNITS, VT_BYTES, ds_staged_offset, e2m1_word_f16x2_lut,
                                 exponent_offset, fold_max, fp8_chunk_words, fp8_operand_offset, image_bytes, image_row,
                                 k_expand_unit, max_scale_pairs, pow2_factors, v_load_lane, v_store_lane, vt_offset)
from .prefill_wgmma import HALVES, OPERAND_ALIGN, THREADS, TILE_KEYS, PrefillSm90Wgmma
from .ptx import (cp_async_commit, cp_async_wait, e4m3_pow2_exponent, ldmatrix_x4_trans, load_shared_v4_u32, load_u32,
                  prmt, stmatrix_x4, store_v4_u32)
from .smem_pipeline import load_shared_u16, store_shared_u32, store_shared_v2_u32, store_shared_v4_u32

UNITS_PER_THREAD = IMAGE_BYTES // 16 // THREADS  # 16-byte units of an 18 KB image per thread: 9 (groups 1-5)
PASS_BARRIER = 1  # the CTA's named barrier (128 threads)


class OperandPass(PrefillSm90Wgmma):
    """The operand pass (module docstring) for the fp8 kernel's shapes (`prefill_wgmma.PrefillSm90Wgmma`): the ring
    stage copies and stages the whole GQA group (``heads`` = the group); one warpgroup fills the image. Shared
    memory: the image, then one 64-key ring stage."""

    name = "fp8"
    _unit_offset = staticmethod(fp8_operand_offset)
    _k_unit = staticmethod(k_expand_unit)

    def __init__(self, num_kv_heads: int, group: int, page_size: int, compensate: bool = True):
        super().__init__(num_kv_heads, group, page_size, True, compensate=compensate)
        assert IMAGE_BYTES == 16 * THREADS * UNITS_PER_THREAD
        self.heads = group  # the ring copies and stages the whole group's Delta_S
        self.image_bytes = image_bytes(group)  # 18 KB, 19 KB at groups 6-8: a multiple of 1 KB, not of 2 KB
        self.image_units = self.image_bytes // 16  # 16-byte units, stored by the threads in turn
        self.stage_bytes = sl.stage_bytes(self.heads, self.compensate)
        self.tile_bytes = HALVES * self.stage_bytes
        self.fill_warpgroups = 1
        self.offsets = (0, 0, FP8_OPERAND_BYTES, self.image_bytes)  # (-, the image's K, its V^T, the ring stage)
        self.smem_bytes = self.image_bytes + self.tile_bytes

    @cute.jit
    def __call__(self, k_codes: cute.Tensor, k_scales: cute.Tensor, v: cute.Tensor, delta_s: cute.Tensor,
                 page_table: cute.Tensor, seq_lens_k: cute.Tensor, image_starts: cute.Tensor, images: cute.Tensor,
                 rows_per_head: Int32, max_tiles: Int32, stream):
        """``max_tiles``: the grid's tiles per sequence (>= the longest's; the CTAs past a sequence's end exit)."""
        self.kernel(k_codes, k_scales, v, delta_s, page_table, seq_lens_k, image_starts, images,
                    rows_per_head).launch(grid=(max_tiles, self.num_kv_heads, seq_lens_k.shape[0]),
                                          block=(THREADS, 1, 1), smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, k_codes: cute.Tensor, k_scales: cute.Tensor, v: cute.Tensor, delta_s: cute.Tensor,
               page_table: cute.Tensor, seq_lens_k: cute.Tensor, image_starts: cute.Tensor, images: cute.Tensor,
               rows_per_head: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile_index, kv_head, batch = cute.arch.block_idx()
        kv_len = seq_lens_k[batch]
        if tile_index * TILE_KEYS < kv_len:
            threads = (tid, 0, tid, tid >> 5)  # (tid, warpgroup, thread and warp in it)
            sources = self._cache_sources((k_codes, k_scales, v, delta_s), kv_head, 0)
            table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
            smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN).toint()
            ring = smem + self.offsets[3]
            page = Int32(load_u32(self._page_entry(table_row, HALVES * tile_index)))
            self._copy_wgmma_tile(tile_index, page, ring, kv_len, threads, sources, True)
            cp_async_commit()
            cp_async_wait(0)
            cute.arch.barrier(barrier_id=PASS_BARRIER, number_of_threads=THREADS)  # every thread's copies landed
            e = self._expand_k(ring, threads, smem)
            self._expand_v(ring, threads, smem)
            self._stage_delta_s(ring, threads, smem)
            if tid < ROW_SUM_UNITS:
                self._store_row_sum_unit(smem, tid)
            if tid == 0:
                store_shared_u32(smem + exponent_offset(self.group), (e + Uint32(127)) << 23)
            cute.arch.barrier(barrier_id=PASS_BARRIER, number_of_threads=THREADS)  # the image is whole
            row = images.iterator.toint() + image_row(image_starts[batch], kv_head, tile_index,
                                                      rows_per_head) * self.image_bytes
            for r in cutlass.range_constexpr(-(-self.image_units // THREADS)):
                if cutlass.const_expr(THREADS * (r + 1) <= self.image_units):
                    self._store_image_unit(smem, row, tid + THREADS * r)
                else:
                    if tid + THREADS * r < self.image_units:  # the 19 KB image's last half round
                        self._store_image_unit(smem, row, tid + THREADS * r)

    def _store_image_unit(self, smem, row, unit):
        """16-byte unit ``unit`` of the image, shared memory -> global row ``row``."""
        offset = 16 * unit
        words = load_shared_v4_u32(smem + offset)
        store_v4_u32(row + offset, words[0], words[1], words[2], words[3])

    def _expand_k(self, stage, threads, smem) -> Uint32:
        """The tile's K to e4m3 with the tile's power-of-two scale: each warp reduces the tile's 512 block scales
        (16 bytes per lane: lanes 0-15 the first 32-key half, 16-31 the second) to e_k, then the threads expand
        their K chunks (`k_expand_unit`) -> e_k."""
        lane = threads[0] & 31
        tile_scales = load_shared_v4_u32(stage + (lane >> 4) * self.stage_bytes + sl.SCALE_OFFSET + 16 * (lane & 15))
        e = e4m3_pow2_exponent(fold_max(max_scale_pairs(tile_scales), (1, 2, 4, 8, 16)))
        self._expand_k_chunks(stage, threads, smem, functools.partial(fp8_chunk_words, factors=pow2_factors(e),
                                                                      decode=e2m1_word_f16x2_lut))
        return e

    @cute.jit
    def _expand_v(self, stage, threads, smem):
        """The tile's e4m3 V [keys][dims] from the ring -> V^T [dims][k positions] (`prefill_fp8_layout.pv_key`
        order): per warp and round one ldmatrix.x4.trans, 4 byte permutes, one stmatrix.x4."""
        tid = threads[0]
        vt = smem + self.offsets[2]
        for r in cutlass.range_constexpr(BLOCKS // BLOCKS_PER_WARP_STEP // (THREADS // 32)):
            half, key, piece = v_load_lane(tid, r, THREADS)
            m = ldmatrix_x4_trans(stage + half * self.stage_bytes + sl.V_OFFSET + sl.V_ROW_BYTES * key
                                  + ((piece ^ sl.v_swizzle(key)) << 4))
            dim, unit = v_store_lane(tid, r, THREADS)
            stmatrix_x4(vt + vt_offset(dim, unit), prmt(m[0], m[1], EVEN_BYTES), prmt(m[0], m[1], ODD_BYTES),
                        prmt(m[2], m[3], EVEN_BYTES), prmt(m[2], m[3], ODD_BYTES))

    @cute.jit
    def _stage_delta_s(self, stage, threads, smem):
        """The tile's BF16 Delta_S (ring stage ``stage``, [key][head] per 32-key half) -> FP32 bits in the image, in
        the consumers' order (`ds_staged_offset`), in units of 2 keys of one head (unit u: head u / 32, keys
        2 (u % 32), + 1; one 8-byte store) taken by the threads in turn, so each consumer lane reads 4 keys'
        Delta_S with one 16-byte load, already FP32. Nothing in the direct build."""
        if cutlass.const_expr(self.compensate):
            units = self.heads * TILE_KEYS // 2
            for r in cutlass.range_constexpr(-(-units // THREADS)):
                unit = threads[0] + THREADS * r
                if cutlass.const_expr(THREADS * (r + 1) <= units):
                    self._stage_keys(stage, unit, smem)
                else:
                    if unit < units:
                        self._stage_keys(stage, unit, smem)

    def _stage_keys(self, stage, unit, smem):
        """Delta_S unit ``unit`` (`_stage_delta_s`)."""
        head = unit >> 5
        key = (unit & 31) << 1
        words = sl.ds_words(self.heads)
        source = stage + (key >> 5) * self.stage_bytes + sl.DS_OFFSET + 4 * words * (key & 31) + 2 * head
        target = smem + self.offsets[2] + VT_BYTES + ds_staged_offset(head, key)
        store_shared_v2_u32(target, load_shared_u16(source) << 16, load_shared_u16(source + 4 * words) << 16)

    def _store_row_sum_unit(self, smem, unit):
        """16-byte unit ``unit`` of V^T's rows 128 .. 135 (4 units a row: row 128's are e4m3 ones, the others
        zeros)."""
        word = Uint32(cutlass.select_(unit < TILE_KEYS // 16, Uint32(E4M3_ONES), Uint32(0)))
        store_shared_v4_u32(smem + self.offsets[2] + HEAD_DIM * TILE_KEYS + 16 * unit, word, word, word, word)
