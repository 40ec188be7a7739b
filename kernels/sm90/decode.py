"""Split-KV decode attention over the MpFA paged cache (NVFP4 K + e4m3 scales, FP8 V, BF16 Delta_S), CuTe DSL.

One warp (one CTA) per (KV head, partition, request); the grid is sized by the preallocated workspace, so the
launch never reads sequence lengths on the host and can be captured in a CUDA graph; each request's keys spread
over the grid's partitions by its own length on the device (`decode_layout.partition_keys`). The warp walks its
partition's 32-key tiles last to first, exactly like `mpfa.kernels.reference.decode_partials` with
``block_n = 32``:

    S = Q_c K_c^T + Delta_S   (FP16 MMA on exactly dequantized NVFP4; Delta_S initialises the accumulator)
    m = max(m, rowmax S);  P = exp2(lam S - lam m);  l = alpha l + rowsum P;  O = alpha O + e4m3(448 P) V

and writes the partition's (m, l, O / (448 l)) to the workspace; `decode_merge` combines partitions. The kernel is
bound by its warps' issue, so a tile costs as few instructions as it can:

* **A two-stage cp.async ring**: each lane copies the bytes it will consume of tile t - 1 (K codes, K scale words,
  Delta_S words, V; `decode_layout.k_stage_offset`, `v_stage_offset`) into its own shared-memory words while tile
  t is computed, so `cp.async.wait_group` is the only synchronisation. 7,680 B per stage: two stages are 15 KB,
  and 12 one-warp CTAs fit an SM.
* **Copies** (pages of >= 32 keys, as served): a tile lies in one page, so each of the four streams has one
  per-lane row address per tile (one page-table read, `decode_layout.tile_page_base`) and every key's copy is that
  address plus a compile-time offset folded into the instruction; tiles other than the partition's last are
  whole, so their copies share one predicate (the tile exists) through cp.async's ignore-src operand. Keys past
  the end (only in the partition's last tile, computed first) are masked in a peeled first step. Smaller pages
  read the page table once per key (`decode_layout.key_slot`).
* **K expansion**: a word's 8 e2m1 codes become two words of FP16 high bytes (`decode_layout.e2m1_high_bytes`)
  and each f16x2 register is one byte pick; the K block scales are one byte permute and two e4m3 -> f16x2
  conversions per key chunk. K enters the MMA as e2m1 * 2**-14 * scale, so the MMA yields S * 2**-14.
* **S^T = K Q^T**: the 32 keys fill M (two m-tiles of 16) and the group's heads N (16 MMAs per tile, no padding
  rows). Lane (g, c) ends with keys ``qk_key(n, g)`` for heads 2c, 2c + 1: Delta_S is one word per key, the row
  maximum a 3-step butterfly over the lanes of one c, alpha needs no shuffle, and l is summed over the lanes once
  at the end. P^T reaches the PV MMA through 4 ``movmatrix`` transposes.
* **PV** on FP16 ``m16n8k16``: V needs a 2x2 byte transpose (one prmt per 4 values) before its e4m3 -> f16x2
  unpacks, and the MMAs accumulate into O.

Exponentials run only for the group's real query heads and keys past the sequence end get S = -inf.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..cache_layout import delta_s_row
from . import decode_layout as lay
from .ptx import (bits_to_f32, cp_async_16_at, cp_async_4_at, cp_async_commit, cp_async_wait, e4m3x2_hi_to_f16x2,
                  e4m3x2_to_f16x2, exp2_approx, f32x2_to_e4m3x2_f16x2, load_shared_u32, load_shared_v4_u32, load_u16,
                  load_u32, load_v4_u32, mma_f16_m16n8k16, movmatrix_trans, mul_f16x2, prmt, prmt_var, shuffle_idx,
                  shuffle_xor, store_v4_f32)
from .warp_mma import P_SCALE, q_chunk_regs

HEAD_DIM = 128
K_ROW_BYTES = HEAD_DIM // 2
SCALE_ROW_BYTES = HEAD_DIM // 16
MAX_GROUP = 8
LANE_KEYS = lay.N_TILES * 3  # keys a lane touches per tile: one QK key and two score/V keys per n-tile
SCORE_SCALE_LOG2 = 14  # the QK MMA yields S * 2**-14 (K enters it as e2m1 * 2**-14 * scale)
MINUS_INF = -math.inf
STAGES = 2
CHUNK_UNITS = lay.N_TILES + 2 * lay.N_TILES  # 16-byte units per lane and stage: K chunks, then V chunks
WORD_UNITS = lay.N_TILES + 2 * lay.N_TILES  # 4-byte words per lane and stage: K-scale words, then Delta_S words
WORDS_OFFSET = CHUNK_UNITS * 32 * 16
STAGE_BYTES = WORDS_OFFSET + WORD_UNITS * 32 * 4
SMEM_BYTES = STAGES * STAGE_BYTES


@cute.jit
def rescale_heads(acc: cute.Tensor, alphas: tuple) -> None:
    """O^T *= alpha of each accumulator's head (register i: ``alphas[i % 2]``, heads 2c, 2c + 1 of the lane),
    skipped when every alpha of the warp is exactly 1 (every head's maximum stayed: `_softmax`)."""
    if cute.arch.vote_any_sync((alphas[0] != Float32(1.0)) | (alphas[1] != Float32(1.0))):
        for i in cutlass.range_constexpr(lay.M_TILES * 4):
            acc[i] = acc[i] * alphas[i % 2]


class SplitKVDecodeSm90:
    """Compile-time shape of the decode kernel: ``num_kv_heads``, the GQA ``group`` (<= 8) and ``page_size``."""

    smem_bytes = SMEM_BYTES  # dynamic shared memory per CTA: the cp.async ring

    def __init__(self, num_kv_heads: int, group: int, page_size: int, compensate: bool = True) -> None:
        """``compensate`` False: the direct build, which reads no Delta_S (every score starts at 0, as if the side
        cache held zeros): what the compensation costs is the time between the two builds."""
        if not 1 <= group <= MAX_GROUP:
            raise ValueError(f"the sm90 decode kernel packs 1..{MAX_GROUP} query heads per KV head, got {group}")
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.num_kv_heads = num_kv_heads
        self.group = group
        self.page_size = page_size
        self.page_shift = page_size.bit_length() - 1
        self.ds_row = delta_s_row(group)  # BF16 entries of a (KV head, slot) Delta_S row
        self.compensate = compensate
        self.page_copies = page_size >= lay.TILE_KEYS  # a tile lies in one page: one slot per tile

    @cute.jit
    def __call__(
        self,
        q_codes: cute.Tensor,  # uint8 [B, Hq, 64]
        q_scales: cute.Tensor,  # uint8 [B, Hq, 8]
        k_codes: cute.Tensor,  # uint8 [slots, Hkv, 64]
        k_scales: cute.Tensor,  # uint8 [Hkv, slots, 8]
        v: cute.Tensor,  # uint8 [slots, Hkv, 128]
        delta_s: cute.Tensor,  # bf16 [Hkv, slots, ds_row]
        page_table: cute.Tensor,  # int32 [B, max_pages]
        seq_lens: cute.Tensor,  # int32 [B]
        m_part: cute.Tensor,  # fp32 [B, Hq, P]
        l_part: cute.Tensor,  # fp32 [B, Hq, P]
        o_part: cute.Tensor,  # fp32 [B, Hq, P, 128]
        lam_scaled: Float32,  # log2(e) * sm_scale * 2**7 (`decode_layout.SCORE_SCALE_LOG2`; the kernel adds 2**7)
        min_partition: Int32,  # a positive multiple of 32 (`decode_layout.partition_keys`)
        stream,
    ):
        self.kernel(
            q_codes, q_scales, k_codes, k_scales, v, delta_s, page_table, seq_lens, m_part, l_part, o_part,
            lam_scaled, min_partition,
        ).launch(grid=(self.num_kv_heads, m_part.shape[2], seq_lens.shape[0]), block=(32, 1, 1), smem=self.smem_bytes,
                 stream=stream)

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
        seq_lens: cute.Tensor,
        m_part: cute.Tensor,
        l_part: cute.Tensor,
        o_part: cute.Tensor,
        lam_scaled: Float32,
        min_partition: Int32,
    ):
        # the merge (launched with PDL) may be scheduled from now on; it waits for this grid to complete
        cute.arch.griddepcontrol_launch_dependents()
        group = self.group
        num_kv_heads = self.num_kv_heads
        num_q_heads = num_kv_heads * group
        lane = cute.arch.lane_idx()
        kv_head, part, batch_idx = cute.arch.block_idx()
        g = lane >> 2
        c = lane & 3
        head = kv_head * group + g
        row_valid = g < group
        seq_len = seq_lens[batch_idx]
        num_parts = m_part.shape[2]
        partition_size = lay.partition_keys(seq_len, num_parts, min_partition, cutlass.max)
        start = part * partition_size
        end = cutlass.min(start + partition_size, seq_len)

        # Q: lane (g, c) holds head g's chunk c, exactly dequantized to FP16 (e2m1 * 2**-14 * 2**14 * scale).
        q_row = Int64(batch_idx * num_q_heads + head)
        q_words = load_v4_u32(q_codes.iterator.toint() + q_row * K_ROW_BYTES + 4 * 4 * c, Uint32(row_valid))
        q_regs = q_chunk_regs(q_words, load_u16(q_scales.iterator.toint() + q_row * SCALE_ROW_BYTES + 2 * c,
                                                Uint32(row_valid), Uint32(0)))

        state = cute.make_rmem_tensor((2,), Float32)  # (m, l) of this lane's head g (S * 2**-14), from `_run_tiles`
        state[0] = -math.inf  # (set before the tile loop: dropping these two stores reschedules the SASS at page 1)
        state[1] = Float32(0.0)
        acc = cute.make_rmem_tensor((lay.M_TILES * 4,), Float32)  # O^T accumulators, m-tile major
        for i in cutlass.range_constexpr(lay.M_TILES * 4):
            acc[i] = Float32(0.0)

        self._run_tiles(q_regs, state, acc, (k_codes, k_scales, v, delta_s), page_table, lam_scaled, batch_idx,
                        kv_head, start, end, lane, g, c)

        self._store_partials(state, acc, m_part, l_part, o_part, batch_idx, kv_head, part, num_parts, g, c)

    @cute.jit
    def _run_tiles(self, q_regs, state: cute.Tensor, acc: cute.Tensor, cache, page_table: cute.Tensor,
                   lam_scaled: Float32, batch_idx, kv_head, start, end, lane, g, c):
        """Fold the partition's keys [start, end) into ``state`` and ``acc``, 32-key tiles last to first: copy tile
        t - 1 while tile t is computed, with the first tile computed (the partition's last, the only one that may
        extend past the sequence end) peeled off as the one with masked keys. ``cache``: the (k_codes, k_scales,
        v, delta_s) tensors. Lane (g, c) keeps (m, l) of heads 2c, 2c + 1 (l summed over its own keys; the 8 lanes
        of a head are summed at the end) and leaves (m, l) of head g in ``state`` for `_store_partials`."""
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
        # l of heads 2c, 2c + 1 over the 8 lanes c holding their keys; then (m, l) of head g
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
        """Slots of the lane's keys in ``tile``. Pages of >= 32 keys: only the tile's first slot (a tile, 32-aligned
        from the sequence start, lies in one page; a tile before the sequence start gets the first page's). Smaller
        pages: [n-tile] its QK key, then [4 + 2 n-tile + half] its V keys, one page-table read each; keys past the
        end are clamped to the last key (their copies are predicated off)."""
        row = page_table.iterator.toint() + Int64(batch_idx) * page_table.stride[0] * 4

        def page_of(index):
            return Int32(load_u32(row + Int64(index) * 4))

        if cutlass.const_expr(self.page_copies):
            slots[0] = lay.tile_page_base(page_of, tile, end, self.page_shift, cutlass.max, cutlass.min)
        else:
            keys = [lay.qk_key(n_tile, g) for n_tile in range(lay.N_TILES)]
            keys += [lay.score_key(n_tile, c, half) for n_tile in range(lay.N_TILES) for half in range(2)]
            for i in cutlass.range_constexpr(LANE_KEYS):
                slots[i] = lay.key_slot(page_of, tile, keys[i], end, self.page_shift, cutlass.max, cutlass.min)

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
        stream plus compile-time key offsets; else one slot per key."""
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
        registers are `warp_mma.q_chunk_regs`). -> scores [n-tile][h] = S * 2**-14 of key ``qk_key(n-tile, g)`` and
        head 2c + h; the accumulators start at ``ds``."""
        regs = []  # [n-tile][16]: K * 2**-14 of key qk_key(n-tile, g)
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
        m16n8k16 over keys (j0, j1) and (j2, j3) of both 16-key halves (the k-order ptxas gives an e4m3 m16n8k32)."""
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

    @cute.jit
    def _store_partials(self, state: cute.Tensor, acc: cute.Tensor, m_part, l_part, o_part,
                        batch_idx, kv_head, part, num_parts, g, c):
        """(m, l) of head g from lane (g, 0); O / (448 l) of heads 2c, 2c + 1 over dimensions 16g..16g+15."""
        num_q_heads = self.num_kv_heads * self.group
        if (g < self.group) & (c == 0):
            head = kv_head * self.group + g
            m_part[batch_idx, head, part] = state[0] * Float32(2.0 ** SCORE_SCALE_LOG2)
            l_part[batch_idx, head, part] = state[1]
        o_base = o_part.iterator.toint()
        for which in cutlass.range_constexpr(2):
            l_head = shuffle_idx(state[1], Uint32(8 * c + 4 * which))
            inv = Float32(cutlass.select_(l_head > Float32(0.0), Float32(1.0) / (l_head * Float32(P_SCALE)), Float32(0.0)))
            head_in_group = 2 * c + which
            if head_in_group < self.group:
                head = kv_head * self.group + head_in_group
                row = (Int64(batch_idx * num_q_heads + head) * num_parts + part) * HEAD_DIM + 16 * g
                for quad in cutlass.range_constexpr(4):
                    values = [acc[4 * (2 * quad + pair) + which + 2 * upper] * inv
                              for pair in range(2) for upper in range(2)]
                    store_v4_f32(o_base + (row + 4 * quad) * 4, *values)
