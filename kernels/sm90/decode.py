"""Split-KV decode attention over the MpFA paged cache (NVFP4 K + e4m3 scales, FP8 V, BF16 Delta_S), CuTe DSL.

One warp (one CTA) per (KV head, partition, request); the grid is sized by the preallocated workspace, so the
launch never reads sequence lengths on the host and can be captured in a CUDA graph; each request's keys spread
over the grid's partitions by its own length on the device (`decode_layout.partition_keys`). The warp walks its
partition's 32-key tiles last to first, exactly like `mpfa.kernels.reference.decode_partials` with
``block_n = 32``:

    S = Q_c K_c^T + Delta_S   (FP16 MMA on exactly dequantized NVFP4; Delta_S initialises the accumulator)
    m = max(m, rowmax S);  P = exp2(lam S - lam m);  l = alpha l + rowsum P;  O = alpha O + e4m3(448 P) V

and writes the partition's (m, l, O / (448 l)) to the workspace; `decode_merge` combines partitions. The
register layout is in `decode_layout`. Exponentials run only for the group's real query heads (the other MMA rows
are padding) and only on keys the tile holds; keys past the sequence end get S = -inf and are never read.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from mpfa.kernels.cache_layout import delta_s_row
from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90.ptx import (
    bits_to_f32,
    exp2_approx,
    load_u16,
    load_u32,
    load_v4_u32,
    shuffle_idx,
    store_v4_f32,
)
from mpfa.kernels.sm90.warp_mma import (
    P_SCALE,
    p_fragment,
    p_pair,
    pv_mtile,
    q_chunk_regs,
    qk_ntile,
    quad_max,
    quad_sum,
    transpose_v,
)

HEAD_DIM = 128
K_ROW_BYTES = HEAD_DIM // 2
SCALE_ROW_BYTES = HEAD_DIM // 16
BF16_MINUS_INF = 0xFF80
MAX_GROUP = 8
LANE_KEYS = lay.N_TILES * 3  # keys a lane touches per tile: one QK key and two score/V keys per n-tile


@cute.jit
def rescale_heads(acc: cute.Tensor, alphas: tuple) -> None:
    """O^T *= alpha of each accumulator's head (register i: ``alphas[i % 2]``, heads 2c, 2c + 1 of the lane),
    skipped when every alpha of the warp is exactly 1 (the head's maximum stayed: `_softmax_probs`)."""
    if cute.arch.vote_any_sync((alphas[0] != Float32(1.0)) | (alphas[1] != Float32(1.0))):
        for i in cutlass.range_constexpr(lay.M_TILES * 4):
            acc[i] = acc[i] * alphas[i % 2]


class SplitKVDecodeSm90:
    """Compile-time shape of one decode kernel: ``num_kv_heads``, the GQA ``group`` (<= 8) and ``page_size``.
    v2 (`decode_pipelined`) reuses the launch, the kernel's prologue and epilogue, and replaces only the tile loop,
    `_run_tiles`."""

    smem_bytes = 0  # dynamic shared memory per CTA (v1 uses none)
    # One page-table read per tile when pages hold >= 32 keys (`_fetch_slots`); v1 keeps one per key: its loads go
    # straight to registers, and the uniform-page form keeps 12 addresses live (196 registers: < 12 warps per SM).
    tile_page_reads = False
    # The QK MMA yields S * 2**-score_scale_log2 (v4, `decode_lean`, runs 14: its K operand leaves out the 2**7)
    score_scale_log2 = lay.SCORE_SCALE_LOG2

    def __init__(self, num_kv_heads: int, group: int, page_size: int, compensate: bool = True) -> None:
        """``compensate`` False: the `direct` build, which reads no Delta_S (every score starts at 0, as if the
        side cache held zeros): what the compensation costs is the time between the two builds."""
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
        lam_scaled: Float32,  # log2(e) * sm_scale * 2**7 (the MMA yields S * 2**-7)
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

        state = cute.make_rmem_tensor((2,), Float32)  # running max (S * 2**-7) and sum of this lane's head g
        state[0] = -math.inf
        state[1] = Float32(0.0)
        acc = cute.make_rmem_tensor((lay.M_TILES * 4,), Float32)  # O^T accumulators, m-tile major
        for i in cutlass.range_constexpr(lay.M_TILES * 4):
            acc[i] = Float32(0.0)

        self._run_tiles(q_regs, state, acc, (k_codes, k_scales, v, delta_s), page_table, lam_scaled, batch_idx,
                        kv_head, row_valid, start, end, lane, g, c)

        self._store_partials(state, acc, m_part, l_part, o_part, batch_idx, kv_head, part, num_parts, g, c)

    @cute.jit
    def _run_tiles(self, q_regs, state: cute.Tensor, acc: cute.Tensor, cache, page_table: cute.Tensor,
                   lam_scaled: Float32, batch_idx, kv_head, row_valid, start, end, lane, g, c):
        """Fold the partition's keys [start, end) into ``state`` and ``acc``, 32-key tiles last to first; ``cache``:
        the (k_codes, k_scales, v, delta_s) tensors; ``lane`` is for v2's shared memory. v1 loads each tile straight
        into registers at its top."""
        k_codes, k_scales, v, delta_s = cache
        # Per-lane base addresses of the lane's chunk in slot 0's row (head g of the group for Delta_S); + slot *
        # row stride per key. K scales and Delta_S are head-major: the KV head's slot 0 is row head_slot.
        head_slot = Int64(kv_head * k_scales.shape[1])
        bases = (
            k_codes.iterator.toint() + kv_head * K_ROW_BYTES + 16 * c,
            k_scales.iterator.toint() + head_slot * SCALE_ROW_BYTES + 2 * c,
            delta_s.iterator.toint() + head_slot * (self.ds_row * 2) + g * 2,
            v.iterator.toint() + kv_head * HEAD_DIM + 16 * g,
        )
        num_tiles = (cutlass.max(end - start, 0) + lay.TILE_KEYS - 1) // lay.TILE_KEYS
        last_tile = start + (num_tiles - 1) * lay.TILE_KEYS  # tiles run last to first
        slots = cute.make_rmem_tensor((LANE_KEYS,), Int32)  # slots of the next tile's keys, fetched a tile ahead
        self._fetch_slots(slots, page_table, batch_idx, last_tile, end, g, c)
        for step in cutlass.range(num_tiles, unroll=1):
            tile = last_tile - step * lay.TILE_KEYS
            tile_slots = [slots[i] for i in range(LANE_KEYS)]
            self._fetch_slots(slots, page_table, batch_idx, tile - lay.TILE_KEYS, end, g, c)
            k_words, k_scales_raw, ds_bits, v_rows = self._load_tile(tile_slots, tile, end, row_valid, g, c, bases)
            scores = self._qk_tile(q_regs, k_words, k_scales_raw, ds_bits)
            p_regs, alpha = self._online_softmax(scores, state, row_valid, lam_scaled)
            self._pv_tile(p_regs, alpha, acc, v_rows, c)

    # --- pieces of one tile ------------------------------------------------------------------------------------

    @cute.jit
    def _fetch_slots(self, slots: cute.Tensor, page_table: cute.Tensor, batch_idx: Int32, tile: Int32, end: Int32,
                     g: Int32, c: Int32):
        """Slots of the lane's keys in ``tile``: [n-tile] its QK key, then [4 + 2 n-tile + half] its score / V keys.
        Keys past the end are clamped to the last key (their loads are predicated off). With pages of >= 32 keys a
        tile (32-aligned from the sequence start) lies in one page: one page-table read per tile, not one per key
        (``tile_page_reads``)."""
        keys = [lay.qk_key(n_tile, g) for n_tile in range(lay.N_TILES)]
        keys += [lay.score_key(n_tile, c, half) for n_tile in range(lay.N_TILES) for half in range(2)]
        row = page_table.iterator.toint() + Int64(batch_idx) * page_table.stride[0] * 4

        def page_of(index):
            return Int32(load_u32(row + Int64(index) * 4))

        bounds = (cutlass.max, cutlass.min)
        if cutlass.const_expr(self.tile_page_reads and self.page_size >= lay.TILE_KEYS):
            base = lay.tile_page_base(page_of, tile, end, self.page_shift, *bounds)
            for i in cutlass.range_constexpr(LANE_KEYS):
                slots[i] = lay.tile_key_slot(base, tile, keys[i], end, *bounds)
        else:
            for i in cutlass.range_constexpr(LANE_KEYS):
                slots[i] = lay.key_slot(page_of, tile, keys[i], end, self.page_shift, *bounds)

    @cute.jit
    def _load_tile(self, tile_slots, tile, end, row_valid, g, c, bases):
        """Issue every load of the tile: the lane's K chunks and scale pairs (QK keys), Delta_S of head g and V
        chunk g (score keys); keys past the end read nothing (zeros; Delta_S = -inf so that S = -inf)."""
        k_base, ks_base, ds_base, v_base = bases
        k_words, k_scales_raw, ds_bits, v_rows = [], [], [], []
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            valid = Uint32(tile + lay.qk_key(n_tile, g) < end)
            slot = Int64(tile_slots[n_tile])
            k_words.append(load_v4_u32(k_base + slot * (self.num_kv_heads * K_ROW_BYTES), valid))
            k_scales_raw.append(load_u16(ks_base + slot * SCALE_ROW_BYTES, valid, Uint32(0)))
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            for half in cutlass.range_constexpr(2):
                valid = tile + lay.score_key(n_tile, c, half) < end
                slot = Int64(tile_slots[lay.N_TILES + 2 * n_tile + half])
                default = Uint32(cutlass.select_(valid, Uint32(0), Uint32(BF16_MINUS_INF)))
                if cutlass.const_expr(self.compensate):
                    ds_bits.append(load_u16(ds_base + slot * (self.ds_row * 2), Uint32(valid & row_valid), default))
                else:
                    ds_bits.append(default)
                v_rows.append(load_v4_u32(v_base + slot * (self.num_kv_heads * HEAD_DIM), Uint32(valid)))
        return k_words, k_scales_raw, ds_bits, v_rows

    @cute.jit
    def _qk_tile(self, q_regs, k_words, k_scales_raw, ds_bits):
        """Scores of the tile's keys for head g: [n-tile][half] = S * 2**-7 at key 8 n + 2c + half (-inf past end)."""
        scores = []
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            c_regs = [bits_to_f32(ds_bits[2 * n_tile + half] << 16) * Float32(2.0 ** -lay.SCORE_SCALE_LOG2)
                      for half in range(2)] + [Float32(0.0), Float32(0.0)]
            a_steps = [[q_regs[r0], Uint32(0), q_regs[r1], Uint32(0)]
                       for r0, r1 in (lay.qk_step_regs(k_step) for k_step in range(lay.K_STEPS_QK))]
            c_regs = qk_ntile(a_steps, k_words[n_tile], k_scales_raw[n_tile], c_regs)
            scores.append([c_regs[0], c_regs[1]])
        return scores

    @cute.jit
    def _online_softmax(self, scores, state: cute.Tensor, row_valid, lam_scaled: Float32):
        """Update (m, l) of head g with the tile; -> (P^T fragments b0, b1 in e4m3 x 448, alpha of head g)."""
        probs, alpha = self._softmax_probs(scores, state, row_valid, lam_scaled)
        return p_fragment([p_pair(probs[2 * n_tile], probs[2 * n_tile + 1]) for n_tile in range(lay.N_TILES)]), alpha

    @cute.jit
    def _softmax_probs(self, scores, state: cute.Tensor, row_valid, lam_scaled: Float32):
        """Update (m, l) of head g with the tile; -> (P of the lane's keys [2 n-tile + half] in FP32, alpha)."""
        tile_max = scores[0][0]
        for n_tile in cutlass.range_constexpr(lay.N_TILES):
            for half in cutlass.range_constexpr(2):
                tile_max = cute.arch.fmax(tile_max, scores[n_tile][half])
        tile_max = quad_max(tile_max)
        m_old = state[0]
        m_new = cute.arch.fmax(m_old, tile_max)
        m_lam = m_new * lam_scaled
        probs = cute.make_rmem_tensor((lay.N_TILES * 2 + 1,), Float32)  # P of the lane's keys, then alpha
        if row_valid:
            for n_tile in cutlass.range_constexpr(lay.N_TILES):
                for half in cutlass.range_constexpr(2):
                    probs[2 * n_tile + half] = exp2_approx(scores[n_tile][half] * lam_scaled - m_lam)
            # exactly 1 where the maximum stays (see `prefill_tile.online_softmax`): the warp then skips O *= alpha
            probs[lay.N_TILES * 2] = Float32(cutlass.select_(m_new == m_old, Float32(1.0),
                                                             exp2_approx(m_old * lam_scaled - m_lam)))
        else:
            for i in cutlass.range_constexpr(lay.N_TILES * 2):
                probs[i] = Float32(0.0)
            probs[lay.N_TILES * 2] = Float32(1.0)
        row_sum = probs[0]
        for i in cutlass.range_constexpr(1, lay.N_TILES * 2):
            row_sum = row_sum + probs[i]
        row_sum = quad_sum(row_sum)
        alpha = probs[lay.N_TILES * 2]
        state[0] = m_new
        state[1] = alpha * state[1] + row_sum
        return [probs[i] for i in range(lay.N_TILES * 2)], alpha

    @cute.jit
    def _pv_tile(self, p_regs, alpha, acc: cute.Tensor, v_rows, c):
        """acc = alpha * acc + e4m3(448 P) V over the tile (V rows of the lane's score keys, chunk g)."""
        rescale_heads(acc, (shuffle_idx(alpha, Uint32(8 * c)), shuffle_idx(alpha, Uint32(8 * c + 4))))
        transposed = transpose_v(v_rows)  # keys pv_key(k_half, c, j) = score keys 4 k_half + j
        for m_tile in cutlass.range_constexpr(lay.M_TILES):
            c_regs = pv_mtile(transposed, p_regs, m_tile, [acc[4 * m_tile + i] for i in range(4)])
            for i in cutlass.range_constexpr(4):
                acc[4 * m_tile + i] = c_regs[i]

    @cute.jit
    def _store_partials(self, state: cute.Tensor, acc: cute.Tensor, m_part, l_part, o_part,
                        batch_idx, kv_head, part, num_parts, g, c):
        """(m, l) of head g from lane (g, 0); O / (448 l) of heads 2c, 2c + 1 over dimensions 16g..16g+15."""
        num_q_heads = self.num_kv_heads * self.group
        if (g < self.group) & (c == 0):
            head = kv_head * self.group + g
            m_part[batch_idx, head, part] = state[0] * Float32(2.0 ** self.score_scale_log2)
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
