"""Split-KV decode v4: v2 (`decode_pipelined`, 2-stage cp.async ring, one-warp CTAs) with fewer instructions
per tile. The split kernel is bound by its warps' issue (profiles/NOTES.md, "Decode v3"), so v4 keeps v2's grid,
tiling, loads and shared-memory ring and removes instructions (SASS per tile at page 128: 951 -> 646):

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
* **S^T = K Q^T**: the 32 keys fill M (two m-tiles of 16) and the group's heads N, so QK^T takes 16 MMAs instead
  of 32 and no zero padding rows; Q^T's B registers are v2's Q registers. Lane (g, c) ends with keys
  ``qk_key(n, g)`` (the ones whose K it loaded) for heads 2c, 2c + 1: Delta_S is one word per key (4 copies per
  tile instead of 8), the row maximum a 3-step butterfly over the lanes of one c, alpha needs no shuffle, and l
  is summed over the lanes once at the end. P^T reaches the PV MMA through 4 ``movmatrix`` transposes.
* **PV** on FP16 ``m16n8k16`` directly instead of the e4m3 ``m16n8k32`` that ptxas lowers for sm_90 to byte
  unpacks + 2 HMMA from a zero accumulator + 4 FADD: V needs only a 2x2 byte transpose (one prmt per 4 values)
  before the same e4m3 -> f16x2 unpacks, and the HMMAs accumulate into O.

Numerics: the same exact products as v2 (QK^T operands v2's times exactly 2**-7, P the same e4m3(448 P)); what
changes is FP32 summation order: S's dot products run with keys in M (same k-order), l is summed per lane and
then across lanes, and PV adds a tile's products to O inside the MMA instead of after it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90.decode import HEAD_DIM, K_ROW_BYTES, LANE_KEYS, SCALE_ROW_BYTES, rescale_heads
from mpfa.kernels.sm90.decode_pipelined import STAGE_BYTES, WORDS_OFFSET, SplitKVDecodeSm90Pipelined
from mpfa.kernels.sm90.ptx import (
    bits_to_f32,
    cp_async_16_at,
    cp_async_4_at,
    cp_async_commit,
    cp_async_wait,
    e4m3x2_hi_to_f16x2,
    e4m3x2_to_f16x2,
    exp2_approx,
    f32x2_to_e4m3x2_f16x2,
    load_shared_u32,
    load_shared_v4_u32,
    load_u32,
    mma_f16_m16n8k16,
    movmatrix_trans,
    mul_f16x2,
    prmt,
    prmt_var,
    shuffle_idx,
    shuffle_xor,
)
from mpfa.kernels.sm90.warp_mma import P_SCALE

SCORE_SCALE_LOG2 = 14  # K enters the MMA as e2m1 * 2**-14 * scale: S * 2**-14
MINUS_INF = -math.inf


class SplitKVDecodeSm90Lean(SplitKVDecodeSm90Pipelined):
    """Decode v4: `SplitKVDecodeSm90Pipelined` at 2 stages with `_run_tiles` rebuilt from cheaper pieces (module
    docstring); pages of < 32 keys keep v2's per-key slots (`_fetch_slots`)."""

    score_scale_log2 = SCORE_SCALE_LOG2

    def __init__(self, num_kv_heads: int, group: int, page_size: int, compensate: bool = True) -> None:
        super().__init__(num_kv_heads, group, page_size, 2, compensate)
        self.page_copies = page_size >= lay.TILE_KEYS  # a tile lies in one page: one slot per tile

    @cute.jit
    def _run_tiles(self, q_regs, state: cute.Tensor, acc: cute.Tensor, cache, page_table: cute.Tensor,
                   lam_scaled: Float32, batch_idx, kv_head, row_valid, start, end, lane, g, c):
        """v2's loop (copy tile t - 1 while tile t is computed) with the first tile computed (the partition's
        last, the only one that may extend past the sequence end) peeled off as the one with masked keys. Lane
        (g, c) keeps (m, l) of heads 2c, 2c + 1 (l summed over its own keys; the 8 lanes of a head are summed at
        the end) and hands ``state`` v2's per-head-g form for `_store_partials`."""
        k_codes, k_scales, v, delta_s = cache
        lam = lam_scaled * Float32(2.0 ** (SCORE_SCALE_LOG2 - lay.SCORE_SCALE_LOG2))
        head_slot = Int64(kv_head * k_scales.shape[1])
        heads = (2 * c < self.group, 2 * c + 1 < self.group)  # the lane's heads 2c, 2c + 1 are real
        bases = (  # stream bases of slot 0: K chunk c, scale word of blocks 2c, 2c + 1, Delta_S word c, V chunk g
            k_codes.iterator.toint() + kv_head * K_ROW_BYTES + 16 * c,
            k_scales.iterator.toint() + head_slot * SCALE_ROW_BYTES + 4 * (c >> 1),
            delta_s.iterator.toint() + head_slot * (self.ds_row * 2) + cutlass.select_(heads[0], 4 * c, 0),
            v.iterator.toint() + kv_head * HEAD_DIM + 16 * g,
        )
        if cutlass.const_expr(self.page_copies):  # + the lane's first key of a tile: key g (K, scales, Delta_S), 2c (V)
            bases = (bases[0] + Int64(g * (self.num_kv_heads * K_ROW_BYTES)), bases[1] + g * SCALE_ROW_BYTES,
                     bases[2] + g * (self.ds_row * 2), bases[3] + Int64(2 * c * (self.num_kv_heads * HEAD_DIM)))
        smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16).toint()
        chunks = (smem + lay.k_stage_offset(g, c), smem + lay.v_stage_offset(g, c))  # the lane's K and V chunks
        lane_word = smem + WORDS_OFFSET + lane * 4
        selectors = (Uint32(lay.scale_pair_selector(c)), Uint32(lay.delta_s_selector(0)),
                     Uint32(cutlass.select_(heads[1], lay.delta_s_selector(1), 0x4444)))
        pair = cute.make_rmem_tensor((4,), Float32)  # m of heads 2c, 2c + 1 (S * 2**-14), then their partial l
        pair[0] = MINUS_INF
        pair[1] = MINUS_INF
        pair[2] = Float32(0.0)
        pair[3] = Float32(0.0)

        num_tiles = (cutlass.max(end - start, 0) + lay.TILE_KEYS - 1) // lay.TILE_KEYS
        last_tile = start + (num_tiles - 1) * lay.TILE_KEYS
        slots = cute.make_rmem_tensor((LANE_KEYS,), Int32)
        self._fetch_slots(slots, page_table, batch_idx, last_tile, end, g, c)
        self._copy(slots, last_tile, end, num_tiles > 0, True, heads[0], g, c, bases, Int32(0), chunks,
                   lane_word)
        cp_async_commit()
        self._fetch_slots(slots, page_table, batch_idx, last_tile - lay.TILE_KEYS, end, g, c)
        if num_tiles > 0:
            self._step(Int32(0), num_tiles, last_tile, Int32(0), True, slots, page_table, batch_idx, q_regs, pair,
                       acc, lam, heads, end, g, c, bases, chunks, lane_word, selectors)
        stage = Int32(STAGE_BYTES)  # the stage of tile ``step``
        for step in cutlass.range(1, num_tiles, unroll=1):
            self._step(step, num_tiles, last_tile - step * lay.TILE_KEYS, stage, False, slots, page_table, batch_idx,
                       q_regs, pair, acc, lam, heads, end, g, c, bases, chunks, lane_word, selectors)
            stage = stage ^ Int32(STAGE_BYTES)
        cp_async_wait(0)
        # l of heads 2c, 2c + 1 over the 8 lanes c holding their keys; then (m, l) of head g as v2 keeps them
        for h in cutlass.range_constexpr(2):
            total = pair[2 + h]
            for mask in cutlass.range_constexpr(3):
                total = total + shuffle_xor(total, 4 << mask)
            pair[2 + h] = total
        source = Uint32(g >> 1)  # lane (0, g // 2) holds head g as its head g % 2
        odd = (g & 1) == 1
        for i in cutlass.range_constexpr(2):
            values = [shuffle_idx(pair[2 * i + h], source) for h in range(2)]
            state[i] = Float32(cutlass.select_(odd, values[1], values[0]))

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
              pair, acc, lam, heads, end, g, c, bases, chunks, lane_word, selectors):
        """One tile: copy tile ``step + 1`` into the other stage, then compute tile ``step`` from ``stage``."""
        self._copy(slots, tile - lay.TILE_KEYS, end, step + 1 < num_tiles, False, heads[0], g, c, bases,
                   stage ^ Int32(STAGE_BYTES), chunks, lane_word)
        cp_async_commit()
        self._fetch_slots(slots, page_table, batch_idx, tile - 2 * lay.TILE_KEYS, end, g, c)
        cp_async_wait(1)
        k_words, k_scale_words, ds, v_rows = self._read(stage, chunks, lane_word, selectors[1:])
        if cutlass.const_expr(masked):  # keys past the end: S = -inf (their K and V copied as zeros)
            for n_tile in cutlass.range_constexpr(lay.N_TILES):
                valid = tile + lay.qk_key(n_tile, g) < end
                for h in cutlass.range_constexpr(2):
                    ds[2 * n_tile + h] = Float32(cutlass.select_(valid, ds[2 * n_tile + h], Float32(MINUS_INF)))
        scores = self._qk(q_regs, k_words, k_scale_words, ds, selectors[0])
        probs, alphas = self._softmax(scores, pair, heads, lam)
        self._pv(probs, alphas, acc, v_rows)

    @cute.jit
    def _copy(self, slots, tile, end, active, partial: cutlass.Constexpr, ds_lane, g, c, bases, stage, chunks,
              lane_word):
        """cp.async the lane's bytes of ``tile`` into ``stage`` (nothing when ``active`` is false): K chunk, scale
        word and Delta_S word (``ds_lane``: the lane's heads are real) of keys ``qk_key(n, g)``, V chunk g of keys
        ``score_key(n, c, half)``. ``partial``: the tile may extend past the end (keys there copy nothing); else
        every key of an active tile is copied, under one predicate. Pages of >= 32 keys: one row address per
        stream plus compile-time key offsets; else v2's per-key slots."""
        k_base, ks_base, ds_base, v_base = bases
        k_stride, v_stride, ds_stride = self.num_kv_heads * K_ROW_BYTES, self.num_kv_heads * HEAD_DIM, self.ds_row * 2
        if cutlass.const_expr(self.page_copies):
            slot = Int64(slots[0])  # the tile's first slot; key k is slot + k
            k_base, ks_base = k_base + slot * k_stride, ks_base + slot * SCALE_ROW_BYTES
            ds_base, v_base = ds_base + slot * ds_stride, v_base + slot * v_stride
        k_chunk, v_chunk = chunks[0] + stage, chunks[1] + stage
        word = lane_word + stage
        present = Uint32(active)
        ds_present = Uint32(active & ds_lane)
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            valid, ds_valid = present, ds_present
            if cutlass.const_expr(partial):
                inside = tile + lay.qk_key(n_tile, g) < end
                valid, ds_valid = Uint32(active & inside), Uint32(active & inside & ds_lane)
            key = 8 * n_tile  # + g in the page bases
            rows = [k_base, ks_base, ds_base]
            if cutlass.const_expr(not self.page_copies):
                slot = Int64(slots[n_tile])
                rows = [k_base + slot * k_stride, ks_base + slot * SCALE_ROW_BYTES, ds_base + slot * ds_stride]
                key = 0
            cp_async_16_at(k_chunk, n_tile * 512, rows[0], key * k_stride, valid)
            cp_async_4_at(word, n_tile * 128, rows[1], key * SCALE_ROW_BYTES, valid)
            if cutlass.const_expr(self.compensate):
                cp_async_4_at(word, (lay.N_TILES + n_tile) * 128, rows[2], key * ds_stride, ds_valid)
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            for half in cutlass.range_constexpr(2):
                unit = lay.N_TILES + 2 * n_tile + half
                valid = present
                if cutlass.const_expr(partial):
                    valid = Uint32(active & (tile + lay.score_key(n_tile, c, half) < end))
                row, key = v_base, 8 * n_tile + half  # + 2c in the page base
                if cutlass.const_expr(not self.page_copies):
                    row, key = v_base + Int64(slots[unit]) * v_stride, 0
                cp_async_16_at(v_chunk, unit * 512, row, key * v_stride, valid)

    @cute.jit
    def _read(self, stage, chunks, lane_word, ds_selectors):
        """The tile's operands from shared memory: K chunks and scale words of keys ``qk_key(n, g)``, their
        Delta_S * 2**-14 for heads 2c, 2c + 1 in FP32 ([2 n + h]; 0 for the direct build, for padding heads and
        missing keys), V chunks of keys ``score_key(n, c, half)``."""
        k_chunk, v_chunk = chunks[0] + stage, chunks[1] + stage
        word = lane_word + stage
        k_words, k_scale_words, ds, v_rows = [], [], [], []
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            k_words.append(load_shared_v4_u32(k_chunk, n_tile * 512))
            k_scale_words.append(load_shared_u32(word, n_tile * 128))
            if cutlass.const_expr(self.compensate):
                # the BF16 pair of heads 2c, 2c + 1 -> each into a high half: their FP32
                bf16_pair = load_shared_u32(word, (lay.N_TILES + n_tile) * 128)
                for h in cutlass.range_constexpr(2):
                    bits = prmt_var(bf16_pair, Uint32(0), ds_selectors[h])
                    ds.append(bits_to_f32(bits) * Float32(2.0 ** -SCORE_SCALE_LOG2))
            else:
                ds += [Float32(0.0), Float32(0.0)]
        for unit in cutlass.range_constexpr(lay.N_TILES, 3 * lay.N_TILES):
            v_rows.append(load_shared_v4_u32(v_chunk, unit * 512))
        return k_words, k_scale_words, ds, v_rows

    @cute.jit
    def _qk(self, q_regs, k_words, k_scale_words, ds, scale_selector):
        """S^T = K Q^T: keys in the MMA's M (m-tile i: rows g, g + 8 = keys 16 i + g, 16 i + 8 + g, the lane's keys
        ``qk_key(2 i, g)``, ``qk_key(2 i + 1, g)``), the group's heads in N (column 2c + h: head 2c + h; Q^T's B
        registers are v2's Q registers), the same k-order as v2. -> scores [n-tile][h] = S * 2**-14 of key
        ``qk_key(n-tile, g)`` and head 2c + h; the accumulators start at ``ds``."""
        regs = []  # [n-tile][16]: K * 2**-14 of key qk_key(n-tile, g), v2's registers times 2**-7
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            pair = prmt_var(k_scale_words[n_tile], k_scale_words[n_tile], scale_selector)
            blocks = (e4m3x2_to_f16x2(pair), e4m3x2_hi_to_f16x2(pair))
            key_regs = []
            for word in cutlass.range_constexpr(4):
                high_bytes = [lay.e2m1_high_bytes(k_words[n_tile][word], low) for low in (True, False)]
                for j in cutlass.range_constexpr(4):
                    t = high_bytes[j % 2]
                    picked = prmt(t, Uint32(0), lay.PICK_EVEN_BYTES) if j < 2 else t & Uint32(lay.PICK_ODD_BYTES)
                    key_regs.append(mul_f16x2(picked, blocks[word // 2]))
            regs.append(key_regs)
        scores = []
        for m_tile in cutlass.range_constexpr(lay.N_TILES // 2):
            lo, hi = 2 * m_tile, 2 * m_tile + 1
            c_regs = [ds[2 * lo], ds[2 * lo + 1], ds[2 * hi], ds[2 * hi + 1]]
            for k_step in cutlass.range_constexpr(lay.K_STEPS_QK):
                r0, r1 = lay.qk_step_regs(k_step)
                c_regs = mma_f16_m16n8k16([regs[lo][r0], regs[hi][r0], regs[lo][r1], regs[hi][r1]],
                                          [q_regs[r0], q_regs[r1]], c_regs)
            scores += [[c_regs[0], c_regs[1]], [c_regs[2], c_regs[3]]]
        return scores

    @cute.jit
    def _softmax(self, scores, pair: cute.Tensor, heads, lam: Float32):
        """Online softmax of the lane's heads 2c, 2c + 1 over the tile: the maximum over the 8 lanes holding a
        head's keys (lanes of one c), P of the lane's 4 keys, alpha; l gets the lane's own P only (`_run_tiles`
        sums the lanes at the end: every lane of a head rescales by the same alpha). Padding heads: P = 0, alpha = 1.
        -> (P [n-tile][h], (alpha of head 2c, of head 2c + 1))."""
        probs = cute.make_rmem_tensor((lay.N_TILES * 2 + 2,), Float32)  # P [2 n + h], then alpha [h]
        for h in cutlass.range_constexpr(2):
            tile_max = scores[0][h]
            for n_tile in cutlass.range_constexpr(1, lay.N_TILES):
                tile_max = cute.arch.fmax(tile_max, scores[n_tile][h])
            for mask in cutlass.range_constexpr(3):
                tile_max = cute.arch.fmax(tile_max, shuffle_xor(tile_max, 4 << mask))
            m_old = pair[h]
            m_new = cute.arch.fmax(m_old, tile_max)
            m_lam = m_new * lam
            if heads[h]:
                for n_tile in cutlass.range_constexpr(lay.N_TILES):
                    probs[2 * n_tile + h] = exp2_approx(scores[n_tile][h] * lam - m_lam)
                # exactly 1 where the maximum stays (see `prefill_tile.online_softmax`): the warp then skips O *= alpha
                probs[2 * lay.N_TILES + h] = Float32(cutlass.select_(m_new == m_old, Float32(1.0),
                                                                     exp2_approx(m_old * lam - m_lam)))
            else:
                for n_tile in cutlass.range_constexpr(lay.N_TILES):
                    probs[2 * n_tile + h] = Float32(0.0)
                probs[2 * lay.N_TILES + h] = Float32(1.0)
            row_sum = probs[h]
            for n_tile in cutlass.range_constexpr(1, lay.N_TILES):
                row_sum = row_sum + probs[2 * n_tile + h]
            pair[h] = m_new
            pair[2 + h] = probs[2 * lay.N_TILES + h] * pair[2 + h] + row_sum
        return ([[probs[2 * n + h] for h in range(2)] for n in range(lay.N_TILES)],
                (probs[2 * lay.N_TILES], probs[2 * lay.N_TILES + 1]))

    @cute.jit
    def _pv(self, probs, alphas, acc: cute.Tensor, v_rows):
        """acc = alpha * acc + e4m3(448 P) V on FP16 MMAs: P^T's B registers are the transposes (movmatrix) of the
        lane's P pairs (keys qk_key(n, g), heads 2c, 2c + 1 -> head g, keys score_key(n, c, 0 / 1)); per m-tile two
        m16n8k16 over keys (j0, j1) and (j2, j3) of both 16-key halves (the k-order ptxas gives the e4m3 m16n8k32
        it replaces)."""
        rescale_heads(acc, alphas)
        p = [movmatrix_trans(f32x2_to_e4m3x2_f16x2(probs[n][0] * Float32(P_SCALE), probs[n][1] * Float32(P_SCALE)))
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
