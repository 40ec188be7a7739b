"""MpFA prefill v6: v5w8 (`prefill_wgmma_fp8pv`, both GEMMs on e4m3 wgmma) warp-specialized as FA3 is.

v5w8's 8 warps each do everything per 64-key tile: the ring copies, the NVFP4 K -> e4m3 expansion, the V transpose,
two CTA barriers, QK, softmax, PV. v6 splits the CTA by role (profiles/NOTES.md, "The profile of v3", "Prefill v6"):

* CTA = 3 warpgroups (384 threads), 1 CTA per SM. Warpgroup 0 is the **producer**: the cp.async ring of raw tiles
  (v3's `_copy_wgmma_tile`, one warpgroup copying both 32-key halves), the K expansion to the e4m3 operand tile with
  the tile's power-of-two exponent (v4's `_expand_k_e4m3`), the V transpose to V^T (v5's `_expand_v`), into one of
  two **operand stages** (K + V^T, 16 KB each). Warpgroups 1 and 2 are the **consumers**: consumer w owns what v5w8's
  warpgroup w owns (query rows 16 w .. 16 w + 15 of the CTA's 4 heads, its own e4m3 Q tile, expanded by itself at
  the start) and runs v5's tile body (`_wgmma_tile`: QK e4m3 wgmma, Delta_S after the MMA, online softmax with exact
  alpha and vote-skip, P packed to e4m3, PV into a fresh accumulator added to O in FP32) on each operand stage.
* Same walk as v5w8: the CTA walks the tiles its last row sees, masked tiles first, then whole ones; the earlier
  consumer skips the leading tiles none of its rows sees. Each consumer runs v5's arithmetic on v5's tiles in v5's
  order, so the output is v5w8's (and v5's) bit for bit.
* `setmaxnreg`: the producer drops to ``PRODUCER_REGS``, the consumers rise to ``CONSUMER_REGS``
  (128 (p + 2 c) <= 3 x 128 x the launch's 168 registers: ``.reqntid 384`` caps ptxas at 168).

Synchronisation (the deadlock-prone part; every wait below has a matching arrive on every path):

* ``full[s]`` / ``empty[s]``, s = 0, 1: one mbarrier pair per operand stage, initialised by thread 0, made visible
  by ``fence.mbarrier_init`` and the one CTA-wide ``bar.sync 0`` of the kernel (before any role starts).
  ``full[s]`` expects ``producer_threads`` (128; v6g 256) arrivals: every producer thread arrives after its own operand
  stores and its own ``fence.proxy.async`` (each thread's generic stores made visible to the async proxy, i.e. to
  wgmma, before its release-arrive). ``empty[s]`` expects ``CONSUMER_THREADS`` (256) arrivals: every consumer
  thread arrives once per step after its PV wgmma has been waited for (``wgmma.wait_group 0``) and its Delta_S
  loads from the ring stage are done, on **every** step of the CTA's walk, also on the steps whose tile it skips
  (the earlier consumer's leading tiles in a causal CTA): both consumers walk the same ``cta_tiles`` steps.
* (With n operand stages, v6h's 3, read p mod n, p // n and p - n for p & 1, p >> 1 and p - 2 below, and
  ``RING_STAGES - n`` tiles ahead for 6; `stage_parity`, `ws_ring_copy`.)
* Step p of the walk uses operand stage s = p & 1 in its (p >> 1)-th phase: consumers wait ``full[s]`` for parity
  (p >> 1) & 1. The producer waits ``empty[s]`` for parity ((p >> 1) & 1) ^ 1 before refilling stage s: on the first
  pass (p = 0, 1) that is parity 1 of a fresh mbarrier, whose "preceding phase" counts as complete, so the wait
  returns at once (CUTLASS's producer start state); from p = 2 on it waits for the consumers' release of step p - 2.
  Neither side can run two phases ahead of the other on one barrier (the producer needs the release of step p - 2
  to fill step p; a consumer needs the fill of step p to release it), so one parity bit is enough.
* The raw ring (``RING_STAGES`` = 8 stages of one 64-key tile) runs ``RING_STAGES - 2`` tiles ahead: at step p the
  producer copies walk step p + 6 into the ring stage of step p - 2, after ``empty[s]`` proved both consumers done
  with step p - 2 (they read its Delta_S from the ring stage) and the producer's own threads done with it (their
  ``full`` arrivals of step p - 2 preceded that release). ``cp.async.wait_group 6`` then leaves the thread's own
  copies of step p landed; named barrier 1 (the 128 producer threads) makes every producer thread's copies visible
  to the others before the expansion reads them.
* Named barriers: 0 only for the CTA-wide start; 1 the producer's per-step barrier; 2 and 3 each consumer's barrier
  after its Q expansion (128 threads each); 4 and 5 only in v6f, the consumers' QK turns (256 threads each,
  `PrefillSm90WgmmaWsPingPong`). The tile's K exponent goes through shared memory (one word per operand
  stage, written by producer thread 0 before its ``full`` arrival, read by the consumers after their ``full`` wait).

Shared memory: 2 Q tiles (8 KB each), 2 operand stages (16 KB), the ring (8 x 13 KB compensated), the barriers and
the exponents: ~152 KB compensated, 1 CTA per SM.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import warpgroup

from mpfa.kernels.sm90 import prefill_grid
from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90 import prefill_tile as tile_math
from mpfa.kernels.sm90.ablation import FULL, fold_p_words, no_exp2, plain_probs
from mpfa.kernels.sm90.decode_layout import SCORE_SCALE_LOG2
from mpfa.kernels.sm90.prefill_wgmma import (HALVES, HEAD_DIM, N_BLOCKS, OPERAND_ALIGN, THREADS, TILE_KEYS, _gemm,
                                             rescale, softmax_update)
from mpfa.kernels.sm90.prefill_wgmma_fp8pv import PrefillSm90WgmmaFp8Pv, p_operand_fp8_prescaled
from mpfa.kernels.sm90.prefill_wgmma_fp8qk import e2m1_word_f16x2_lut
from mpfa.kernels.sm90.ptx import (bits_to_f32, cp_async_commit, cp_async_wait, load_shared_u32, load_shared_v4_u32,
                                   load_u32, shuffle_idx)
from mpfa.kernels.sm90.smem_pipeline import load_shared_u16, store_shared_u32, store_shared_v2_u32, store_shared_v4_u32
from mpfa.kernels.sm90.warp_mma import P_SCALE

CONSUMERS = 2  # consumer warpgroups (v5w8's two warpgroups)
REGISTER_FILE = 65536  # 32-bit registers per SM (and per CTA)
CONSUMER_THREADS = CONSUMERS * THREADS  # arrivals expected on ``empty[s]``: every consumer thread
OPERAND_STAGES = 2
RING_STAGES = 8  # raw 64-key tiles; the producer copies RING_STAGES - operand stages tiles ahead
PRODUCER_REGS = 56  # setmaxnreg of the producer warpgroup
CONSUMER_REGS = 224  # setmaxnreg of each consumer warpgroup: 56 + 2 x 224 = 504 = 3 x 168
PRODUCER_BARRIER = 1  # named barrier of the producers' threads (0 is the CTA's)
CONSUMER_BARRIER = 2  # consumer w's named barrier: 2 + w


def ws_ring_copy(step, tiles, stages: int, operand_stages: int = OPERAND_STAGES):
    """(tile index, ring stage) of the copy the producer issues at ``step``: walk step ``step + stages - n`` into
    the ring stage of walk step ``step - n``, the last step whose release (``empty``) the producer has waited for
    (n = ``operand_stages``; no copy when the tile index is negative). The prologue copies walk steps
    0 .. stages - n - 1 (`prefill_staged_layout.ring_prologue`)."""
    ahead = step + stages - operand_stages
    return tiles - 1 - ahead, ahead & (stages - 1)


def stage_parity(step, operand_stages: int = OPERAND_STAGES):
    """(operand stage, phase parity) of walk step ``step``: stage step mod n in its (step // n)-th use."""
    if operand_stages & (operand_stages - 1) == 0:  # a power of two: masks and shifts
        return step & (operand_stages - 1), (step >> (operand_stages.bit_length() - 1)) & 1
    return step % operand_stages, (step // operand_stages) & 1


class PrefillSm90WgmmaWs(PrefillSm90WgmmaFp8Pv):
    """v6: `PrefillSm90WgmmaFp8Pv` (v5w8's consumers, v5's numerics) with a producer warpgroup (module docstring).
    ``warpgroups`` is the consumers' count (2, v5w8's rows per CTA); the CTA has one warpgroup more."""

    ring_stages = RING_STAGES
    operand_stages = OPERAND_STAGES  # v6h: 3
    producer_warpgroups = 1  # v6g: 2
    producer_regs = PRODUCER_REGS
    consumer_regs = CONSUMER_REGS

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True, warpgroups: int = CONSUMERS):
        if warpgroups != CONSUMERS:
            raise ValueError(f"the v6 prefill has {CONSUMERS} consumer warpgroups, got {warpgroups}")
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate, warpgroups=warpgroups)
        self.threads = (self.producer_warpgroups + CONSUMERS) * THREADS  # the launch's block
        launch_regs = REGISTER_FILE // self.threads // 8 * 8  # ptxas' cap under ``.reqntid``: 168 for 384 threads
        assert (self.producer_warpgroups * self.producer_regs + CONSUMERS * self.consumer_regs
                <= self.threads // THREADS * launch_regs)
        self.stages = self.ring_stages
        q_bytes = CONSUMERS * self.qk_bytes
        # K (e4m3) + V^T (e4m3) (+ v6l's FP32 Delta_S), 1 KB-aligned (K's 128-byte swizzle)
        stage_bytes = self.qk_bytes + self.v_bytes + self.staged_ds_bytes()
        self.operand_stage_bytes = -(-stage_bytes // OPERAND_ALIGN) * OPERAND_ALIGN
        ring = q_bytes + self.operand_stages * self.operand_stage_bytes
        # (Q tile of consumer 0, K and V^T of operand stage 0 (stage s: + s operand_stage_bytes), ring)
        self.offsets = (0, q_bytes, q_bytes + self.qk_bytes, ring)
        self.barrier_offset = ring + self.stages * self.tile_bytes  # full[0..n-1], empty[0..n-1]: 8 bytes each
        self.exponent_offset = self.barrier_offset + 8 * 2 * self.operand_stages  # the tile's K exponent per stage
        self.smem_bytes = self.exponent_offset + 4 * self.operand_stages

    def staged_ds_bytes(self) -> int:
        """Bytes of the operand stage's FP32 copy of the tile's Delta_S: none here (v6l: 4 per head and key)."""
        return 0

    @property
    def min_ctas_per_sm(self) -> int:
        """1 CTA per SM (``.minnctapersm 1``; ``.reqntid`` caps the launch at 168 registers for 384 threads, 128
        for v6g's 512)."""
        return 1

    @property
    def full_arrivals(self) -> int:
        """Arrivals that complete ``full[s]``: every producer thread's, after its own copies (v7c: one, with the
        bulk copy's bytes)."""
        return self.producer_threads

    @property
    def producer_threads(self) -> int:
        """Arrivals expected on ``full[s]`` and the producers' named barrier: every producer thread."""
        return self.producer_warpgroups * THREADS

    @property
    def fill_warpgroups(self) -> int:
        return self.producer_warpgroups  # the producers copy both halves of a tile and expand all its K

    @property
    def fill_threads(self) -> int:
        return self.producer_threads  # and transpose all its V

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
        self._roles(q_codes, q_scales, cu_seqlens_q, seq_lens_k, out, lam_scaled,
                    ((k_codes, k_scales, v, delta_s), page_table))

    @cute.jit
    def _roles(self, q_codes: cute.Tensor, q_scales: cute.Tensor, cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor,
               out: cute.Tensor, lam_scaled: Float32, inputs):
        """The CTA: its walk, the mbarriers, then the producer warpgroups' `_produce` (from ``inputs``: the cache
        and page table here, v7's expanded operand images) and the consumers' `_consume`."""
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = self._warp_lane(tid)
        role = warp >> 2  # producers first, then the 2 consumers (warpgroup-uniform)
        block_head, m_block, batch = prefill_grid.cta(self.cta_order, cute.arch.block_idx(), cute.arch.grid_dim())
        q_start = cu_seqlens_q[batch]
        q_len = cu_seqlens_q[batch + 1] - q_start
        kv_len = seq_lens_k[batch]
        cta_row0 = m_block * self.block_m
        # the CTA's walk (v5w8's): the tiles its last row sees, the leading keys all its rows see
        cta_tiles, _, cta_common = tile_math.warp_plan(cta_row0, q_len, kv_len, lane >> 2, causal=self.causal,
                                                       tile_keys=TILE_KEYS, warp_rows=self.block_m)
        walk = (Int32(cta_tiles), cta_common)

        smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN)
        bars = cute.recast_ptr(smem_ptr + self.barrier_offset, dtype=cutlass.Int64)
        if tid == 0:
            for s in cutlass.range_constexpr(self.operand_stages):
                cute.arch.mbarrier_init(bars + s, self.full_arrivals)  # full[s]
                cute.arch.mbarrier_init(bars + self.operand_stages + s, CONSUMER_THREADS)  # empty[s]
        cute.arch.mbarrier_init_fence()
        self._init_operand_stages(tid, smem_ptr.toint())
        cute.arch.barrier()  # the only CTA-wide barrier: the mbarriers are initialised before any role uses them

        if role < self.producer_warpgroups:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self._produce(walk, inputs, batch, block_head, kv_len, tid, warp, smem_ptr, bars)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(walk, q_codes, q_scales, out, lam_scaled, block_head, batch, q_start,
                          q_len, kv_len, cta_row0, role - self.producer_warpgroups, tid & (THREADS - 1), warp & 3, lane,
                          smem_ptr, bars)

    # --- the producer warpgroup -------------------------------------------------------------------------------------

    @cute.jit
    def _produce(self, walk, inputs, batch, block_head, kv_len, tid, warp, smem_ptr, bars):
        """The CTA's tiles into the operand stages (``inputs``: the cache's tensors and the page table): the ring
        prologue, then one `_produce_step` per walk step."""
        cta_tiles, cta_common = walk
        cache, page_table = inputs
        _, kv_head, (first_head, _) = self._heads(block_head, warp)
        group_first = first_head - kv_head * self.group
        sources = self._cache_sources(cache, kv_head, group_first)
        ds_lead = 0 if self.heads % 2 == 0 else sl.ds_lead(group_first)  # bytes to the first head in its word
        threads = (tid, 0, tid, warp)  # (tid, warpgroup, thread and warp in it): one producer, warpgroup 0
        if cutlass.const_expr(self.producer_warpgroups > 1):
            threads = (tid, warp >> 2, tid & (THREADS - 1), warp & 3)
        table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
        smem = smem_ptr.toint()
        ring = smem + self.offsets[3]
        page = cute.make_rmem_tensor((1,), Int32)
        lead = self.stages - self.operand_stages  # tiles copied ahead of the step being filled
        for index in cutlass.range_constexpr(lead):  # walk steps 0 .. lead - 1 in flight
            tile_index, stage = sl.ring_prologue(index, cta_tiles)
            if tile_index >= 0:
                self._copy_wgmma_tile(tile_index, Int32(load_u32(self._page_entry(table_row, HALVES * tile_index))),
                                      ring + stage * self.tile_bytes, kv_len, threads, sources, True)
            cp_async_commit()
        self._fetch_page(page, table_row, HALVES * ws_ring_copy(0, cta_tiles, self.stages, self.operand_stages)[0])
        masked_tiles, full_tiles = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        for step in cutlass.range(masked_tiles, unroll=1):
            self._produce_step(True, step, cta_tiles, page, table_row, ring, kv_len, threads, sources, smem, bars,
                               ds_lead)
        for step in cutlass.range(full_tiles, unroll=1):
            self._produce_step(False, masked_tiles + step, cta_tiles, page, table_row, ring, kv_len, threads, sources,
                               smem, bars, ds_lead)
        cp_async_wait(0)  # only empty groups can be pending here

    def _cache_sources(self, cache, kv_head, group_first):
        """(first byte, first slot) of KV head ``kv_head``'s rows of each cache array (`_copy_tile`'s ``sources``):
        K codes, V, K scales, and the Delta_S words from the one holding query head ``group_first`` of the group."""
        k_codes, k_scales, v, delta_s = cache
        head_slot = kv_head * k_scales.shape[1]
        return ((k_codes.iterator.toint() + kv_head * sl.K_ROW_BYTES, 0),
                (v.iterator.toint() + kv_head * HEAD_DIM, 0),
                (k_scales.iterator.toint(), head_slot),
                (delta_s.iterator.toint() + 4 * sl.ds_first_word(group_first), head_slot))

    @cute.jit
    def _produce_step(self, masked: cutlass.Constexpr, step, cta_tiles, page: cute.Tensor, table_row, ring, kv_len,
                      threads, sources, smem, bars, ds_lead):
        """Walk step ``step``: wait for operand stage s to be free, issue the copy ``RING_STAGES - n`` steps ahead,
        wait for this step's tile, expand K and transpose V into stage s, arrive on ``full[s]``."""
        s, parity = stage_parity(step, self.operand_stages)
        # Both consumers are done with step - n (stage s, its ring stage); the first pass returns at once (parity 1
        # of a fresh mbarrier: the phase before its first is complete).
        cute.arch.mbarrier_wait(bars + self.operand_stages + s, parity ^ 1)
        copy_index, copy_stage = ws_ring_copy(step, cta_tiles, self.stages, self.operand_stages)
        if copy_index >= 0:
            self._copy_wgmma_tile(copy_index, page[0], ring + copy_stage * self.tile_bytes, kv_len, threads, sources,
                                  masked)
        cp_async_commit()
        self._fetch_page(page, table_row,
                         HALVES * ws_ring_copy(step + 1, cta_tiles, self.stages, self.operand_stages)[0])
        cp_async_wait(self.stages - self.operand_stages)  # this thread's copies of this step's tile have landed
        cute.arch.barrier(barrier_id=PRODUCER_BARRIER, number_of_threads=self.producer_threads)  # everyone's have
        _, compute_stage, _ = sl.ring_compute(step, cta_tiles, self.stages)
        stage = ring + compute_stage * self.tile_bytes
        operands = smem + s * self.operand_stage_bytes  # + offsets[1] / [2]: K / V^T of stage s
        e = self._expand_k_e4m3(stage, threads, operands)
        self._expand_v(stage, threads, operands)
        self._stage_delta_s(stage, threads, operands, ds_lead)
        if threads[0] == 0:  # 2**e_k as FP32 bits for the consumers (`_qk_scores`' tile scale)
            store_shared_u32(smem + self.exponent_offset + 4 * s, (e + Uint32(127)) << 23)
        cute.arch.fence_proxy("async.shared", space="cta")  # this thread's operand stores, visible to wgmma
        cute.arch.mbarrier_arrive(bars + s)  # full[s]: one of `producer_threads` arrivals

    def _init_operand_stages(self, tid, smem):
        """Before the CTA's barrier: nothing here (v6n: the ones row of each operand stage's V^T)."""

    def _stage_delta_s(self, stage, threads, operands, ds_lead):
        """The producer's copy of the tile's Delta_S into the operand stage: none here (v6l's FP32 copy); the
        consumers read the ring stage's BF16."""

    # --- the consumer warpgroups ------------------------------------------------------------------------------------

    @cute.jit
    def _consume(self, walk, q_codes: cute.Tensor, q_scales: cute.Tensor, out: cute.Tensor, lam_scaled,
                 block_head, batch, q_start, q_len, kv_len, cta_row0, wg, wg_tid, wg_warp, lane, smem_ptr, bars):
        """Consumer ``wg``: v5w8's warpgroup ``wg`` (its Q tile, rows, softmax state, O) on the operand stages."""
        c = lane & 3
        g = lane >> 2
        head, kv_head, cta_heads = self._heads(block_head, wg_warp)
        row0, warp_row0, num_tiles, limits, _ = self._warpgroup_plan(cta_row0, wg, wg_warp, q_len, kv_len, g)
        smem = smem_ptr.toint()
        q_offset = cute.assume(self.offsets[0] + wg * self.qk_bytes, divby=self.qk_bytes)
        mma_qk, s_q, _ = self._qk_operands(smem_ptr, q_offset, self.offsets[1])
        mma_pv, _ = self._pv_operands(smem_ptr, self.offsets[2])
        thr_qk = mma_qk.get_slice(wg_tid)
        thr_pv = mma_pv.get_slice(wg_tid)
        frag_q = thr_qk.make_fragment_A(thr_qk.partition_A(s_q))
        frag_p = thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_KEYS)))
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((64, TILE_KEYS)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, self.pv_n)), Float32)  # (v6n: + the row sums)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = Float32(0.0)
        state = cute.make_rmem_tensor((self.state_size,), Float32)
        state[0] = -math.inf
        state[1] = -math.inf
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)
        self._row_exponents(state, q_scales, q_start, q_len, warp_row0, head, g)
        self._expand_q(q_codes, q_scales, q_start, q_len, row0, cta_heads[0], wg_tid, smem + q_offset)
        cute.arch.fence_proxy("async.shared", space="cta")  # the Q stores, visible to wgmma
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER + wg, number_of_threads=THREADS)  # the warpgroup's Q tile
        self._pingpong_start(wg)

        first_head, head_in_cta = cta_heads
        ds_lane = self._ds_lane(first_head - kv_head * self.group, head_in_cta, c)
        ring = smem + self.offsets[3]
        fixed = (mma_qk, mma_pv, thr_qk, thr_pv, frag_q, frag_p, acc_s, acc_o)
        self._consume_walk(walk, num_tiles, ring, fixed, state, lam_scaled, ds_lane, limits, c, smem_ptr, bars)
        self._pingpong_end(wg)
        self._store_rows(state, acc_o, out, q_start, q_len, warp_row0, head, g, c)

    def _ds_lane(self, group_first, head_in_cta, c):
        """The lane's Delta_S offset in a ring stage (`prefill_staged_layout.ds_lane_base`)."""
        return sl.ds_lane_base(self.heads, group_first, head_in_cta, c)

    @cute.jit
    def _consume_walk(self, walk, num_tiles, ring, fixed, state: cute.Tensor, lam_scaled, ds_lane, limits, c,
                      smem_ptr, bars):
        """The consumer's steps of the CTA's walk: the masked tiles, then the whole ones, one `_consume_step` each."""
        cta_tiles, cta_common = walk
        masked_tiles, full_tiles = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        for step in cutlass.range(masked_tiles, unroll=1):
            self._consume_step(True, step, cta_tiles, num_tiles, ring, fixed, state, lam_scaled, ds_lane, limits, c,
                               smem_ptr, bars)
        for step in cutlass.range(full_tiles, unroll=1):
            self._consume_step(False, masked_tiles + step, cta_tiles, num_tiles, ring, fixed, state, lam_scaled,
                               ds_lane, limits, c, smem_ptr, bars)

    def _pingpong_start(self, wg):
        """Before consumer ``wg``'s walk: nothing here (v6f: consumer 1 gives consumer 0 the first QK turn)."""

    def _pingpong_end(self, wg):
        """After consumer ``wg``'s walk: nothing here (v6f: consumer 0 takes consumer 1's last hand-over)."""

    @cute.jit
    def _consume_step(self, masked: cutlass.Constexpr, step, cta_tiles, num_tiles, ring, fixed, state: cute.Tensor,
                      lam_scaled, ds_lane, limits, c, smem_ptr, bars):
        """Walk step ``step`` of one consumer: wait for ``full[s]``, v5's tile body on operand stage s (skipped by
        the earlier consumer on a leading tile none of its rows sees), arrive on ``empty[s]`` -- on every step."""
        mma_qk, mma_pv, thr_qk, thr_pv, frag_q, frag_p, acc_s, acc_o = fixed
        s, tile_index, stage = self._await_step(step, cta_tiles, ring, state, smem_ptr, bars)
        operands = (frag_q, self._k_fragment(thr_qk, smem_ptr, s), frag_p, self._vt_fragments(thr_pv, smem_ptr, s))
        mmas = (mma_qk, mma_pv, operands, acc_s, acc_o)
        if cutlass.const_expr(masked):
            if tile_index < num_tiles:  # v5w8's skip (warpgroup-uniform; only the earlier consumer, at the start)
                self._wgmma_tile(masked, tile_index * TILE_KEYS, stage, mmas, state, lam_scaled, ds_lane, limits, c)
            else:  # the skipped tile's QK turn (v6f's ping-pong; nothing in v6)
                self._qk_turn()
                self._qk_issued()
        else:
            self._wgmma_tile(masked, tile_index * TILE_KEYS, stage, mmas, state, lam_scaled, ds_lane, limits, c)
        # Both wgmmas of the tile were waited for (`_gemm`) and its Delta_S read: release stage s and its ring stage.
        cute.arch.mbarrier_arrive(bars + self.operand_stages + s)  # empty[s]: one of 256 arrivals

    @cute.jit
    def _await_step(self, step, cta_tiles, ring, state: cute.Tensor, smem_ptr, bars):
        """Wait for ``full[s]`` of walk step ``step``; the tile's K exponent into ``state`` -> (operand stage s,
        tile index, address of the tile's raw ring stage, where its Delta_S stays)."""
        s, parity = stage_parity(step, self.operand_stages)
        cute.arch.mbarrier_wait(bars + s, parity)  # full[s]: the producer filled stage s for this step
        tile_index, compute_stage, _ = sl.ring_compute(step, cta_tiles, self.stages)
        state[self._TILE_SCALE] = bits_to_f32(load_shared_u32(smem_ptr.toint() + self.exponent_offset + 4 * s))
        return s, tile_index, ring + compute_stage * self.tile_bytes

    def _k_fragment(self, thr_qk, smem_ptr, s):
        """QK's B operand: the e4m3 K tile of operand stage ``s``."""
        k_offset = cute.assume(self.offsets[1] + s * self.operand_stage_bytes,
                               divby=math.gcd(self.offsets[1], self.operand_stage_bytes))
        _, _, s_k = self._qk_operands(smem_ptr, self.offsets[0], k_offset)
        return thr_qk.make_fragment_B(thr_qk.partition_B(s_k))

    def _vt_fragments(self, thr_pv, smem_ptr, s):
        """PV's B operands: the V^T tile of operand stage ``s``, one per PV N tile."""
        v_offset = cute.assume(self.offsets[2] + s * self.operand_stage_bytes,
                               divby=math.gcd(self.offsets[2], self.operand_stage_bytes))
        _, s_vts = self._pv_operands(smem_ptr, v_offset)
        return tuple(thr_pv.make_fragment_B(thr_pv.partition_B(s_vt)) for s_vt in s_vts)


# --- opt-in variants (kernels v6a .. v6d; profiles/NOTES.md, "Prefill v6 variants") -----------------------------------

class PrefillSm90WgmmaWsPv(PrefillSm90WgmmaWs):
    """v6a: v6 with each tile's P V in **one** ``m64n128k32`` wgmma (2 k-steps) into its own 64-register fresh
    accumulator (v6: two ``m64n64k32`` halves into S's registers, each waited for), which the consumers' 224
    registers now hold. O's rescale (vote-skipped as in v6) is issued while that wgmma runs (O and the accumulator
    are different registers), then one wait and 64 FADD. Every value goes through v6's operations (O alpha rounded,
    then + the tile's P V rounded), so the output is v6's bit for bit -- provided the FP8 wgmma sums an output
    element's 32-product k-steps the same way whatever its N (each element is its own dot product; the GPU test
    checks it)."""

    pv_n = HEAD_DIM  # v5's knob: one fresh m64n128k32 accumulator
    fold_rescale = False  # True (v6b): O = O alpha + P V in one FFMA on every tile

    @cute.jit
    def _pv(self, mmas, probs: list, alphas: list):
        """O = alpha O + e4m3(448 P) V^T: the PV wgmma into a fresh accumulator, issued first; then O's rescale
        under it (``fold_rescale`` False) and O += P V after its wait, or (True) after the wait O = O alpha + P V
        in one FFMA per register on every tile, with no vote: where alpha is 1 that is O + P V rounded once, the
        FADD's result (a vote-skipped branch of FFMA and FADD gets merged by the compiler into FMUL + FADD)."""
        mma_pv, operands, acc_o = mmas[1], mmas[2], mmas[4]
        self._p_operand(probs, cute.recast_tensor(operands[2], Uint32))
        acc_pv = cute.make_rmem_tensor(mma_pv.get_slice(0).partition_shape_C((64, HEAD_DIM)), Float32)
        _gemm(mma_pv, acc_pv, operands[2], operands[3][0], fresh=True, wait=False)
        if cutlass.const_expr(not self.fold_rescale):
            rescale(acc_o, alphas)
            warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = acc_o[i] + acc_pv[i]
        else:
            warpgroup.wait_group(0)
            fold_pv(acc_o, acc_pv, alphas)


@cute.jit
def fold_pv(acc_o: cute.Tensor, acc_pv: cute.Tensor, alphas) -> None:
    """O = O alpha + P V, one FFMA per register (O + P V exactly where alpha is 1)."""
    for i in cutlass.range_constexpr(cute.size(acc_o)):
        acc_o[i] = acc_o[i] * alphas[(i >> 1) & 1] + acc_pv[i]


class PrefillSm90WgmmaWsPvFold(PrefillSm90WgmmaWsPv):
    """v6b: v6a with O's rescale folded into the add, O = O alpha + P V: 64 FFMA on every tile, in place of v6a's
    64 FADD plus, where a row's maximum moved, the vote-skipped 64 FMUL (no vote, no branch). Where alpha is 1 the
    FFMA is the FADD; where not, O alpha is no longer rounded before the add, so not v6's output bit for bit (an
    ulp of O apart at most per rescaled tile; the oracle bounds are v6's)."""

    fold_rescale = True


class PrefillSm90WgmmaWsLut(PrefillSm90WgmmaWs):
    """v6c: v6 with the producer's NVFP4 -> e4m3 K expansion decoding e2m1 by byte-permute table look-up
    (`prefill_wgmma_fp8qk.e2m1_word_f16x2_lut`: the FP16 of each value directly, no x 2**14 HMUL2; 15 integer
    operations per code word against 15 + 4 HMUL2). The same FP16 values, so the same K operand tile and v6's
    output bit for bit."""

    _k_decode = staticmethod(e2m1_word_f16x2_lut)


class PrefillSm90WgmmaWsPvFoldLut(PrefillSm90WgmmaWsPvFold):
    """v6d: v6b's consumers (one PV wgmma, rescale folded into FFMA) and v6c's producer (table look-up K
    expansion): v6b's output bit for bit."""

    _k_decode = staticmethod(e2m1_word_f16x2_lut)


def unscaled_lam(lam_scaled):
    """The launch's lam (for scores S 2**-7) for the unscaled scores S of v6e and its variants."""
    return lam_scaled * Float32(2.0 ** -SCORE_SCALE_LOG2)


class PrefillSm90WgmmaWsUnscaled(PrefillSm90WgmmaWsPvFoldLut):
    """v6e: v6d with the scores unscaled (``score_scale_log2`` 0): S = q8 k8 2**(e_q + e_k) + Delta_S instead of
    S 2**-7 = q8 k8 2**(e_q + e_k - 7) + Delta_S 2**-7, and lam 2**-7 in place of the launch's lam 2**7 (one
    multiply, hoisted out of the tile loops). Saves the 16 FMUL per tile that scale Delta_S. S' = 2**7 S exactly
    and lam' S' = lam S as real numbers, so the softmax's FFMA / exp2 / max see the same values: v6d's output bit
    for bit (short of scores below 2**-119 in magnitude, where FP32 would round 2**-7 S as a subnormal)."""

    score_scale_log2 = 0

    @cute.jit
    def _wgmma_tile(self, masked: cutlass.Constexpr, tile, stage, mmas, state: cute.Tensor, lam_scaled, ds_lane,
                    limits, c):
        PrefillSm90WgmmaWsPvFoldLut._wgmma_tile(self, masked, tile, stage, mmas, state, unscaled_lam(lam_scaled),
                                                ds_lane, limits, c)


PINGPONG_BARRIER = 4  # v6f, v7f .. v7h: consumer w's turn is named barrier 4 + w (both consumers: 256 threads)


class ConsumerPingPong:
    """FA3's consumer ping-pong, mixed into a two-consumer kernel (v6f, v7f .. v7h): the consumers take turns issuing
    their wgmmas, so that one's softmax runs while the other's wgmmas are on the tensor pipe, instead of both
    issuing at once and then both running their softmax with the tensor pipe idle. Only the order of the issues
    changes: the kernel's output bit for bit.

    Protocol. Named barrier ``PINGPONG_BARRIER + w`` (256 threads) is consumer w's turn. Consumer w, once per step
    of its walk, does ``bar.sync`` on its own barrier before issuing (`_qk_turn`: its 128 threads plus 128 arrivals
    of the other consumer complete the barrier), then ``bar.arrive`` on the other's barrier once the step's wgmmas
    are issued (`_qk_issued`, before waiting for them). Consumer 1 arrives on barrier 4 once before its walk
    (`_pingpong_start`: consumer 0 goes first), and consumer 0 syncs on it once after its walk (`_pingpong_end`: the
    arrival of consumer 1's last step), so every arrival has its sync: barrier 4 sees 1 + T arrivals and T + 1
    syncs, barrier 5 T and T (T = the CTA's walk in steps, the same for both consumers). The issues alternate
    0, 1, 0, 1, ...: consumer 0's issue of step p needs consumer 1's of step p - 1, and consumer 1's of step p needs
    consumer 0's of step p. Neither barrier holds arrivals of two phases: a consumer's next arrival on a barrier
    needs its own next turn, which needs the other's sync on that barrier. The producer never touches barriers 4
    and 5; deadlock-freedom with the ``full`` / ``empty`` mbarriers is argued by each kernel."""

    def _consumer(self):
        """This warpgroup's consumer index (warpgroup-uniform): the consumers follow the producer warpgroups."""
        return (cute.arch.thread_idx()[0] >> 7) - self.producer_warpgroups

    def _qk_turn(self):
        cute.arch.barrier(barrier_id=PINGPONG_BARRIER + self._consumer(), number_of_threads=CONSUMER_THREADS)

    def _qk_issued(self):
        cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + 1 - self._consumer(),
                                 number_of_threads=CONSUMER_THREADS)

    @cute.jit
    def _pingpong_start(self, wg):
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER, number_of_threads=CONSUMER_THREADS)

    @cute.jit
    def _pingpong_end(self, wg):
        if wg == 0:
            cute.arch.barrier(barrier_id=PINGPONG_BARRIER, number_of_threads=CONSUMER_THREADS)


class PrefillSm90WgmmaWsPingPong(ConsumerPingPong, PrefillSm90WgmmaWsUnscaled):
    """v6f: v6e with `ConsumerPingPong` on its QK wgmmas: a turn per 64-key walk step (a leading tile that the
    earlier consumer skips too, `_consume_step`), taken right before the QK is issued and handed over right after.
    One consumer's softmax, PV and O update run while the other's QK is on the tensor pipe. v6e's output bit for bit.

    No deadlock with the mbarriers (``full[s]``, ``empty[s]``): the consumers are at most one step apart (consumer 1
    at step p - 1 or p while consumer 0 is at p), and the producer fills step p + 1 only after both released step
    p - 1, so every ``full`` wait a consumer can reach is for a step the producer can fill without the waiting
    consumer's turn. A consumer blocked on its turn (step p) waits for the other's QK issue of step p - 1 (consumer
    0) or p (consumer 1); that consumer has released everything before that step, its ``full`` wait is for a step
    <= p, which the producer fills (it needs only releases of steps <= p - 2, both done), and its turn is the one
    the blocked consumer handed over at its previous issue. Not FA3's intra-warpgroup overlap (QK of tile j + 1
    issued with PV of tile j): that is v7f."""


TWO_PRODUCERS_CONSUMER_REGS = 200  # v6g: 2 x 56 + 2 x 200 = 512 = 4 warpgroups x the 128 of ``.reqntid 512``


class PrefillSm90WgmmaWsTwoProducers(PrefillSm90WgmmaWsUnscaled):
    """v6g: v6e with **two producer warpgroups** (CTA = 4 warpgroups, 512 threads). The session-16 bench of the
    variants says v6's producer binds: v6c (producer -4% instructions) took 2.8% off v6, v6a / v6b (consumers -2 /
    -5%) nothing, and v6f's ping-pong was slower than v6e (profiles/NOTES.md "Session 16, CPU: v6g"). One producer
    warp per scheduler issues ~430 mostly dependent instructions per tile-step. Here the producers split the tile
    as v3w8's two warpgroups do (`fill_warpgroups` 2: warpgroup w copies and expands half w of the K chunks, the V
    transpose is spread over their 256 threads): each producer warp issues about half as much. ``full[s]`` expects
    256 arrivals and the producers' named barrier 256 threads; the consumers are v6e's at 200 registers (v6e names
    up to R190). Same values stored in the operand stages, so **v6e's output bit for bit**."""

    producer_warpgroups = 2
    consumer_regs = TWO_PRODUCERS_CONSUMER_REGS


class PrefillSm90WgmmaWsThreeStages(PrefillSm90WgmmaWsTwoProducers):
    """v6h: v6g with **3 operand stages** (+16 KB: ~168 KB compensated, still 1 CTA per SM): the producers may fill
    step p once both consumers released step p - 3 (v6g: p - 2), so a consumer that falls behind by a step no
    longer stalls the producers, and the raw ring runs 5 tiles ahead instead of 6 (its stage of step p - 3 is the
    one freed; `ws_ring_copy`). For the case where v6g is bound by the producer / consumer handshake rather than by
    either side's instructions. Same values: **v6e's output bit for bit**."""

    operand_stages = 3


class PrefillSm90WgmmaWsOverlap(PrefillSm90WgmmaWsUnscaled):
    """v6i: v6e with FA3's **intra-warpgroup overlap** and 3 operand stages. v6g / v6h ran at v6e's speed although
    they halved the producer's instructions or added a stage (profiles/NOTES.md "Session 17 sitting"), which
    leaves each consumer's serial chain per tile: QK issued, waited for, softmax, PV issued, waited for, O updated.
    Here a consumer at step p issues QK of step p and then PV of step p - 1 (its P packed in registers at the end
    of step p - 1, V^T still in its operand stage), waits for QK only (``wait_group 1``), computes step p's scores
    while PV p - 1 runs, waits for PV p - 1, folds it into O (O = O alpha_(p-1) + P_(p-1) V_(p-1), v6e's FFMA),
    releases step p - 1, and packs P_p. One wgmma round trip per tile instead of two. (ptxas places the PV wait
    after the scores and the row maxima, before the exponentials, wherever the PTX puts it: read from the SASS,
    checked by the compile test.) A consumer's first tile issues no PV; the walk ends with the last PV
    (`_overlap_drain`). The leading steps a consumer skips (causal: tiles none of its rows sees) are released at
    once, as in v6e.

    Release moves one step later (step p - 1 is released during step p), so with v6e's 2 operand stages the
    producer could fill step p + 1 only after the consumers' scores of step p: 3 operand stages (v6h's) give it a
    step of slack. One producer warpgroup (v6e's; v6g's second gained nothing) leaves the consumers 224 registers
    for the accumulator of PV p - 1 (64) held across step p's scores. Same operations on the same values: **v6e's
    output bit for bit**."""

    operand_stages = 3

    @cute.jit
    def _consume_walk(self, walk, num_tiles, ring, fixed, state: cute.Tensor, lam_scaled, ds_lane, limits, c,
                      smem_ptr, bars):
        """Skipped leading steps released; then the first tile (QK, softmax, P), the overlapped steps (masked,
        then whole), the last PV."""
        cta_tiles, cta_common = walk
        masked_tiles, _ = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        lam = unscaled_lam(lam_scaled)
        acc_pv = cute.make_rmem_tensor(fixed[3].partition_shape_C((64, HEAD_DIM)), Float32)
        alphas = cute.make_rmem_tensor((2,), Float32)  # the pending PV's rows' alphas
        pipe = (ring, fixed, acc_pv, alphas, state, lam, ds_lane, limits, c, smem_ptr, bars)
        first = cta_tiles - cutlass.min(num_tiles, cta_tiles)  # the consumer's first step
        for step in cutlass.range(first, unroll=1):
            s, parity = stage_parity(step, self.operand_stages)
            cute.arch.mbarrier_wait(bars + s, parity)  # full[s]
            cute.arch.mbarrier_arrive(bars + self.operand_stages + s)  # empty[s]: nothing of it is read
        if first < cta_tiles:
            if first < masked_tiles:
                self._overlap_step(True, False, first, cta_tiles, pipe)
            else:
                self._overlap_step(False, False, first, cta_tiles, pipe)
            for step in cutlass.range(first + 1, masked_tiles, unroll=1):
                self._overlap_step(True, True, step, cta_tiles, pipe)
            for step in cutlass.range(cutlass.max(first + 1, masked_tiles), cta_tiles, unroll=1):
                self._overlap_step(False, True, step, cta_tiles, pipe)
            self._overlap_drain(cta_tiles - 1, pipe)

    @cute.jit
    def _overlap_step(self, masked: cutlass.Constexpr, pending: cutlass.Constexpr, step, cta_tiles, pipe):
        """Step ``step``: wait for ``full[s]``, issue QK (and, ``pending``, PV of step - 1), the scores and softmax,
        fold PV step - 1 into O and release its stage, pack this step's P; its alphas kept for the next."""
        ring, fixed, acc_pv, alphas, state, lam, ds_lane, limits, c, smem_ptr, bars = pipe
        mma_qk, mma_pv, thr_qk, thr_pv, frag_q, frag_p, acc_s, acc_o = fixed
        s, tile_index, stage = self._await_step(step, cta_tiles, ring, state, smem_ptr, bars)
        mmas = (mma_qk, mma_pv, (frag_q, self._k_fragment(thr_qk, smem_ptr, s)), acc_s, acc_o)
        self._qk_issue(masked, tile_index * TILE_KEYS, mmas, limits, c)
        if cutlass.const_expr(pending):
            previous = stage_parity(step - 1, self.operand_stages)[0]
            self._pv_issue(previous, pipe)
            warpgroup.wait_group(1)  # QK of this step; PV of the previous one may still run
        else:
            warpgroup.wait_group(0)
        probs, new_alphas = softmax_update(self._qk_finish(stage, mmas, state, ds_lane), state, lam)
        if cutlass.const_expr(pending):
            self._retire_pv(previous, pipe)
        self._p_operand(probs, cute.recast_tensor(frag_p, Uint32))
        for r in cutlass.range_constexpr(2):
            alphas[r] = new_alphas[r]

    @cute.jit
    def _pv_issue(self, s, pipe):
        """The PV wgmma (P in its A registers, V^T of operand stage ``s``) into the fresh accumulator, issued and
        committed, not waited for."""
        _, fixed, acc_pv, _, _, _, _, _, _, smem_ptr, _ = pipe
        mma_pv, thr_pv, frag_p = fixed[1], fixed[3], fixed[5]
        (frag_vt,) = self._vt_fragments(thr_pv, smem_ptr, s)
        _gemm(mma_pv, acc_pv, frag_p, frag_vt, fresh=True, wait=False)

    @cute.jit
    def _retire_pv(self, s, pipe):
        """Wait for the pending PV (operand stage ``s``), fold it into O with its alphas, release stage s."""
        acc_pv, alphas, bars, acc_o = pipe[2], pipe[3], pipe[10], pipe[1][7]
        warpgroup.wait_group(0)  # its P registers and V^T stage are free
        fold_pv(acc_o, acc_pv, alphas)
        cute.arch.mbarrier_arrive(bars + self.operand_stages + s)  # empty[s]: one of 256 arrivals

    @cute.jit
    def _overlap_drain(self, step, pipe):
        """The walk's last PV (step ``step``), folded into O; its stage released."""
        s = stage_parity(step, self.operand_stages)[0]
        self._pv_issue(s, pipe)
        self._retire_pv(s, pipe)


class PrefillSm90WgmmaWsPairFold(PrefillSm90WgmmaWsUnscaled):
    """v6j: v6e with the PV fold every second tile. v6e adds each tile's P V (a fresh FP8 wgmma accumulator: Hopper's
    FP8 wgmma does not sum in FP32) to O with 64 FFMA per consumer thread and tile, 32 of the ~412 instructions of
    its issue-bound tile body (profiles/NOTES.md, "Session 18 sitting: the profiles"). Here a pair of tiles shares
    the accumulator: the first tile's PV starts it, the second's accumulates onto it (4 k-steps of 32 keys, the
    promotion interval DeepSeek-V3 uses for FP8 GEMMs), and only then O = O alpha_1 alpha_2 + acc. Where the second
    tile raises a row's maximum, the pending accumulator is rescaled by its alpha first (vote-skipped, as O's rescale
    in v6: walking the keys last to first that is rare). A walk with an odd number of tiles folds its last one after
    the walk. Not v6e's bits: each pair's P V is summed by the FP8 wgmma across 128 keys instead of 64 (and O alpha
    is rounded once per pair); the GPU test bounds it against v6e by v5's allowance for PV on FP8."""

    @cute.jit
    def _consume_walk(self, walk, num_tiles, ring, fixed, state: cute.Tensor, lam_scaled, ds_lane, limits, c,
                      smem_ptr, bars):
        """v6e's walk with the pair's accumulator and its state (pending tile, the pair's alphas so far), then the
        fold of a pending last tile."""
        acc_pv = cute.make_rmem_tensor(fixed[3].partition_shape_C((64, HEAD_DIM)), Float32)
        pair = cute.make_rmem_tensor((3,), Float32)  # 1 while a tile's P V waits in acc_pv; its rows' alphas
        pair[0] = Float32(0.0)
        self._pair_state = (acc_pv, pair)  # read by `_pv` in the steps traced below
        PrefillSm90WgmmaWsUnscaled._consume_walk(self, walk, num_tiles, ring, fixed, state, lam_scaled, ds_lane,
                                                 limits, c, smem_ptr, bars)
        if pair[0] != Float32(0.0):
            fold_pv(fixed[7], acc_pv, [pair[1], pair[2]])

    @cute.jit
    def _pv(self, mmas, probs: list, alphas: list):
        """The tile's P V onto the pair's accumulator (fresh on a pair's first tile), waited for; on the second
        tile O = O alpha_1 alpha_2 + acc."""
        mma_pv, operands, acc_o = mmas[1], mmas[2], mmas[4]
        acc_pv, pair = self._pair_state
        self._p_operand(probs, cute.recast_tensor(operands[2], Uint32))
        if pair[0] != Float32(0.0):
            rescale(acc_pv, alphas)  # the first tile's P V, to this tile's maxima (vote-skipped)
            _gemm(mma_pv, acc_pv, operands[2], operands[3][0])
            fold_pv(acc_o, acc_pv, [pair[1] * alphas[0], pair[2] * alphas[1]])
            pair[0] = Float32(0.0)
        else:
            _gemm(mma_pv, acc_pv, operands[2], operands[3][0], fresh=True)
            pair[0] = Float32(1.0)
            pair[1] = alphas[0]
            pair[2] = alphas[1]


class PScaleInExponent:
    """e4m3(448 P)'s 448 folded into the exponent (v6k, v6l .. v7): P' = 2**(lam S - (lam m - log2 448)) = 448 P
    from the same MUFU, one subtraction per row instead of a multiply per P (32 FMUL per consumer thread and 64
    keys), the row sums l' = 448 l, and O / l' at the end. log2(448) rounded to FP32 makes P' = 448.00016 P:
    O = sum P' V / sum P' cancels the factor; only an e4m3 rounding of P' that sits within ~4e-7 of a rounding
    boundary can come out one step apart from e4m3(448 P)."""

    p_scale_log2 = math.log2(P_SCALE)
    l_scale = 1.0
    _p_operand = staticmethod(p_operand_fp8_prescaled)


class PrefillSm90WgmmaWsPairFoldExp(PScaleInExponent, PrefillSm90WgmmaWsPairFold):
    """v6k: v6j with e4m3(448 P)'s 448 folded into the exponent (`PScaleInExponent`)."""


def wide_walk(cta_tiles, masked_tiles) -> tuple:
    """v6l's walk in 128-key steps, aligned to the sequence's 128-key tiles (64-key tiles 2j, 2j + 1: those of the
    reference's ``block_n`` 128, so that P is rounded against the same maxima) -> (lead, pairs holding a masked tile,
    pairs): an odd walk's first step (its last 64-key tile, index cta_tiles - 1, even) goes alone (``lead`` 1), pair
    k is walk steps lead + 2k, lead + 2k + 1; the masked tiles come first in the walk."""
    lead = cta_tiles & 1
    pairs = (cta_tiles - lead) >> 1
    return lead, cutlass.min(cutlass.max(masked_tiles - lead + 1, 0) >> 1, pairs), pairs


def ds_staged_offset(head, key):
    """Byte offset of (head, key)'s FP32 Delta_S in v6l's staged tile: one 16-byte word per (head, 16 keys, lane
    c) holding keys 16 i + 2c, + 1, 16 i + 8 + 2c, + 1 (the lane's scores of column blocks 2i, 2i + 1)."""
    return ((((head * (TILE_KEYS // 16) + (key >> 4)) * 4 + ((key >> 1) & 3)) * 16) + ((key >> 3) & 1) * 8
            + (key & 1) * 4)


def ds_staged_read(head, c, i: int):
    """Offset of the 16-byte word of lane ``c`` of head ``head``'s warp for column blocks 2i, 2i + 1 (key
    16 i + 8 b + 2c + half at word slot 2b + half)."""
    return ds_staged_offset(head, 16 * i + 2 * c)


WIDE_OPERAND_STAGES = 4  # v6l: two 64-key steps per consumer step, and two more the producer fills meanwhile


class PrefillSm90WgmmaWsWideTile(PScaleInExponent, PrefillSm90WgmmaWsUnscaled):
    """v6l: v6k's numerics on **128-key consumer steps**. The producer still fills 64-key operand stages (4 of them:
    while the consumers work on steps p, p + 1 it fills p + 2, p + 3); a consumer takes two at a time: both QK
    wgmmas issued into two 32-register accumulators (the second after its own ``full`` wait, so the first runs
    meanwhile), one wait, one online-softmax update over the 128 keys (one row maximum, one alpha, one exp2 of it,
    per 128 keys instead of 64), both tiles' P packed, both PV wgmmas into one fresh accumulator (4 k-steps of 32
    keys, v6j's promotion interval), one fold O = O alpha + P V, both stages released. So per 128 keys: one
    fence / commit / wait per GEMM, one vote-free fold, no pending-accumulator rescale (v6j's), half the per-row
    softmax work. The pairs are the sequence's 128-key tiles (`wide_walk`): an odd walk's first step is a one-stage
    step of the same code (``single``). The leading tiles a consumer's rows do not see (causal, the earlier consumer)
    go through the masked body (all -inf, P = 0) instead of being skipped: a pair's second tile may be seen.

    Not v6k's bits: P is taken against the maximum over the 128-key tile (v6k: 64, the pair's first tile rescaled
    later), so the e4m3 roundings of P differ where the two maxima do (the reference with ``block_n`` 64 and 128:
    3.3-5.5e-3 rms apart on the GPU tests' inputs): the reference with ``block_n`` 128 rounds P as v6l does, and is
    its GPU tests' oracle
    (its K scales per 128 keys instead of the kernel's 64 differ only where a value turns subnormal)."""

    operand_stages = WIDE_OPERAND_STAGES
    any_group = True  # 4 heads x 16 rows or (group 5) 1 head x 64 rows per consumer warpgroup
    deferred_fold = False  # v7b: a step's PV folded into O in the next step, under that step's QK wgmmas
    ds_ahead = False  # v7i: a pair's Delta_S loaded ahead of its QK waits (`_pair_scores`)
    ablation = FULL  # the v7 kernels' timing ablations (`_softmax`, `_pv_gemm`; `ablation.PRE_LADDER`)
    _PENDING_ALPHA = 7  # (deferred_fold) the state's slots for the pending fold's alphas, rows g and g + 8

    def staged_ds_bytes(self) -> int:
        """FP32 Delta_S of the CTA's heads x 64 keys (`ds_staged_offset`; none in the direct build)."""
        return 4 * self.heads * TILE_KEYS if self.compensate else 0

    @cute.jit
    def _stage_delta_s(self, stage, threads, operands, ds_lead):
        """The tile's BF16 Delta_S (ring stage ``stage``, [key][head] per 32-key half, the CTA's first head
        ``ds_lead`` bytes into the key's first word) -> FP32 bits in the operand stage, in the consumers' order
        (`ds_staged_offset`), in units of 2 keys of one head (unit u: head u / 32, keys 2 (u % 32), + 1; one 8-byte
        store) taken by the producer threads in turn (4 heads and one producer warpgroup: warp w head w, lane l keys
        2l, 2l + 1), so each consumer lane reads 4 keys' Delta_S with one 16-byte load, already FP32 (v6k: 2 loads
        of 2 bytes and 2 shifts per 4 keys in the consumer's serial tile body)."""
        if cutlass.const_expr(self.compensate):
            units = self.heads * TILE_KEYS // 2
            for r in cutlass.range_constexpr(-(-units // self.producer_threads)):
                unit = threads[0] + self.producer_threads * r
                if cutlass.const_expr(self.producer_threads * (r + 1) <= units):
                    self._stage_keys(stage, unit, operands, ds_lead)
                else:
                    if unit < units:
                        self._stage_keys(stage, unit, operands, ds_lead)

    def _stage_keys(self, stage, unit, operands, ds_lead):
        """Delta_S unit ``unit`` (`_stage_delta_s`)."""
        head = unit >> 5
        key = (unit & 31) << 1
        words = sl.ds_words(self.heads)
        source = stage + (key >> 5) * self.stage_bytes + sl.DS_OFFSET + 4 * words * (key & 31) + ds_lead + 2 * head
        target = operands + self.offsets[2] + self.v_bytes + ds_staged_offset(head, key)
        store_shared_v2_u32(target, load_shared_u16(source) << 16, load_shared_u16(source + 4 * words) << 16)

    def _ds_lane(self, group_first, head_in_cta, c):
        """The lane's offset in the staged FP32 Delta_S tile."""
        return ds_staged_read(head_in_cta, c, 0)

    def _ds_words(self, s, ds_lane, smem) -> list | None:
        """This lane's staged FP32 Delta_S of operand stage ``s`` (one 16-byte load per 2 column blocks); None in
        the direct build."""
        if not self.compensate:
            return None
        base = smem + self.offsets[2] + self.v_bytes + s * self.operand_stage_bytes + ds_lane
        return [load_shared_v4_u32(base, ds_staged_read(0, 0, i)) for i in range(N_BLOCKS // 2)]

    def _staged_scores(self, s, acc_s: cute.Tensor, state: cute.Tensor, ds_lane, smem, words=None) -> list:
        """The scores of operand stage ``s``'s tile from its QK accumulator (waited for): times the row and tile
        scales, plus the staged FP32 Delta_S (``words``: loaded ahead by `_ds_words`, else loaded here)."""
        scale = [state[self._ROW_SCALE + r] * state[self._TILE_SCALE] for r in range(2)]
        if cutlass.const_expr(not self.compensate):
            return [[acc_s[4 * block + i] * scale[i >> 1] for i in range(4)] for block in range(N_BLOCKS)]
        words = self._ds_words(s, ds_lane, smem) if words is None else words
        return [[acc_s[4 * block + i] * scale[i >> 1] + bits_to_f32(words[block >> 1][2 * (block & 1) + (i & 1)])
                 for i in range(4)] for block in range(N_BLOCKS)]

    @cute.jit
    def _consume_walk(self, walk, num_tiles, ring, fixed, state: cute.Tensor, lam_scaled, ds_lane, limits, c,
                      smem_ptr, bars):
        """An odd walk's first step alone, then pairs of steps (those with a masked tile first, then the whole ones):
        `wide_walk`."""
        cta_tiles, cta_common = walk
        masked_tiles, _ = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        lead, masked_pairs, pairs = wide_walk(cta_tiles, masked_tiles)
        pipe = self._walk_pipe(ring, fixed, state, unscaled_lam(lam_scaled), ds_lane, limits, c, smem_ptr, bars)
        self._walk_start(pipe)
        if lead:
            if masked_tiles > 0:
                self._wide_step(True, Int32(0), cta_tiles, pipe, single=True)
            else:
                self._wide_step(False, Int32(0), cta_tiles, pipe, single=True)
        for pair in cutlass.range(masked_pairs, unroll=1):
            self._wide_step(True, lead + 2 * pair, cta_tiles, pipe)
        for pair in cutlass.range(masked_pairs, pairs, unroll=1):
            self._wide_step(False, lead + 2 * pair, cta_tiles, pipe)
        self._walk_end(pipe)

    def _walk_pipe(self, ring, fixed, state: cute.Tensor, lam, ds_lane, limits, c, smem_ptr, bars) -> tuple:
        """What every step of the walk uses: the arguments, the second tile's S and P, the PV accumulator."""
        thr_qk, thr_pv = fixed[2], fixed[3]
        second = (cute.make_rmem_tensor(thr_qk.partition_shape_C((64, TILE_KEYS)), Float32),  # its S, its P
                  thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_KEYS))))
        acc_pv = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, self.pv_n)), Float32)
        return ring, fixed, second, acc_pv, state, lam, ds_lane, limits, c, smem_ptr, bars

    @cute.jit
    def _walk_start(self, pipe: tuple) -> None:
        """(deferred_fold) Nothing pending before the first step: O = O 1 + 0."""
        if cutlass.const_expr(self.deferred_fold):
            acc_pv, state = pipe[3], pipe[4]
            for i in cutlass.range_constexpr(cute.size(acc_pv)):
                acc_pv[i] = Float32(0.0)
            for r in cutlass.range_constexpr(2):
                state[self._PENDING_ALPHA + r] = Float32(1.0)

    @cute.jit
    def _walk_end(self, pipe: tuple) -> None:
        """(deferred_fold) The last step's fold."""
        if cutlass.const_expr(self.deferred_fold):
            self._fold_pending(pipe[1][-1], pipe[3], pipe[4])

    def _fold_pending(self, acc_o: cute.Tensor, acc_pv: cute.Tensor, state: cute.Tensor) -> None:
        """(deferred_fold) The previous step's O = O alpha + P V."""
        fold_pv(acc_o, acc_pv, [state[self._PENDING_ALPHA + r] for r in range(2)])

    @cute.jit
    def _wide_step(self, masked: cutlass.Constexpr, step, cta_tiles, pipe, single: cutlass.Constexpr = False):
        """Walk steps ``step`` and ``step + 1`` as one 128-key tile (class docstring), both stages released;
        ``single``: step ``step`` alone (an odd walk's first)."""
        ring, fixed, second, acc_pv, state, lam, ds_lane, limits, c, smem_ptr, bars = pipe[:11]
        mma_qk, mma_pv, thr_qk, thr_pv, frag_q, frag_p, acc_s, acc_o = fixed
        acc_s1, frag_p1 = second
        s0, tile_scale0 = self._issue_qk(masked, step, cta_tiles, pipe, acc_s, hand_over=single)
        lane_max = None
        if cutlass.const_expr(single):
            if cutlass.const_expr(self.deferred_fold):  # the previous step's fold, under this QK
                self._fold_pending(acc_o, acc_pv, state)
            warpgroup.wait_group(0)
            scores = self._staged_scores(s0, acc_s, state, ds_lane, smem_ptr.toint())
        else:
            s1, tile_scale1 = self._issue_qk(masked, step + 1, cta_tiles, pipe, acc_s1, take_turn=False)
            if cutlass.const_expr(self.deferred_fold):  # the previous step's fold, under both QKs (placed after
                self._fold_pending(acc_o, acc_pv, state)  # the first, ptxas put it between its k-steps)
            scores, lane_max = self._pair_scores(s0, s1, (tile_scale0, tile_scale1), pipe, 0)
        probs, alphas = self._softmax(scores, state, lam, lane_max)
        self._p_operand(probs[:N_BLOCKS], cute.recast_tensor(frag_p, Uint32))
        (frag_vt0,) = self._vt_fragments(thr_pv, smem_ptr, s0)
        if cutlass.const_expr(single):
            self._pv_gemm(mma_pv, acc_pv, frag_p, frag_vt0, fresh=True)
        else:
            self._p_operand(probs[N_BLOCKS:], cute.recast_tensor(frag_p1, Uint32))
            (frag_vt1,) = self._vt_fragments(thr_pv, smem_ptr, s1)
            self._pv_gemm(mma_pv, acc_pv, frag_p, frag_vt0, fresh=True, wait=False)
            self._pv_gemm(mma_pv, acc_pv, frag_p1, frag_vt1)
        if cutlass.const_expr(self.deferred_fold):
            for r in cutlass.range_constexpr(2):
                state[self._PENDING_ALPHA + r] = alphas[r]
        else:
            fold_pv(acc_o, acc_pv, alphas)
        cute.arch.mbarrier_arrive(bars + self.operand_stages + s0)  # empty[s0] (and empty[s1]): one of 256 arrivals
        if cutlass.const_expr(not single):
            cute.arch.mbarrier_arrive(bars + self.operand_stages + s1)

    def _softmax(self, scores: list, state: cute.Tensor, lam, lane_max: list, poly_every: int = 0) -> tuple:
        """A step's online softmax (`softmax_update`: P times 448, every ``poly_every``-th P on the FMA pipe) ->
        (P, alphas). Ablations (timing only): ``exp2`` off, exp2 by `ablation.no_exp2`; ``rowstats`` off, P =
        exp2(lam S) with no maximum, sum or rescale (alphas 1, the state untouched)."""
        exp2 = None if self.ablation.exp2 else no_exp2
        if not self.ablation.rowstats:
            return plain_probs(scores, lam, exp2 or tile_math.exp2_approx), [Float32(1.0), Float32(1.0)]
        return softmax_update(scores, state, lam, self.p_scale_log2, lane_max, poly_every, exp2)

    def _pv_gemm(self, mma_pv, acc_pv: cute.Tensor, frag_p: cute.Tensor, frag_vt: cute.Tensor,
                 fresh: bool = False, wait: bool = True, extra=None) -> None:
        """The PV wgmma group (`_gemm`). Ablation ``pv`` off (timing only): no wgmma; each P word, as FP32 bits with
        the exponent cleared, into one accumulator register (`ablation.fold_p_words`: P stays live), and an empty
        group committed (and waited for) in its place, so that the later ``wait_group`` counts stay."""
        if self.ablation.pv:
            _gemm(mma_pv, acc_pv, frag_p, frag_vt, fresh=fresh, wait=wait, extra=extra)
            return
        fold_p_words(acc_pv, [frag_p, *(pair[0] for pair in extra or ())], fresh)
        warpgroup.commit_group()
        if wait:
            warpgroup.wait_group(0)

    def _issue_qk(self, masked: bool, step, cta_tiles, pipe: tuple, acc_s: cute.Tensor, take_turn: bool = True,
                  hand_over: bool = True) -> tuple:
        """Wait for walk step ``step``'s stage and issue its QK wgmma into ``acc_s`` (the ping-pong turn as in
        `_qk_issue`) -> (its stage, its tile scale)."""
        ring, fixed, state, limits, c, smem_ptr, bars = pipe[0], pipe[1], pipe[4], pipe[7], pipe[8], pipe[9], pipe[10]
        mma_qk, mma_pv, thr_qk, frag_q, acc_o = fixed[0], fixed[1], fixed[2], fixed[4], fixed[7]
        s, tile, _ = self._await_step(step, cta_tiles, ring, state, smem_ptr, bars)
        mmas = (mma_qk, mma_pv, (frag_q, self._k_fragment(thr_qk, smem_ptr, s)), acc_s, acc_o)
        self._qk_issue(masked, tile * TILE_KEYS, mmas, limits, c, take_turn, hand_over)
        return s, state[self._TILE_SCALE]

    def _pair_scores(self, s0, s1, tile_scales: tuple, pipe: tuple, later_groups: int) -> tuple:
        """A pair's scores and lane maxima: the first tile's while the second tile's QK runs (``later_groups``
        wgmma groups committed after the two QKs may still run) -> (both tiles' scores, lane maxima)."""
        acc_s, acc_s1, state, ds_lane, smem_ptr = pipe[1][6], pipe[2][0], pipe[4], pipe[6], pipe[9]
        smem = smem_ptr.toint()
        words0 = self._ds_words(s0, ds_lane, smem) if self.ds_ahead else None
        warpgroup.wait_group(1 + later_groups)  # the first tile's QK
        words1 = self._ds_words(s1, ds_lane, smem) if self.ds_ahead else None
        state[self._TILE_SCALE] = tile_scales[0]
        scores = self._staged_scores(s0, acc_s, state, ds_lane, smem, words0)
        lane_max = tile_math.lane_row_maxima(scores)
        warpgroup.wait_group(later_groups)  # the second's
        state[self._TILE_SCALE] = tile_scales[1]
        scores1 = self._staged_scores(s1, acc_s1, state, ds_lane, smem, words1)
        lane_max = [tile_math.fmax(m, m1) for m, m1 in zip(lane_max, tile_math.lane_row_maxima(scores1))]
        return scores + scores1, lane_max


WIDE_TWO_PRODUCERS_REGS = (40, 216)  # v6m's setmaxnreg: 2 x 40 + 2 x 216 = 512 = 4 warpgroups x 128 (.reqntid 512)


class PrefillSm90WgmmaWsWideTileTwoProducers(PrefillSm90WgmmaWsWideTile):
    """v6m: v6l with v6g's **two producer warpgroups** (512 threads), for the case where v6l's one producer warp per
    scheduler binds: its tile loop issues 440 instructions per 64 keys against a consumer's 289.5 (v6e: 434 against
    412). Each producer warp here issues 289 per tile (578 for the pair: more issue in all, a shorter chain each).
    The Delta_S units go to the first 128 of the 256 producer threads. Same values in the operand stages: **v6l's
    output bit for bit**. Registers: producers 40, consumers 216 (v6l names ~R221 of 224; no loop spills)."""

    producer_warpgroups = 2
    producer_regs, consumer_regs = WIDE_TWO_PRODUCERS_REGS


ROW_SUM_COLUMNS = 8  # v6n: V^T rows 128 .. 135 (the wgmma's N grows by 8): a row of ones, then zeros
E4M3_ONES = 0x38383838  # four e4m3 1.0
ROW_SUM_UNITS = ROW_SUM_COLUMNS * TILE_KEYS // 16  # 16-byte units of those rows


class PrefillSm90WgmmaWsWideTileMmaSum(PrefillSm90WgmmaWsWideTile):
    """v6n: v6l with the softmax's row sums on the tensor cores. V^T gets 8 more rows (PV's wgmma m64n136k32): row
    128 all e4m3 1.0, rows 129 .. 135 zeros, written once per operand stage before the CTA's barrier (the producer's
    V transpose writes rows 0 .. 127 only). Column 128 of the PV accumulator is then the row's sum of the e4m3 P'
    the MMA consumed, folded into O's column 128 with O (O = O alpha + P V): l = l alpha + sum e4m3(P'), with no
    FADD per score (64 per 128 keys and consumer thread, 579 -> 515 SASS instructions per 128 keys) and no quad sum
    at the end (lane 4g holds rows g, g + 8's l in registers 64 and 66). O and l grow to 68 registers each.

    Numerics (the reference's "mpfa-qk8tile-psum"): the denominator sums the P that V is weighted by (e4m3(448 P))
    instead of the FP32 P, so O is exactly a weighted mean of V's rows; against FP32 sums the reference's output
    moves by 3-7e-3 rms on the GPU tests' inputs, and the model-level prediction is unchanged (profiles/NOTES.md
    "Prefill v6n"): a different rounding of the size of the e4m3 P's own error."""

    pv_n = HEAD_DIM + ROW_SUM_COLUMNS
    v_bytes = (HEAD_DIM + ROW_SUM_COLUMNS) * TILE_KEYS

    @cute.jit
    def _init_operand_stages(self, tid, smem):
        """V^T rows 128 .. 135 of every operand stage (512 B each: 32 16-byte units, 4 per row) by the first
        32 x stages threads, fenced for wgmma before the CTA's barrier."""
        if tid < ROW_SUM_UNITS * self.operand_stages:
            self._store_row_sum_unit(smem + (tid // ROW_SUM_UNITS) * self.operand_stage_bytes, tid % ROW_SUM_UNITS)
            cute.arch.fence_proxy("async.shared", space="cta")

    def _store_row_sum_unit(self, operands, unit):
        """16-byte unit ``unit`` of V^T's rows 128 .. 135 in the operand stage at ``operands`` (4 units a row: row
        128's are e4m3 ones, the others zeros)."""
        word = Uint32(cutlass.select_(unit < TILE_KEYS // 16, Uint32(E4M3_ONES), Uint32(0)))
        store_shared_v4_u32(operands + self.offsets[2] + HEAD_DIM * TILE_KEYS + 16 * unit, word, word, word, word)

    def _row_sum(self, state: cute.Tensor, acc_o: cute.Tensor, r: int):
        """Row g + 8 r's l: PV's column 128, held by lane 4g (register 64 + 2r)."""
        return shuffle_idx(acc_o[HEAD_DIM // 2 + 2 * r], Uint32(cute.arch.lane_idx() & ~3))
