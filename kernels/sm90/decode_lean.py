"""Split-KV decode v4: v2 (`decode_pipelined`, 2-stage cp.async ring, 12 one-warp CTAs per SM) with fewer
instructions per tile. The split kernel is bound by its warps' issue (profiles/NOTES.md, "Decode v3"), so v4
keeps v2's grid, tiling, fragment maps and shared-memory ring and removes instructions:

* **Copies** (pages of >= 32 keys, as served): a tile lies in one page, so each of the four streams (K codes,
  K scale words, Delta_S words, V) has one per-lane row address per tile (one 64-bit multiply-add from the tile's
  slot) and every key's copy is that address plus a compile-time offset folded into the instruction; tiles
  other than the partition's last are whole, so their copies share one predicate (the tile exists) through
  cp.async's ignore-src operand instead of a clamped slot, a compare and two selects per key. Keys past the end
  (only in the partition's last tile, computed first) are masked in a peeled first step.
* **K expansion**: a word's 8 e2m1 codes become two words of FP16 high bytes (3-4 logic ops each) and each f16x2
  register is one byte pick (`decode_layout.e2m1_high_bytes`); the same registers as v2. The K block scales are
  one byte permute and two e4m3 -> f16x2 conversions per key chunk; the 2**7 of v2's K operand is left out, so
  the MMA yields S * 2**-14 (`score_scale_log2`) and lambda takes the 2**7.
* **PV** on FP16 ``m16n8k16`` directly instead of the e4m3 ``m16n8k32`` that ptxas lowers for sm_90 to byte
  unpacks + 2 HMMA from a zero accumulator + 4 FADD: V needs only a 2x2 byte transpose (one prmt per 4 values)
  before the same e4m3 -> f16x2 unpacks, and the HMMAs accumulate into O.

Numerics: the QK^T operands are v2's registers scaled by exactly 2**-7 (S, P, m and l as v2's, up to the tensor
core's handling of a power-of-two rescaling, which is exact); PV multiplies the same e4m3 values, but adds the
tile's products to O inside the MMA instead of after it (another FP32 rounding order).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90.decode import HEAD_DIM, K_ROW_BYTES, LANE_KEYS, SCALE_ROW_BYTES
from mpfa.kernels.sm90.decode_pipelined import STAGE_BYTES, WORDS_OFFSET, SplitKVDecodeSm90Pipelined
from mpfa.kernels.sm90.ptx import (
    bits_to_f32,
    cp_async_4_at,
    cp_async_16_at,
    cp_async_commit,
    cp_async_wait,
    e4m3x2_hi_to_f16x2,
    e4m3x2_to_f16x2,
    f32x2_to_e4m3x2_f16x2,
    load_u32,
    load_shared_u32_at,
    load_shared_v4_u32_at,
    mma_f16_m16n8k16,
    mul_f16x2,
    prmt,
    prmt_var,
    shuffle_idx,
)
from mpfa.kernels.sm90.warp_mma import P_SCALE

SCORE_SCALE_LOG2 = 14  # K enters the MMA as e2m1 * 2**-14 * scale: S * 2**-14
MINUS_INF = -math.inf


class SplitKVDecodeSm90Lean(SplitKVDecodeSm90Pipelined):
    """Decode v4: `SplitKVDecodeSm90Pipelined` at 2 stages with `_run_tiles` rebuilt from cheaper pieces (module
    docstring); pages of < 32 keys keep v2's per-key copies (`_fetch_slots`, `_copy_tile`)."""

    score_scale_log2 = SCORE_SCALE_LOG2

    def __init__(self, num_kv_heads: int, group: int, page_size: int, compensate: bool = True) -> None:
        super().__init__(num_kv_heads, group, page_size, 2, compensate)
        self.page_copies = page_size >= lay.TILE_KEYS  # a tile lies in one page: one slot per tile

    @cute.jit
    def _run_tiles(self, q_regs, state: cute.Tensor, acc: cute.Tensor, cache, page_table: cute.Tensor,
                   lam_scaled: Float32, batch_idx, kv_head, row_valid, start, end, lane, g, c):
        """v2's loop (copy tile t - 1 while tile t is computed) with the first tile computed (the partition's
        last, the only one that may extend past the sequence end) peeled off as the one with masked keys."""
        k_codes, k_scales, v, delta_s = cache
        lam = lam_scaled * Float32(2.0 ** (SCORE_SCALE_LOG2 - lay.SCORE_SCALE_LOG2))
        head_slot = Int64(kv_head * k_scales.shape[1])
        ds_word = cutlass.select_(row_valid, (g * 2) & ~3, 0)
        if cutlass.const_expr(self.page_copies):
            # Row addresses at slot 0 of the lane's first key in a tile: key g (K codes, scales), key 2c (V, Delta_S).
            bases = (
                k_codes.iterator.toint() + kv_head * K_ROW_BYTES + 16 * c + Int64(g * (self.num_kv_heads * K_ROW_BYTES)),
                k_scales.iterator.toint() + head_slot * SCALE_ROW_BYTES + 4 * (c >> 1) + g * SCALE_ROW_BYTES,
                delta_s.iterator.toint() + head_slot * (self.ds_row * 2) + ds_word + 2 * c * (self.ds_row * 2),
                v.iterator.toint() + kv_head * HEAD_DIM + 16 * g + Int64(2 * c * (self.num_kv_heads * HEAD_DIM)),
            )
        else:
            bases = (
                k_codes.iterator.toint() + kv_head * K_ROW_BYTES + 16 * c,
                k_scales.iterator.toint() + head_slot * SCALE_ROW_BYTES + 4 * (c >> 1),
                delta_s.iterator.toint() + head_slot * (self.ds_row * 2) + ds_word,
                v.iterator.toint() + kv_head * HEAD_DIM + 16 * g,
            )
        smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16).toint()
        lane_chunk = smem + lane * 16
        lane_word = smem + WORDS_OFFSET + lane * 4
        selectors = (Uint32(lay.scale_pair_selector(c)), Uint32(lay.delta_s_selector(g)))

        num_tiles = (cutlass.max(end - start, 0) + lay.TILE_KEYS - 1) // lay.TILE_KEYS
        last_tile = start + (num_tiles - 1) * lay.TILE_KEYS
        slots = cute.make_rmem_tensor((LANE_KEYS,), Int32)
        self._fetch_slots(slots, page_table, batch_idx, last_tile, end, g, c)
        self._copy(slots, last_tile, end, num_tiles > 0, True, row_valid, g, c, bases, Int32(0), lane_chunk,
                   lane_word)
        cp_async_commit()
        self._fetch_slots(slots, page_table, batch_idx, last_tile - lay.TILE_KEYS, end, g, c)
        if num_tiles > 0:
            self._step(Int32(0), num_tiles, last_tile, Int32(0), True, slots, page_table, batch_idx, q_regs, state,
                       acc, lam, row_valid, end, g, c, bases, lane_chunk, lane_word, selectors)
        stage = Int32(STAGE_BYTES)  # the stage of tile ``step``
        for step in cutlass.range(1, num_tiles, unroll=1):
            self._step(step, num_tiles, last_tile - step * lay.TILE_KEYS, stage, False, slots, page_table, batch_idx,
                       q_regs, state, acc, lam, row_valid, end, g, c, bases, lane_chunk, lane_word, selectors)
            stage = stage ^ Int32(STAGE_BYTES)
        cp_async_wait(0)

    @cute.jit
    def _fetch_slots(self, slots: cute.Tensor, page_table: cute.Tensor, batch_idx: Int32, tile: Int32, end: Int32,
                     g: Int32, c: Int32):
        """With pages of >= 32 keys only the tile's first slot (`decode_layout.tile_page_base`; a tile before the
        sequence start gets the first page's); v2's per-key slots otherwise."""
        if cutlass.const_expr(self.page_copies):
            row = page_table.iterator.toint() + Int64(batch_idx) * page_table.stride[0] * 4
            slots[0] = lay.tile_page_base(lambda index: Int32(load_u32(row + Int64(index) * 4)), tile, end,
                                          self.page_shift, cutlass.max, cutlass.min)
        else:
            super()._fetch_slots(slots, page_table, batch_idx, tile, end, g, c)

    @cute.jit
    def _step(self, step, num_tiles, tile, stage, masked: cutlass.Constexpr, slots, page_table, batch_idx, q_regs,
              state, acc, lam, row_valid, end, g, c, bases, lane_chunk, lane_word, selectors):
        """One tile: copy tile ``step + 1`` into the other stage, then compute tile ``step`` from ``stage``."""
        self._copy(slots, tile - lay.TILE_KEYS, end, step + 1 < num_tiles, False, row_valid, g, c, bases,
                   stage ^ Int32(STAGE_BYTES), lane_chunk, lane_word)
        cp_async_commit()
        self._fetch_slots(slots, page_table, batch_idx, tile - 2 * lay.TILE_KEYS, end, g, c)
        cp_async_wait(1)
        k_words, k_scale_words, ds, v_rows = self._read(stage, lane_chunk, lane_word, selectors[1])
        if cutlass.const_expr(masked):
            for n_tile in cutlass.range_constexpr(lay.N_TILES):
                for half in cutlass.range_constexpr(2):
                    valid = tile + lay.score_key(n_tile, c, half) < end
                    ds[2 * n_tile + half] = Float32(cutlass.select_(valid, ds[2 * n_tile + half], Float32(MINUS_INF)))
        scores = self._qk(q_regs, k_words, k_scale_words, ds, selectors[0])
        probs, alpha = self._softmax_probs(scores, state, row_valid, lam)
        self._pv(probs, alpha, acc, v_rows, c)

    @cute.jit
    def _copy(self, slots, tile, end, active, partial: cutlass.Constexpr, row_valid, g, c, bases, stage, lane_chunk,
              lane_word):
        """cp.async the lane's bytes of ``tile`` into ``stage`` (nothing when ``active`` is false). ``partial``: the
        tile may extend past the end (keys there copy nothing), else every key of an active tile is copied."""
        if cutlass.const_expr(not self.page_copies):
            self._copy_tile([slots[i] for i in range(LANE_KEYS)], tile, end, active, row_valid, g, c, bases, stage,
                            lane_chunk, lane_word)
        else:
            k_base, ks_base, ds_base, v_base = bases
            slot = Int64(slots[0])  # the tile's first slot (`tile_page_base`); key k is slot + k
            k_row = k_base + slot * (self.num_kv_heads * K_ROW_BYTES)
            ks_row = ks_base + slot * SCALE_ROW_BYTES
            ds_row = ds_base + slot * (self.ds_row * 2)
            v_row = v_base + slot * (self.num_kv_heads * HEAD_DIM)
            chunk = lane_chunk + stage
            word = lane_word + stage
            present = Uint32(active)
            ds_present = Uint32(active & row_valid)
            for n_tile in cutlass.range_constexpr(lay.N_TILES):
                valid = present
                if cutlass.const_expr(partial):
                    valid = Uint32(active & (tile + lay.qk_key(n_tile, g) < end))
                key = 8 * n_tile  # + g, in the base
                cp_async_16_at(chunk, n_tile * 512, k_row, key * self.num_kv_heads * K_ROW_BYTES, valid)
                cp_async_4_at(word, n_tile * 128, ks_row, key * SCALE_ROW_BYTES, valid)
            for n_tile in cutlass.range_constexpr(lay.N_TILES):
                for half in cutlass.range_constexpr(2):
                    unit = lay.N_TILES + 2 * n_tile + half
                    key = 8 * n_tile + half  # + 2c, in the base
                    valid = present
                    ds_valid = ds_present
                    if cutlass.const_expr(partial):
                        inside = tile + lay.score_key(n_tile, c, half) < end
                        valid = Uint32(active & inside)
                        ds_valid = Uint32(active & inside & row_valid)
                    cp_async_16_at(chunk, unit * 512, v_row, key * self.num_kv_heads * HEAD_DIM, valid)
                    if cutlass.const_expr(self.compensate):
                        cp_async_4_at(word, unit * 128, ds_row, key * self.ds_row * 2, ds_valid)

    @cute.jit
    def _read(self, stage, lane_chunk, lane_word, ds_selector):
        """The tile's operands from shared memory: K chunks, K scale words, Delta_S * 2**-14 in FP32 (0 for the
        direct build; missing keys read 0), V chunks."""
        chunk = lane_chunk + stage
        word = lane_word + stage
        k_words, k_scale_words, ds, v_rows = [], [], [], []
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            k_words.append(load_shared_v4_u32_at(chunk, n_tile * 512))
            k_scale_words.append(load_shared_u32_at(word, n_tile * 128))
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            for half in cutlass.range_constexpr(2):
                unit = lay.N_TILES + 2 * n_tile + half
                value = Float32(0.0)
                if cutlass.const_expr(self.compensate):
                    # the BF16 of head g (low or high half of the word) into the high half: its FP32
                    bits = prmt_var(load_shared_u32_at(word, unit * 128), Uint32(0), ds_selector)
                    value = bits_to_f32(bits) * Float32(2.0 ** -SCORE_SCALE_LOG2)
                ds.append(value)
                v_rows.append(load_shared_v4_u32_at(chunk, unit * 512))
        return k_words, k_scale_words, ds, v_rows

    @cute.jit
    def _qk(self, q_regs, k_words, k_scale_words, ds, scale_selector):
        """Scores [n-tile][half] = S * 2**-14 (v2's `_qk_tile` with the cheaper K expansion)."""
        scores = []
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            pair = prmt_var(k_scale_words[n_tile], k_scale_words[n_tile], scale_selector)
            blocks = (e4m3x2_to_f16x2(pair), e4m3x2_hi_to_f16x2(pair))
            regs = []
            for word in cutlass.range_constexpr(4):
                high_bytes = [lay.e2m1_high_bytes(k_words[n_tile][word], low) for low in (True, False)]
                for j in cutlass.range_constexpr(4):
                    t = high_bytes[j % 2]
                    picked = prmt(t, Uint32(0), lay.PICK_EVEN_BYTES) if j < 2 else t & Uint32(lay.PICK_ODD_BYTES)
                    regs.append(mul_f16x2(picked, blocks[word // 2]))
            c_regs = [ds[2 * n_tile], ds[2 * n_tile + 1], Float32(0.0), Float32(0.0)]
            for k_step in cutlass.range_constexpr(lay.K_STEPS_QK):
                r0, r1 = lay.qk_step_regs(k_step)
                c_regs = mma_f16_m16n8k16([q_regs[r0], Uint32(0), q_regs[r1], Uint32(0)], [regs[r0], regs[r1]],
                                          c_regs)
            scores.append([c_regs[0], c_regs[1]])
        return scores

    @cute.jit
    def _pv(self, probs, alpha, acc: cute.Tensor, v_rows, c):
        """acc = alpha * acc + e4m3(448 P) V on FP16 MMAs: per m-tile two m16n8k16 over keys (j0, j1) and (j2, j3)
        of both 16-key halves (the k-order ptxas gives the e4m3 m16n8k32 it replaces)."""
        alpha_heads = (shuffle_idx(alpha, Uint32(8 * c)), shuffle_idx(alpha, Uint32(8 * c + 4)))
        if cute.arch.vote_any_sync((alpha_heads[0] != Float32(1.0)) | (alpha_heads[1] != Float32(1.0))):
            for i in cutlass.range_constexpr(lay.M_TILES * 4):
                acc[i] = acc[i] * alpha_heads[i % 2]
        p = [f32x2_to_e4m3x2_f16x2(probs[2 * n] * Float32(P_SCALE), probs[2 * n + 1] * Float32(P_SCALE))
             for n in range(lay.N_TILES)]
        b_regs = ([p[0], p[2]], [p[1], p[3]])  # keys j0, j1 / j2, j3 of both halves (n-tiles 0, 2 / 1, 3)
        sel_lo, sel_hi = lay.transpose_selectors()[:2]
        # pairs[k_half][jj][word][which]: dims 4 word + 2 which, + 1 of keys (j 2jj, 2jj + 1): bytes d0k0 d0k1 d1k0 d1k1
        pairs = [[[[prmt(v_rows[4 * k_half + 2 * jj][word], v_rows[4 * k_half + 2 * jj + 1][word], sel)
                    for sel in (sel_lo, sel_hi)] for word in range(4)] for jj in range(2)] for k_half in range(2)]
        for m_tile in cutlass.range_constexpr(lay.M_TILES):
            word, which = divmod(m_tile, 2)  # dims 2 m_tile, 2 m_tile + 1
            c_regs = [acc[4 * m_tile + i] for i in range(4)]
            for jj in cutlass.range_constexpr(2):
                a_regs = []
                for k_half in cutlass.range_constexpr(2):
                    x = pairs[k_half][jj][word][which]
                    a_regs += [e4m3x2_to_f16x2(x), e4m3x2_hi_to_f16x2(x)]
                c_regs = mma_f16_m16n8k16(a_regs, b_regs[jj], c_regs)
            for i in cutlass.range_constexpr(4):
                acc[4 * m_tile + i] = c_regs[i]
