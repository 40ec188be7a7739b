"""MpFA prefill v7: v6n's consumers on operand images expanded once per prefill.

In v6 .. v6n every CTA expands each K tile it walks (NVFP4 -> e4m3 with the tile's power-of-two scale), transposes
its V and stages its Delta_S: the producer warpgroup's ~445 instructions per 64-key tile (v6l), more than a
consumer's 293.5, repeated by every CTA that walks the tile (~1000 per tile at 64K; profiles/NOTES.md "Prefill v7").
Here one pass (`OperandPass`, one 128-thread CTA per (tile, KV head, sequence)) runs that producer work once per
tile into an **operand image** in global memory, byte for byte what v6n's producer leaves in an operand stage:
e4m3 K [64 keys][128] in the QK wgmma's layout, e4m3 V^T [136 rows][64 keys] (rows 128 .. 135: v6n's row of ones and
zeros), the tile's FP32 Delta_S in the consumers' order, the tile's K exponent as FP32 bits (`EXPONENT_OFFSET`).
v7's producer warpgroup then only copies images into its operand stages (cp.async, 9 x 16 bytes per thread and
tile); its consumers are v6n's. Same operand bytes, same consumer code: **v6n's output bit for bit** (the direct
build, ``compensate=False``: v6n's direct build, the images' Delta_S left unwritten and unread). GQA groups 4
and 5: an image holds the Delta_S of every query head of its KV head (4 or 5), which the CTAs of those heads share
(at 40:8 a CTA is one head x 128 rows and reads its head's part).

The images: uint8 [KV heads x ``rows_per_head``, `IMAGE_BYTES`] (`image_row`): each KV head's block holds every
sequence's tiles, sequence b's from row ``image_starts[b]`` = the tiles of the sequences before it (int32 [B], on the
device: `prefill_launch.image_layout`). ``rows_per_head`` >= all the sequences' tiles: exact where the caller gives
the host's lengths, else batch x the page table's tiles (without reading the lengths back). A tile past a
sequence's end is not written and never read.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from cutlass.cute.nvgpu import warpgroup

from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90.ablation import FULL, Ablation
from mpfa.kernels.sm90.prefill_wgmma import HALVES, HEAD_DIM, N_BLOCKS, OPERAND_ALIGN, THREADS, TILE_KEYS
from mpfa.kernels.sm90.prefill_wgmma_ws import (ROW_SUM_COLUMNS, ROW_SUM_UNITS, ConsumerPingPong,
                                                PrefillSm90WgmmaWsWideTile, PrefillSm90WgmmaWsWideTileMmaSum,
                                                ds_staged_read, fold_pv, stage_parity)
from mpfa.kernels.sm90.ptx import (bits_to_f32, bulk_copy_g2s, cp_async_16, cp_async_commit, cp_async_wait,
                                   load_shared_u32, load_shared_v4_u32, load_u32, store_v4_u32)
from mpfa.kernels.sm90.smem_pipeline import store_shared_u32

PRE_OPERAND_STAGES = 8  # v7: no raw ring, so twice v6n's operand stages (8 x 18 KB) for the copies in flight
UNITS_PER_THREAD = 9  # 16-byte units of an image per producer thread: 18432 / 16 / 128
GROUPS = (4, 5)  # GQA groups: one image size for both


def image_ds_bytes(group: int) -> int:
    """Bytes of an image's FP32 Delta_S: every query head of the KV head x 64 keys."""
    return 4 * group * TILE_KEYS


def image_bytes(group: int) -> int:
    """Bytes of one operand image: K, V^T with v6n's ones rows, the group's Delta_S, 1 KB-aligned (K's swizzle)."""
    stage = TILE_KEYS * HEAD_DIM + (HEAD_DIM + ROW_SUM_COLUMNS) * TILE_KEYS + image_ds_bytes(group)
    return -(-stage // OPERAND_ALIGN) * OPERAND_ALIGN


IMAGE_BYTES = image_bytes(GROUPS[0])  # 18432
assert all(image_bytes(group) == IMAGE_BYTES for group in GROUPS)
EXPONENT_OFFSET = IMAGE_BYTES - 16  # the tile's 2**e_k as FP32 bits, in the image's padding


def image_row(start, kv_head, tile, rows_per_head):
    """Row of the images tensor holding tile ``tile`` of KV head ``kv_head`` of the sequence whose tiles start at
    row ``start`` of each KV head's block (its ``image_starts`` entry)."""
    return Int64(kv_head) * rows_per_head + start + tile


def check_group(group: int) -> None:
    if group not in GROUPS:
        raise ValueError(f"the v7 prefill supports GQA group {' or '.join(map(str, GROUPS))} only, got {group}")


class OperandPass(PrefillSm90WgmmaWsWideTileMmaSum):
    """The once-per-prefill expansion: v6n's producer steps for one tile per CTA (128 threads: the producer
    warpgroup's copy of the raw tile into a ring stage, the K expansion, the V transpose, the Delta_S staging) for
    every query head of the KV head (``heads`` = the group), the ones rows and the exponent, then the image stored to
    global memory. Shared memory: the image, one ring stage."""

    def staged_ds_bytes(self) -> int:
        return image_ds_bytes(self.group)  # the images' layout, whether or not Delta_S is staged (direct build)

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool = True,
                 out_dtype: str = "BFloat16", compensate: bool = True):
        check_group(group)
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate)
        self.heads = group  # the ring copies and stages the whole group's Delta_S
        self.stage_bytes = sl.stage_bytes(self.heads, compensate)
        self.tile_bytes = HALVES * self.stage_bytes
        assert self.operand_stage_bytes == IMAGE_BYTES and self.producer_threads == THREADS
        # (image's K at 0, image's V^T, the ring stage after the image)
        self.offsets = (0, 0, self.qk_bytes, IMAGE_BYTES)
        self.pass_smem_bytes = IMAGE_BYTES + self.tile_bytes

    @cute.jit
    def __call__(self, k_codes: cute.Tensor, k_scales: cute.Tensor, v: cute.Tensor, delta_s: cute.Tensor,
                 page_table: cute.Tensor, seq_lens_k: cute.Tensor, image_starts: cute.Tensor, images: cute.Tensor,
                 rows_per_head: Int32, max_tiles: Int32, stream):
        """``max_tiles``: the grid's tiles per sequence (>= the longest's; the CTAs past a sequence's end exit)."""
        self.pass_kernel(k_codes, k_scales, v, delta_s, page_table, seq_lens_k, image_starts, images,
                         rows_per_head).launch(grid=(max_tiles, self.num_kv_heads, seq_lens_k.shape[0]),
                                               block=(THREADS, 1, 1), smem=self.pass_smem_bytes, stream=stream)

    @cute.kernel
    def pass_kernel(self, k_codes: cute.Tensor, k_scales: cute.Tensor, v: cute.Tensor, delta_s: cute.Tensor,
                    page_table: cute.Tensor, seq_lens_k: cute.Tensor, image_starts: cute.Tensor, images: cute.Tensor,
                    rows_per_head: Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile_index, kv_head, batch = cute.arch.block_idx()
        kv_len = seq_lens_k[batch]
        if tile_index * TILE_KEYS < kv_len:
            threads = (tid, 0, tid, tid >> 5)
            sources = self._cache_sources((k_codes, k_scales, v, delta_s), kv_head, 0)
            table_row = page_table.iterator.toint() + Int64(batch) * page_table.stride[0] * 4
            smem = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN).toint()
            ring = smem + self.offsets[3]
            page = Int32(load_u32(self._page_entry(table_row, HALVES * tile_index)))
            self._copy_wgmma_tile(tile_index, page, ring, kv_len, threads, sources, True)
            cp_async_commit()
            cp_async_wait(0)
            cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)  # every thread's copies landed
            e = self._expand_k_e4m3(ring, threads, smem)
            self._expand_v(ring, threads, smem)
            self._stage_delta_s(ring, threads, smem, 0)
            if tid < ROW_SUM_UNITS:
                self._store_row_sum_unit(smem, tid)
            if tid == 0:
                store_shared_u32(smem + EXPONENT_OFFSET, (e + Uint32(127)) << 23)
            cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)  # the image is whole
            row = images.iterator.toint() + image_row(image_starts[batch], kv_head, tile_index,
                                                      rows_per_head) * IMAGE_BYTES
            for r in cutlass.range_constexpr(UNITS_PER_THREAD):
                unit = 16 * (tid + THREADS * r)
                words = load_shared_v4_u32(smem + unit)
                store_v4_u32(row + unit, words[0], words[1], words[2], words[3])


class PrefillSm90WgmmaPre(PrefillSm90WgmmaWsWideTileMmaSum):
    """v7: v6n's consumers; the producer warpgroup copies each step's operand image (`OperandPass`) into the step's
    operand stage, one step behind its copies (``cp.async.wait_group 1``), and arrives on ``full[s]`` once its own
    copies of that step have landed and been fenced for wgmma. No raw ring; `PRE_OPERAND_STAGES` operand stages."""

    operand_stages = PRE_OPERAND_STAGES

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True, warpgroups: int = 2, ablation: Ablation = FULL):
        """``ablation``: the pieces a timing-only build removes (`ablation.PRE_LADDER`; `FULL`: the real kernel)."""
        check_group(group)
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate, warpgroups)
        self.ablation = ablation
        assert self.operand_stage_bytes == IMAGE_BYTES and IMAGE_BYTES == 16 * THREADS * UNITS_PER_THREAD
        self.barrier_offset = self.offsets[3]  # no ring after the operand stages
        self.exponent_offset = None  # no per-stage slot: each image carries its tile's K exponent (`EXPONENT_OFFSET`)
        self.smem_bytes = self.barrier_offset + 8 * 2 * self.operand_stages  # after the full / empty barriers

    @cute.jit
    def __call__(self, q_codes: cute.Tensor, q_scales: cute.Tensor, images: cute.Tensor, image_starts: cute.Tensor,
                 rows_per_head: Int32, cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, out: cute.Tensor,
                 lam_scaled: Float32, num_m_blocks: Int32, stream):
        from mpfa.kernels.sm90 import prefill_grid

        self.pre_kernel(q_codes, q_scales, images, image_starts, rows_per_head, cu_seqlens_q, seq_lens_k, out,
                        lam_scaled).launch(
            grid=prefill_grid.grid(self.cta_order, self.num_q_heads // self.heads, num_m_blocks, seq_lens_k.shape[0]),
            block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_ctas_per_sm)

    @cute.kernel
    def pre_kernel(self, q_codes: cute.Tensor, q_scales: cute.Tensor, images: cute.Tensor, image_starts: cute.Tensor,
                   rows_per_head: Int32, cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, out: cute.Tensor,
                   lam_scaled: Float32):
        self._roles(q_codes, q_scales, cu_seqlens_q, seq_lens_k, out, lam_scaled, (images, image_starts, rows_per_head))

    def staged_ds_bytes(self) -> int:
        return image_ds_bytes(self.group)  # the images' layout, whether or not Delta_S is staged (direct build)

    def _ds_lane(self, group_first, head_in_cta, c):
        """The lane's offset in the image's Delta_S: its head among the KV head's query heads."""
        return ds_staged_read(head_in_cta if self.heads == self.group else group_first + head_in_cta, c, 0)

    def _init_operand_stages(self, tid, smem):
        """Nothing: the images carry V^T's ones rows."""

    @cute.jit
    def _produce(self, walk, inputs, batch, block_head, kv_len, tid, warp, smem_ptr, bars):
        """Walk step p: wait for ``empty[s]`` (s = p mod n), cp.async step p's image into stage s, then release
        step p - 1 to the consumers (its copies waited for, fenced, ``full``); the last step after the walk."""
        cta_tiles, _ = walk
        first = self._first_image(inputs, batch, block_head, warp)
        smem = smem_ptr.toint()
        for step in cutlass.range(cta_tiles, unroll=1):
            s, parity = stage_parity(step, self.operand_stages)
            cute.arch.mbarrier_wait(bars + self.operand_stages + s, parity ^ 1)  # both consumers done with step - n
            source = first + Int64(cta_tiles - 1 - step) * IMAGE_BYTES
            stage = self._stage_address(smem, s)
            for r in cutlass.range_constexpr(UNITS_PER_THREAD):
                unit = 16 * (tid + THREADS * r)
                cp_async_16(stage + unit, source + unit, Uint32(16))
            cp_async_commit()
            if step > 0:
                self._release(step - 1, 1, bars)
        if cta_tiles > 0:
            self._release(cta_tiles - 1, 0, bars)

    def _first_image(self, inputs, batch, block_head, warp):
        """Address of the CTA's KV head's first image of sequence ``batch`` (``inputs``: images, their starts, rows
        per KV head); step p copies image ``cta_tiles - 1 - p`` after it."""
        images, image_starts, rows_per_head = inputs
        _, kv_head, _ = self._heads(block_head, warp)
        return images.iterator.toint() + image_row(image_starts[batch], kv_head, 0, rows_per_head) * IMAGE_BYTES

    def _stage_address(self, smem, s):
        """Shared-memory address of operand stage ``s`` (its image's first byte)."""
        return smem + self.offsets[1] + s * self.operand_stage_bytes

    @cute.jit
    def _release(self, step, pending: cutlass.Constexpr, bars):
        """Step ``step``'s image landed (``pending`` later groups may still fly), fenced for wgmma: ``full[s]``."""
        cp_async_wait(pending)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(bars + stage_parity(step, self.operand_stages)[0])

    @cute.jit
    def _await_step(self, step, cta_tiles, ring, state: cute.Tensor, smem_ptr, bars):
        """v6's wait for ``full[s]``, the tile's K exponent read from the stage's image."""
        s, parity = stage_parity(step, self.operand_stages)
        cute.arch.mbarrier_wait(bars + s, parity)
        stage = self._stage_address(smem_ptr.toint(), s)
        state[self._TILE_SCALE] = bits_to_f32(load_shared_u32(stage + EXPONENT_OFFSET))
        return s, cta_tiles - 1 - step, ring


class PrefillSm90WgmmaPreDeferredFold(PrefillSm90WgmmaPre):
    """v7b: v7 with each 128-key step's fold O = O alpha + P V deferred to the next step, once that step's QK
    wgmmas are issued (`PrefillSm90WgmmaWsWideTile.deferred_fold`; the last fold after the walk), so that the fold's
    68 FFMA run under the wgmmas instead of ahead of them. The PV accumulator and its alphas wait in registers across
    the loop's back edge; no wgmma is in flight there (a first build that issued the next step's QK before the fold,
    in flight across the back edge, had ptxas serialize every wgmma of the loop). The same operations on the same
    values, in the same order per register: v7's output bit for bit."""

    deferred_fold = True
    state_size = PrefillSm90WgmmaPre.state_size + 2  # the pending alphas (`_PENDING_ALPHA`)


class PrefillSm90WgmmaPreBulk(PrefillSm90WgmmaPreDeferredFold):
    """v7c: v7b whose producer copies each step's image with one 18 KB bulk copy (the TMA's non-tensor form) from
    one thread, completed on ``full[s]`` by its bytes (``full_arrivals`` 1: that thread's ``arrive.expect_tx``).
    v7's 128 producer threads each wait for their own cp.async groups one step behind, so at most two steps' images
    are in flight per CTA whatever the stages; here every free stage can be in flight (up to 8 x 18 KB), and the
    bulk copy writes through the async proxy that the wgmma reads (no proxy fence). The same bytes in the same
    stages: v7b's output bit for bit."""

    @property
    def full_arrivals(self) -> int:
        return 1

    @cute.jit
    def _produce(self, walk, inputs, batch, block_head, kv_len, tid, warp, smem_ptr, bars):
        """Producer thread 0, walk step p: wait for ``empty[s]`` (s = p mod n), arm ``full[s]`` with the image's
        bytes, bulk-copy step p's image into stage s. The other producer threads have nothing to do."""
        cta_tiles, _ = walk
        if tid == 0:
            first = self._first_image(inputs, batch, block_head, warp)
            smem = smem_ptr.toint()
            for step in cutlass.range(cta_tiles, unroll=1):
                s, parity = stage_parity(step, self.operand_stages)
                cute.arch.mbarrier_wait(bars + self.operand_stages + s, parity ^ 1)  # both consumers done with step - n
                cute.arch.mbarrier_arrive_and_expect_tx(bars + s, IMAGE_BYTES)
                bulk_copy_g2s(self._stage_address(smem, s), first + Int64(cta_tiles - 1 - step) * IMAGE_BYTES,
                              IMAGE_BYTES, smem + self.barrier_offset + 8 * s)


class PrefillSm90WgmmaPreBulkPingPong(ConsumerPingPong, PrefillSm90WgmmaPreBulk):
    """v7h: v7c with the consumers' turns (`ConsumerPingPong`) around each step's two QK wgmmas only: the turn is
    taken after the first stage's ``full`` wait and handed over once the second QK is issued (an odd walk's first
    step: around its one QK). With v7d (the PV under the next softmax, no turns) and v7f (both) it separates what
    the turns and the overlap each give. Only the issue order changes: **v7's output bit for bit**. No deadlock:
    v7f's argument with v7c's releases (each pair's stages at the end of its own step, earlier than v7f's);
    `_pipeline_completes(..., pingpong=True)` in the compile tests."""


OVERLAP_REGS = (24, 240)  # v7d's setmaxnreg: the one producer thread needs few; 24 + 2 x 240 = 504 = 3 x 168


class PrefillSm90WgmmaPreBulkDsAhead(PrefillSm90WgmmaPreBulk):
    """v7i: v7c with each pair step's staged Delta_S loaded before its QK waits (`_pair_scores`, ``ds_ahead``).
    v7c loads it after each wait, and the first FFMA of each tile's scores waits on those loads while the QK wgmmas
    keep shared memory busy: under ncu (session 24, 16K) the FFMAs reading Delta_S held 12.6% of the consumer loop's
    stall samples (short scoreboard), and the direct build, with no such loads, ran 12% faster. The same loads and
    FFMAs, earlier: **v7's output bit for bit**. The first tile's Delta_S is loaded before the first wait, the
    second's right after it, under the first tile's scores (16 registers live across each wait; both before the
    first wait, 32, spilled in the loop). setmaxnreg as v7d's (240 for the consumers: at 224 the loop spilled)."""

    ds_ahead = True
    producer_regs, consumer_regs = OVERLAP_REGS


class PrefillSm90WgmmaPreOverlap(PrefillSm90WgmmaPreBulk):
    """v7d: v7c with each 128-key step's PV wgmma running under the next step's softmax (FA3's intra-warpgroup
    overlap). v7c's consumer step issues its PV and waits for it at the step's end, with nothing to do meanwhile
    (~4 k-steps of m64n136k32 per tile pair). Here step j issues its QK wgmmas, folds step j - 2's PV into O (v7b's
    deferred fold), issues step j - 1's PV (P from registers, V^T from j - 1's stages, still held), then waits for
    its QKs (``wait_group`` 2, 1), runs its softmax while that PV runs, waits for it (``wait_group`` 0), releases
    j - 1's stages and packs its own P. No wgmma is in flight across the loop's back edge. The consumers hold each
    pair's two stages one pair longer than v7c (up to 4 of the 8 stages, 4 left for the copies ahead). Before the
    first pair step the pending P is zeros and its alphas 1, so that step's PV (on its own stages' V^T) and the next
    fold add exact zeros: the same folds on the same values as v7's, so **v7's output bit for bit**. An odd walk's
    first step is v7b's (its PV waited in the step). Registers: S, the P being multiplied, the PV accumulator and O
    live at once (~235): setmaxnreg 240 for the consumers, 24 for the producer."""

    producer_regs, consumer_regs = OVERLAP_REGS
    poly_exp_every = 0  # v7e: every n-th P of a pair step on the FMA pipe (`ptx.exp2_poly`)
    _NEXT_ALPHA = PrefillSm90WgmmaPreBulk.state_size  # the state's slots for the pending P's alphas
    state_size = PrefillSm90WgmmaPreBulk.state_size + 2

    def _walk_pipe(self, ring, fixed, state: cute.Tensor, lam, ds_lane, limits, c, smem_ptr, bars) -> tuple:
        """v7c's, and the operand stages of the step whose PV is pending (-1: none)."""
        pipe = PrefillSm90WgmmaWsWideTile._walk_pipe(self, ring, fixed, state, lam, ds_lane, limits, c, smem_ptr, bars)
        return (*pipe, cute.make_rmem_tensor((2,), Int32))

    @cute.jit
    def _walk_start(self, pipe: tuple) -> None:
        """v7b's start, and a pending P of zeros with alphas 1 (no stages)."""
        PrefillSm90WgmmaWsWideTile._walk_start(self, pipe)
        state, pending = pipe[4], pipe[-1]
        for r in cutlass.range_constexpr(2):
            state[self._NEXT_ALPHA + r] = Float32(1.0)
            pending[r] = Int32(-1)
        self._zero_p((pipe[1][5], pipe[2][1]))

    @cute.jit
    def _zero_p(self, frags: tuple) -> None:
        """P registers (the pending PV's A operand) to e4m3 zeros."""
        for frag in frags:
            words = cute.recast_tensor(frag, Uint32)
            for i in cutlass.range_constexpr(cute.size(words)):
                words[i] = Uint32(0)

    @cute.jit
    def _wide_step(self, masked: cutlass.Constexpr, step, cta_tiles, pipe, single: cutlass.Constexpr = False):
        """An odd walk's first step: v7b's, then its P registers back to zeros (its PV is done). A pair of steps:
        the class docstring's order."""
        if cutlass.const_expr(single):
            PrefillSm90WgmmaWsWideTile._wide_step(self, masked, step, cta_tiles, pipe, single=True)
            self._zero_p((pipe[1][5],))  # its P (the second tile's was never written)
        else:
            fixed, second, acc_pv, state, lam, smem_ptr, bars, pending = (pipe[1], pipe[2], pipe[3], pipe[4], pipe[5],
                                                                          pipe[9], pipe[10], pipe[11])
            mma_pv, thr_pv, frag_p, acc_s, acc_o = fixed[1], fixed[3], fixed[5], fixed[6], fixed[7]
            acc_s1, frag_p1 = second
            s0, tile_scale0 = self._issue_qk(masked, step, cta_tiles, pipe, acc_s, hand_over=False)
            s1, tile_scale1 = self._issue_qk(masked, step + 1, cta_tiles, pipe, acc_s1, take_turn=False,
                                             hand_over=False)
            self._fold_pending(acc_o, acc_pv, state)  # step j - 2's PV, under the QKs
            v0 = cutlass.select_(pending[0] >= 0, pending[0], s0)  # none pending: P is 0, any held V^T will do
            v1 = cutlass.select_(pending[1] >= 0, pending[1], v0)
            (frag_vt0,) = self._vt_fragments(thr_pv, smem_ptr, v0)
            (frag_vt1,) = self._vt_fragments(thr_pv, smem_ptr, v1)
            self._pv_gemm(mma_pv, acc_pv, frag_p, frag_vt0, fresh=True, wait=False, extra=((frag_p1, frag_vt1),))
            self._qk_issued()  # (v7f) the step's turn covers its three wgmma groups
            scores, lane_max = self._pair_scores(s0, s1, (tile_scale0, tile_scale1), pipe, 1)  # under that PV
            probs, alphas = self._softmax(scores, state, lam, lane_max, self.poly_exp_every)
            warpgroup.wait_group(0)  # step j - 1's PV: its P registers and V^T stages are free
            self._release_pending(pending, bars)
            self._p_operand(probs[:N_BLOCKS], cute.recast_tensor(frag_p, Uint32))
            self._p_operand(probs[N_BLOCKS:], cute.recast_tensor(frag_p1, Uint32))
            for r in cutlass.range_constexpr(2):
                state[self._PENDING_ALPHA + r] = state[self._NEXT_ALPHA + r]
                state[self._NEXT_ALPHA + r] = alphas[r]
            pending[0] = s0
            pending[1] = s1

    @cute.jit
    def _release_pending(self, pending: cute.Tensor, bars) -> None:
        """``empty`` of the pending step's stages, if any (one of 256 arrivals each)."""
        for r in cutlass.range_constexpr(2):
            if pending[r] >= 0:
                cute.arch.mbarrier_arrive(bars + self.operand_stages + pending[r])

    @cute.jit
    def _walk_end(self, pipe: tuple) -> None:
        """The second-to-last step's fold, then (a pair step ran) the last step's PV, waited for, and its fold."""
        fixed, frag_p1, acc_pv, state, smem_ptr, bars, pending = (pipe[1], pipe[2][1], pipe[3], pipe[4], pipe[9],
                                                                   pipe[10], pipe[11])
        mma_pv, thr_pv, frag_p, acc_o = fixed[1], fixed[3], fixed[5], fixed[7]
        self._fold_pending(acc_o, acc_pv, state)
        if pending[0] >= 0:
            (frag_vt0,) = self._vt_fragments(thr_pv, smem_ptr, pending[0])
            (frag_vt1,) = self._vt_fragments(thr_pv, smem_ptr, pending[1])
            self._pv_gemm(mma_pv, acc_pv, frag_p, frag_vt0, fresh=True, extra=((frag_p1, frag_vt1),))
            fold_pv(acc_o, acc_pv, [state[self._NEXT_ALPHA + r] for r in range(2)])
            self._release_pending(pending, bars)


class PrefillSm90WgmmaPreOverlapPolyExp(PrefillSm90WgmmaPreOverlap):
    """v7e: v7d with every 4th P of a pair step computed on the FMA pipe (`ptx.exp2_poly`: 9 ALU / FMA instructions,
    relative error <= 7.5e-5) instead of the SFU (FA4's split). Each consumer warp's 64 exponentials per step take
    64 x 8 cycles of its scheduler's SFU (16 lanes per cycle and SM), ~20% of v7c's step, and both consumer warps of
    a scheduler compete for it; here 48 go to the SFU (-128 cycles of it per warp and step) for +128 FMA-pipe
    instructions. Not v7's bits: a P whose exponential lands on the other side of an e4m3 rounding boundary (~3-5e-4
    of the polynomial's quarter) moves by one e4m3 step, in l (the row sums on the PV wgmma) as in O."""

    poly_exp_every = 4


class PrefillSm90WgmmaPreOverlapPingPong(ConsumerPingPong, PrefillSm90WgmmaPreOverlap):
    """v7f: v7d with FA3's consumer ping-pong (`ConsumerPingPong`) around each step's wgmma issue, as FA3 combines
    it with the intra-warpgroup overlap: consumer w takes its turn after its first stage's ``full`` wait, issues both
    QKs, folds step j - 2's PV and issues step j - 1's PV, then hands the turn over; an odd walk's first step takes
    it around its one QK issue. Both consumers walk the same steps (the earlier one's unseen tiles through the
    masked body), so each takes T turns. The tensor pipe then runs the consumers' wgmma groups alternately, and one
    consumer's softmax runs under the other's wgmmas instead of both softmaxes at once (in v7c / v7d both consumers
    start each step together and their exponentials compete for the SFU while the tensor pipe waits). Only the
    issue order changes: **v7's output bit for bit**.

    No deadlock with the mbarriers: a consumer at pair step j (each consumer's j-th turn) holds its turn through its
    second stage's ``full`` wait. The other consumer is at step j - 1 past its issues, or at step j waiting for that
    turn; either way both have released every stage of steps <= j - 3 (v7d releases step i's stages in step i + 1,
    after its PV wait), and step j's stages (8 stages: 64-key walk steps 2j, 2j + 1, give or take an odd walk's
    first) were last used by steps 2j - 8, 2j - 7, whose pair step is <= j - 4: the producer fills them without
    either consumer moving.
    `_pipeline_completes` in the compile tests models it with the turns."""


class PrefillSm90WgmmaPreOverlapPolyExpPingPong(ConsumerPingPong, PrefillSm90WgmmaPreOverlapPolyExp):
    """v7g: v7e with v7f's turns. With the consumers' softmaxes staggered they no longer compete for the SFU, but
    each consumer's own softmax (its 64 exponentials per step hold its scheduler's SFU for 512 cycles) then sits on
    the stagger's critical path, which v7e's FMA-pipe quarter shortens. **v7e's output bit for bit**."""
