"""Split-KV decode v2: `SplitKVDecodeSm90` with a per-lane cp.async (global -> shared) double buffer.

Same grid, tiling, numerics and outputs as v1 (`decode.py`; the reference is still
`mpfa.kernels.reference.decode_partials(..., block_n=32)`); only the way a tile's bytes reach the registers
changes. v1 loaded each 32-key tile straight into registers at the top of the tile, so every tile paid the full
DRAM latency and only other warps covered it. v2 copies tile t - 1 (K codes, scale words, Delta_S words, V) into
shared memory with cp.async while tile t is computed, then reads tile t back from shared memory:

* every lane copies exactly the bytes it will consume (same fragment map as v1, `decode_layout`) into its own
  shared-memory words and reads only those back, so `cp.async.wait_group` is the only synchronisation (no
  barrier, no cross-lane hazard, no bank conflict: lane-contiguous 16-byte / 4-byte units);
* keys past the sequence end (and the tile before the partition's first) copy 0 bytes: cp.async zero-fills, which
  is what v1's predicated loads returned (Delta_S then becomes -inf for the missing keys, as in v1);
* the 2-byte K-scale and Delta_S values travel as the aligned 4-byte word holding them (cp.async's smallest size)
  and are picked out afterwards (the cache's K-scale and Delta_S rows are 8 or 16 bytes, so every word is
  aligned, for any group).

Per stage and warp: 12 x 512 B (4 K chunks + 8 V chunks per lane) + 12 x 128 B (words) = 7,680 B; two stages are
15 KB, so the 12 warps per SM that 167 registers allow need 180 KB of the 227 KB.

``stages``: 2 (v2) or 3 (decode v3: two tiles in flight while one is computed, 22.5 KB per warp, 9 warps per SM;
`decode_launch.warps_per_sm` sizes the partitions for it). A warp is a serial chain; with 2 stages its next tile
is requested only when the current one starts, so a tile's compute and its successor's DRAM latency do not
overlap across more than one tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90.decode import (
    BF16_MINUS_INF,
    HEAD_DIM,
    K_ROW_BYTES,
    LANE_KEYS,
    SCALE_ROW_BYTES,
    SplitKVDecodeSm90,
)
from mpfa.kernels.sm90.ptx import (
    cp_async_4,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    load_shared_u32,
    load_shared_v4_u32,
)

STAGES = 2  # v2; v3 runs 3
CHUNK_UNITS = lay.N_TILES + 2 * lay.N_TILES  # 16-byte units per lane and stage: K chunks, then V chunks
WORD_UNITS = lay.N_TILES + 2 * lay.N_TILES  # 4-byte words per lane and stage: K-scale words, then Delta_S words
WORDS_OFFSET = CHUNK_UNITS * 32 * 16
STAGE_BYTES = WORDS_OFFSET + WORD_UNITS * 32 * 4
SMEM_BYTES = STAGES * STAGE_BYTES


class SplitKVDecodeSm90Pipelined(SplitKVDecodeSm90):
    """v2 / v3 of the split-KV decode kernel (`SplitKVDecodeSm90`'s constructor plus ``stages``, same call
    signature and outputs): v1's kernel with its tile loop, `_run_tiles`, replaced."""

    tile_page_reads = True

    def __init__(self, num_kv_heads: int, group: int, page_size: int, stages: int = STAGES,
                 compensate: bool = True) -> None:
        if stages not in (2, 3):
            raise ValueError(f"the pipelined decode runs 2 or 3 stages, got {stages}")
        super().__init__(num_kv_heads, group, page_size, compensate)
        self.stages = stages
        self.smem_bytes = stages * STAGE_BYTES

    @cute.jit
    def _run_tiles(self, q_regs, state: cute.Tensor, acc: cute.Tensor, cache, page_table: cute.Tensor,
                   lam_scaled: Float32, batch_idx, kv_head, row_valid, start, end, lane, g, c):
        """v1's tile loop with each tile's bytes copied into shared memory (cp.async) while the previous tile is
        computed, then read back from there."""
        k_codes, k_scales, v, delta_s = cache
        # Per-lane global bases (+ slot * row stride per key): the 16-byte K chunk c, the aligned scale word holding
        # blocks 2c and 2c + 1, the aligned Delta_S word holding head g of the group (word 0 for padding rows:
        # never read), V chunk g. K scales and Delta_S are head-major: the KV head's slot 0 is row head_slot.
        head_slot = Int64(kv_head * k_scales.shape[1])
        bases = (
            k_codes.iterator.toint() + kv_head * K_ROW_BYTES + 16 * c,
            k_scales.iterator.toint() + head_slot * SCALE_ROW_BYTES + 4 * (c >> 1),
            delta_s.iterator.toint() + head_slot * (self.ds_row * 2) + cutlass.select_(row_valid, (g * 2) & ~3, 0),
            v.iterator.toint() + kv_head * HEAD_DIM + 16 * g,
        )
        smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16).toint()
        chunks = (smem + lay.k_stage_offset(g, c), smem + lay.v_stage_offset(g, c))  # the lane's K and V chunks
        lane_word = smem + WORDS_OFFSET + lane * 4
        scale_shift = Uint32(16 * (c & 1))
        ds_shift = Uint32(16 * (g & 1))

        num_tiles = (cutlass.max(end - start, 0) + lay.TILE_KEYS - 1) // lay.TILE_KEYS
        last_tile = start + (num_tiles - 1) * lay.TILE_KEYS
        ahead = self.stages - 1  # tiles in flight while one is computed
        slots = cute.make_rmem_tensor((LANE_KEYS,), Int32)
        # Prologue: tiles 0 .. ahead - 1 in flight (stages 0 ..), tile ahead's slots requested.
        for i in cutlass.range_constexpr(ahead):
            self._fetch_slots(slots, page_table, batch_idx, last_tile - i * lay.TILE_KEYS, end, g, c)
            tile_slots = [slots[j] for j in range(LANE_KEYS)]
            self._copy_tile(tile_slots, last_tile - i * lay.TILE_KEYS, end, num_tiles > i, row_valid, g, c, bases,
                            Int32(i * STAGE_BYTES), chunks, lane_word)
            cp_async_commit()
        self._fetch_slots(slots, page_table, batch_idx, last_tile - ahead * lay.TILE_KEYS, end, g, c)
        stage = Int32(0)  # the stage of tile ``step``
        for step in cutlass.range(num_tiles, unroll=1):
            tile = last_tile - step * lay.TILE_KEYS
            ahead_slots = [slots[i] for i in range(LANE_KEYS)]
            # tile step + ahead goes to the stage tile step - 1 used (read back into registers last iteration)
            ahead_stage = cutlass.select_(stage == 0, Int32(ahead * STAGE_BYTES), stage - STAGE_BYTES)
            self._copy_tile(ahead_slots, tile - ahead * lay.TILE_KEYS, end, step + ahead < num_tiles, row_valid, g,
                            c, bases, ahead_stage, chunks, lane_word)
            cp_async_commit()
            self._fetch_slots(slots, page_table, batch_idx, tile - (ahead + 1) * lay.TILE_KEYS, end, g, c)
            cp_async_wait(ahead)  # this tile's group has landed (the later tiles' may still be in flight)
            k_words, k_scales_raw, ds_bits, v_rows = self._read_tile(
                tile, end, row_valid, g, c, stage, chunks, lane_word, scale_shift, ds_shift)
            scores = self._qk_tile(q_regs, k_words, k_scales_raw, ds_bits)
            p_regs, alpha = self._online_softmax(scores, state, row_valid, lam_scaled)
            self._pv_tile(p_regs, alpha, acc, v_rows, c)
            stage = cutlass.select_(stage == ahead * STAGE_BYTES, Int32(0), stage + STAGE_BYTES)
        cp_async_wait(0)

    @cute.jit
    def _copy_tile(self, tile_slots, tile, end, active, row_valid, g, c, bases, stage, chunks, lane_word):
        """cp.async the lane's bytes of ``tile`` into ``stage``; 0 bytes (zero fill) for keys past the end, and for
        everything when ``active`` is false (no tile left)."""
        k_base, ks_base, ds_base, v_base = bases
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            valid = active & (tile + lay.qk_key(n_tile, g) < end)
            slot = Int64(tile_slots[n_tile])
            cp_async_16(chunks[0] + stage + n_tile * 512, k_base + slot * (self.num_kv_heads * K_ROW_BYTES),
                        Uint32(cutlass.select_(valid, 16, 0)))
            cp_async_4(lane_word + stage + n_tile * 128, ks_base + slot * SCALE_ROW_BYTES,
                       Uint32(cutlass.select_(valid, 4, 0)))
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            for half in cutlass.range_constexpr(2):
                unit = lay.N_TILES + 2 * n_tile + half
                valid = active & (tile + lay.score_key(n_tile, c, half) < end)
                slot = Int64(tile_slots[unit])
                cp_async_16(chunks[1] + stage + unit * 512, v_base + slot * (self.num_kv_heads * HEAD_DIM),
                            Uint32(cutlass.select_(valid, 16, 0)))
                if cutlass.const_expr(self.compensate):
                    cp_async_4(lane_word + stage + unit * 128, ds_base + slot * (self.ds_row * 2),
                               Uint32(cutlass.select_(valid & row_valid, 4, 0)))

    @cute.jit
    def _read_tile(self, tile, end, row_valid, g, c, stage, chunks, lane_word, scale_shift, ds_shift):
        """The tile's operands from shared memory, in v1's `_load_tile` form (Delta_S = -inf past the end)."""
        k_words, k_scales_raw, ds_bits, v_rows = [], [], [], []
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            k_words.append(load_shared_v4_u32(chunks[0] + stage + n_tile * 512))
            word = load_shared_u32(lane_word + stage + n_tile * 128)
            k_scales_raw.append((word >> scale_shift) & Uint32(0xFFFF))
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            for half in cutlass.range_constexpr(2):
                unit = lay.N_TILES + 2 * n_tile + half
                valid = tile + lay.score_key(n_tile, c, half) < end
                bits = Uint32(0)  # the direct build: Delta_S = 0
                if cutlass.const_expr(self.compensate):
                    bits = (load_shared_u32(lane_word + stage + unit * 128) >> ds_shift) & Uint32(0xFFFF)
                ds_bits.append(Uint32(cutlass.select_(valid, bits, Uint32(BF16_MINUS_INF))))
                v_rows.append(load_shared_v4_u32(chunks[1] + stage + unit * 512))
        return k_words, k_scales_raw, ds_bits, v_rows
