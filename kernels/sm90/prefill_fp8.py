"""The fp8 prefill kernel (the default where it fits): Q and K requantized from NVFP4 to e4m3 (power-of-two scales
per query row and per 64-key tile), FP8 QK and PV wgmma, warp-specialized as FA3 is, fed from FP8 operand images
that one pass per prefill expands from the cache (`prefill_fp8_pass`); numerics ``mpfa-qk8tile-psum`` of
`mpfa.kernels.reference` (`prefill_fp8_layout` has the layouts and the requantization).

The CTA is 3 warpgroups (384 threads, 1 CTA per SM): a **producer** warpgroup and two **consumers**; consumer w owns
the query rows ``wg_rows w`` .. + ``wg_rows`` - 1 of the CTA's heads (`prefill_wgmma`), its own e4m3 Q tile
(expanded by itself at the start), its softmax state and O. ``setmaxnreg``: the producer drops to
``PRODUCER_REGS``, the consumers rise to ``CONSUMER_REGS`` (``.reqntid 384`` caps ptxas at 168 per thread).

* Producer (one thread): walk step p (64-key tiles last to first) waits for ``empty[s]`` (s = p mod 8), arms
  ``full[s]`` with the image's bytes and copies step p's operand image into operand stage s with one bulk copy
  (the TMA's non-tensor form: up to 8 images of 18 KB (19 KB at GQA groups 6-8) in flight, written through the
  async proxy that wgmma reads).
* Consumers: 128-key steps, the sequence's 128-key tiles (`wide_walk`: an odd walk's first 64-key tile goes alone).
  A step waits for its two stages' ``full`` and issues both QK wgmmas (e4m3 ``m64n64k32`` from 0, -inf where
  masked) into two accumulators, folds the previous step's PV into O under them (O = O alpha + P V, one FFMA per
  register), loads the first tile's FP32 Delta_S ahead of its QK wait and the second's right after it, takes the
  scores (acc 2**(e_q + e_k) + Delta_S) of the first tile while the second's QK runs, runs one online softmax over
  the 128 keys (e4m3(448 P)'s 448 in the exponent), packs P to e4m3, runs both PV wgmmas (``m64n136k32``: V^T's
  row of ones gives the row sums, l = l alpha + sum e4m3(P)) into one fresh accumulator, waited for, and releases
  both stages (``empty``). The leading tiles a consumer's rows do not see (causal, the earlier consumer) go through
  the masked body (all -inf, P = 0).
* Synchronisation: ``full[s]`` / ``empty[s]``, one mbarrier pair per operand stage, initialised by thread 0 before
  the kernel's one CTA-wide barrier. ``full[s]`` completes on the producer's one arrival plus the bulk copy's bytes;
  ``empty[s]`` expects every consumer thread (256) once per step of the walk, which both consumers walk whole.
  Step p uses stage p mod 8 in its (p / 8)-th phase: consumers wait ``full`` for parity (p / 8) & 1, the producer
  waits ``empty`` for the opposite parity (a fresh mbarrier's preceding phase counts as complete). Named barriers:
  0 the CTA's start, 2 + w consumer w's after its Q expansion.

``ablation`` (`ablation.Ablation`, timing only; `FULL` is the real kernel): ``exp2`` off, exp2 by `ablation.no_exp2`;
``rowstats`` off, P = exp2(lam S) with no maximum, sum or rescale; ``pv`` off, each P word into one accumulator
register (`ablation.fold_p_words`) and an empty wgmma group in place of PV. Shared memory: 2 Q tiles (8 KB each),
8 operand stages (18 KB each, 19 KB at groups 6-8) and the mbarriers: ~160 KB (~168 KB), 1 CTA per SM whatever
the ablation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from . import prefill_grid
from . import prefill_staged_layout as sl
from . import prefill_tile as tile_math
from .ablation import FULL, Ablation, fold_p_words, no_exp2, plain_probs
from .decode_layout import SCORE_SCALE_LOG2
from .prefill_base import HEAD_DIM
from .prefill_fp8_layout import (FP8_OPERAND_BYTES, PV_N, VT_BYTES, ds_staged_read, exponent_offset, f32_pow2, fold_max,
                                 fp8_chunk_words, fp8_operand_layout, fp8_operand_offset, image_bytes, image_row,
                                 max_scale_pairs, p_operand_fp8, pow2_factors, vt_layout)
from .prefill_wgmma import (N_BLOCKS, OPERAND_ALIGN, P_SCALE_LOG2, THREADS, TILE_KEYS, WARPGROUPS, PrefillSm90Wgmma,
                            gemm, softmax_update)
from .ptx import (bits_to_f32, bulk_copy_g2s, e4m3_pow2_exponent, load_shared_u32, load_shared_v4_u32, load_u16,
                  shuffle_idx)

REGISTER_FILE = 65536  # 32-bit registers per SM (and per CTA)
CONSUMER_THREADS = WARPGROUPS * THREADS  # arrivals expected on ``empty[s]``: every consumer thread
OPERAND_STAGES = 8  # operand stages (images) in shared memory
PRODUCER_REGS = 24  # setmaxnreg of the producer warpgroup: its one thread needs few
CONSUMER_REGS = 240  # of each consumer warpgroup: 24 + 2 x 240 = 504 = 3 x 168 (at 224 the loop spilled)
CONSUMER_BARRIER = 2  # consumer w's named barrier: 2 + w (0 is the CTA's)
# the softmax state's slots after the running maxima and lane-partial sums of rows g, g + 8 (0 .. 3)
ROW_SCALE = 4  # 2**e_q of rows g, g + 8
TILE_SCALE = 6  # 2**e_k of the current tile
PENDING_ALPHA = 7  # the pending fold's alphas, rows g and g + 8
STATE_SIZE = 9


def stage_parity(step):
    """(operand stage, phase parity) of walk step ``step``: stage step mod 8 in its (step // 8)-th use."""
    return step & (OPERAND_STAGES - 1), (step >> (OPERAND_STAGES.bit_length() - 1)) & 1


def wide_walk(cta_tiles, masked_tiles) -> tuple:
    """The consumers' walk in 128-key steps, aligned to the sequence's 128-key tiles (64-key tiles 2j, 2j + 1:
    those of the reference's ``block_n`` 128, so that P is rounded against the same maxima) -> (lead, pairs holding
    a masked tile, pairs): an odd walk's first step (its last 64-key tile, index cta_tiles - 1, even) goes alone
    (``lead`` 1), pair k is walk steps lead + 2k, lead + 2k + 1; the masked tiles come first in the walk."""
    lead = cta_tiles & 1
    pairs = (cta_tiles - lead) >> 1
    return lead, cutlass.min(cutlass.max(masked_tiles - lead + 1, 0) >> 1, pairs), pairs


@cute.jit
def fold_pv(acc_o: cute.Tensor, acc_pv: cute.Tensor, alphas) -> None:
    """O = O alpha + P V, one FFMA per register (O + P V exactly where alpha is 1)."""
    for i in cutlass.range_constexpr(cute.size(acc_o)):
        acc_o[i] = acc_o[i] * alphas[(i >> 1) & 1] + acc_pv[i]


class ConsumerWalk(NamedTuple):
    """What every step of a consumer's walk uses."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    thr_qk: object  # the thread's slices of the two MMAs
    thr_pv: object
    frag_q: cute.Tensor
    frag_p: cute.Tensor  # the first tile's P (the PV A operand)
    acc_s: cute.Tensor  # the first tile's S
    acc_o: cute.Tensor  # O and (column 128) the row sums
    acc_s1: cute.Tensor  # the second tile's S and P
    frag_p1: cute.Tensor
    acc_pv: cute.Tensor  # the step's P V, folded into O in the next step
    state: cute.Tensor  # `STATE_SIZE` floats
    lam: Float32  # lam for the unscaled scores S
    ds_lane: object  # the lane's offset in an image's Delta_S
    limits: tuple
    c: Int32
    smem_ptr: object
    bars: object


class PrefillSm90Fp8(PrefillSm90Wgmma):
    """The fp8 prefill kernel (module docstring) for `prefill_wgmma.PrefillSm90Wgmma`'s shapes, on the operand
    images of `prefill_fp8_pass.OperandPass`; ``ablation``: a timing-only build (`ablation.LADDER`)."""

    name = "fp8"
    qk_dtype = cutlass.Float8E4M3FN  # QK on e4m3 ``m64n64k32``
    min_ctas_per_sm = 1  # ``.minnctapersm 1``; ``.reqntid 384`` caps the launch at 168 registers
    _unit_offset = staticmethod(fp8_operand_offset)

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True, ablation: Ablation = FULL):
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate)
        self.ablation = ablation
        self.threads = (1 + WARPGROUPS) * THREADS  # the launch's block: the producer warpgroup and the consumers
        launch_regs = REGISTER_FILE // self.threads // 8 * 8  # ptxas' cap under ``.reqntid``: 168 for 384 threads
        assert PRODUCER_REGS + WARPGROUPS * CONSUMER_REGS <= self.threads // THREADS * launch_regs
        q_bytes = WARPGROUPS * FP8_OPERAND_BYTES
        self.image_bytes = image_bytes(group)  # an operand stage: 18 KB, 19 KB at groups 6-8
        self.exponent_offset = exponent_offset(group)
        # (Q tile of consumer 0 (consumer w's: + w FP8_OPERAND_BYTES), K and V^T of operand stage 0 (stage s:
        # + s image_bytes)); then the full[0..7] and empty[0..7] mbarriers, 8 bytes each
        self.offsets = (0, q_bytes, q_bytes + FP8_OPERAND_BYTES)
        self.barrier_offset = q_bytes + OPERAND_STAGES * self.image_bytes
        self.smem_bytes = self.barrier_offset + 8 * 2 * OPERAND_STAGES

    def _qk_layout(self):
        return fp8_operand_layout()

    @cute.jit
    def __call__(self, q_codes: cute.Tensor, q_scales: cute.Tensor, images: cute.Tensor, image_starts: cute.Tensor,
                 rows_per_head: Int32, cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, out: cute.Tensor,
                 lam_scaled: Float32, num_m_blocks: Int32, stream):
        self.kernel(q_codes, q_scales, images, image_starts, rows_per_head, cu_seqlens_q, seq_lens_k, out,
                    lam_scaled).launch(
            grid=prefill_grid.grid(self.num_q_heads // self.heads, num_m_blocks, seq_lens_k.shape[0]),
            block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_ctas_per_sm)

    @cute.kernel
    def kernel(self, q_codes: cute.Tensor, q_scales: cute.Tensor, images: cute.Tensor, image_starts: cute.Tensor,
               rows_per_head: Int32, cu_seqlens_q: cute.Tensor, seq_lens_k: cute.Tensor, out: cute.Tensor,
               lam_scaled: Float32):
        """The CTA: its walk, the mbarriers, then the producer's `_produce` and the consumers' `_consume`."""
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = self._warp_lane()
        role = warp >> 2  # the producer first, then the 2 consumers (warpgroup-uniform)
        block_head, m_block, batch = prefill_grid.cta(cute.arch.block_idx(), cute.arch.grid_dim())
        q_start = cu_seqlens_q[batch]
        q_len = cu_seqlens_q[batch + 1] - q_start
        kv_len = seq_lens_k[batch]
        cta_row0 = m_block * self.block_m
        # the CTA's walk: the tiles its last row sees, the leading keys all its rows see
        cta_tiles, _, cta_common = tile_math.warp_plan(cta_row0, q_len, kv_len, lane >> 2, causal=self.causal,
                                                       tile_keys=TILE_KEYS, warp_rows=self.block_m)
        walk = (Int32(cta_tiles), cta_common)

        smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN)
        bars = cute.recast_ptr(smem_ptr + self.barrier_offset, dtype=cutlass.Int64)
        if tid == 0:
            for s in cutlass.range_constexpr(OPERAND_STAGES):
                cute.arch.mbarrier_init(bars + s, 1)  # full[s]: the producer's arrival (+ the bulk copy's bytes)
                cute.arch.mbarrier_init(bars + OPERAND_STAGES + s, CONSUMER_THREADS)  # empty[s]
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()  # the only CTA-wide barrier: the mbarriers are initialised before any role uses them

        if role < 1:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self._produce(walk, (images, image_starts, rows_per_head), batch, block_head, tid, warp, smem_ptr, bars)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(walk, q_codes, q_scales, out, lam_scaled, block_head, batch, q_start, q_len, kv_len,
                          cta_row0, role - 1, tid & (THREADS - 1), warp & 3, lane, smem_ptr, bars)

    # --- the producer -------------------------------------------------------------------------------------------

    @cute.jit
    def _produce(self, walk, inputs, batch, block_head, tid, warp, smem_ptr, bars):
        """Producer thread 0, walk step p: wait for ``empty[s]`` (s = p mod 8), arm ``full[s]`` with the image's
        bytes, bulk-copy step p's image into stage s. The other producer threads have nothing to do."""
        cta_tiles, _ = walk
        if tid == 0:
            first = self._first_image(inputs, batch, block_head, warp)
            smem = smem_ptr.toint()
            for step in cutlass.range(cta_tiles, unroll=1):
                s, parity = stage_parity(step)
                cute.arch.mbarrier_wait(bars + OPERAND_STAGES + s, parity ^ 1)  # both consumers done with step - 8
                cute.arch.mbarrier_arrive_and_expect_tx(bars + s, self.image_bytes)
                bulk_copy_g2s(self._stage_address(smem, s), first + Int64(cta_tiles - 1 - step) * self.image_bytes,
                              self.image_bytes, smem + self.barrier_offset + 8 * s)

    def _first_image(self, inputs, batch, block_head, warp):
        """Address of the CTA's KV head's first image of sequence ``batch`` (``inputs``: images, their starts, rows
        per KV head); step p copies image ``cta_tiles - 1 - p`` after it."""
        images, image_starts, rows_per_head = inputs
        _, kv_head, _ = self._heads(block_head, warp)
        return images.iterator.toint() + image_row(image_starts[batch], kv_head, 0, rows_per_head) * self.image_bytes

    def _stage_address(self, smem, s):
        """Shared-memory address of operand stage ``s`` (its image's first byte)."""
        return smem + self.offsets[1] + s * self.image_bytes

    # --- the consumers -----------------------------------------------------------------------------------------

    @cute.jit
    def _consume(self, walk, q_codes: cute.Tensor, q_scales: cute.Tensor, out: cute.Tensor, lam_scaled,
                 block_head, batch, q_start, q_len, kv_len, cta_row0, wg, wg_tid, wg_warp, lane, smem_ptr, bars):
        """Consumer ``wg``: its Q tile, rows, softmax state and O, over the operand stages."""
        c = lane & 3
        g = lane >> 2
        head, kv_head, cta_heads = self._heads(block_head, wg_warp)
        row0, warp_row0, _, limits, _ = self._warpgroup_plan(cta_row0, wg, wg_warp, q_len, kv_len, g)
        smem = smem_ptr.toint()
        q_offset = cute.assume(self.offsets[0] + wg * FP8_OPERAND_BYTES, divby=FP8_OPERAND_BYTES)
        mma_qk, s_q, _ = self._qk_operands(smem_ptr, q_offset, self.offsets[1])
        mma_pv, _ = self._pv_operands(smem_ptr, self.offsets[2])
        thr_qk = mma_qk.get_slice(wg_tid)
        thr_pv = mma_pv.get_slice(wg_tid)
        frag_q = thr_qk.make_fragment_A(thr_qk.partition_A(s_q))
        frag_p = thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_KEYS)))
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((64, TILE_KEYS)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, PV_N)), Float32)  # (+ the row sums)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = Float32(0.0)
        state = cute.make_rmem_tensor((STATE_SIZE,), Float32)
        state[0] = -math.inf
        state[1] = -math.inf
        state[2] = Float32(0.0)
        state[3] = Float32(0.0)
        self._row_exponents(state, q_scales, q_start, q_len, warp_row0, head, g)
        self._expand_q(q_codes, q_scales, q_start, q_len, row0, cta_heads[0], wg_tid, smem + q_offset)
        cute.arch.fence_proxy("async.shared", space="cta")  # the Q stores, visible to wgmma
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER + wg, number_of_threads=THREADS)  # the warpgroup's Q tile

        first_head, head_in_cta = cta_heads
        group_first = first_head - kv_head * self.group
        # the lane's offset in an image's Delta_S: its head among the KV head's query heads
        ds_lane = ds_staged_read(head_in_cta if self.heads == self.group else group_first + head_in_cta, c, 0)
        self._consume_walk(walk, (mma_qk, mma_pv, thr_qk, thr_pv, frag_q, frag_p, acc_s, acc_o), state, lam_scaled,
                           ds_lane, limits, c, smem_ptr, bars)
        self._store_rows(state, acc_o, out, q_start, q_len, warp_row0, head, g, c)

    def _pv_operands(self, smem_ptr, v_offset):
        """(PV's tiled MMA, its B operand in shared memory: V^T [136 rows][keys], K-major, `vt_layout`): e4m3
        ``m64n136k32`` (2 k-steps), P from registers."""
        e4m3 = cutlass.Float8E4M3FN
        layout = vt_layout()
        s_vt = cute.make_tensor(cute.recast_ptr(smem_ptr + v_offset, layout.inner, dtype=e4m3), layout.outer)
        mma_pv = sm90_utils.make_trivial_tiled_mma(e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                   (1, 1, 1), (64, PV_N), a_source=warpgroup.OperandSource.RMEM)
        return mma_pv, s_vt

    def _row_exponents(self, state, q_scales, q_start, q_len, row0, head, g):
        """2**e_q of the thread's rows g, g + 8 (from their 8 block scales each, as the expanding quad computes
        them in `_expand_q_chunk`)."""
        for r in range(2):
            query = row0 + g + 8 * r
            valid = Uint32(query < q_len)
            base = q_scales.iterator.toint() + (Int64(q_start + query) * self.num_q_heads + head) * sl.SCALE_ROW_BYTES
            pairs = [load_u16(base + 2 * k, valid, Uint32(0)) for k in range(4)]
            top = fold_max(max_scale_pairs([pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16)]), ())
            e = e4m3_pow2_exponent(top)
            state[ROW_SCALE + r] = f32_pow2(e + Uint32(127))

    @cute.jit
    def _expand_q_chunk(self, q_tile, row, chunk, words, scales):
        """One chunk of Q to e4m3 with its row's power-of-two scale (the quad expanding the row reduces its block
        scales with two shuffles) in the warpgroup's e4m3 Q operand tile."""
        e = e4m3_pow2_exponent(fold_max(max_scale_pairs([scales]), (1, 2)))
        self._store_chunk(q_tile, row, chunk, fp8_chunk_words(words, scales, pow2_factors(e)))

    @cute.jit
    def _consume_walk(self, walk, fixed, state: cute.Tensor, lam_scaled, ds_lane, limits, c, smem_ptr, bars):
        """An odd walk's first step alone, then pairs of steps (those with a masked tile first, then the whole ones):
        `wide_walk`; each step's PV folded into O in the next, the last after the walk."""
        cta_tiles, cta_common = walk
        masked_tiles, _ = tile_math.masked_and_whole(cta_tiles, cta_common, TILE_KEYS)
        lead, masked_pairs, pairs = wide_walk(cta_tiles, masked_tiles)
        pipe = self._walk_pipe(fixed, state, lam_scaled * Float32(2.0 ** -SCORE_SCALE_LOG2), ds_lane, limits, c,
                               smem_ptr, bars)
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
        self._fold_pending(pipe)  # the last step's fold

    def _walk_pipe(self, fixed, state: cute.Tensor, lam, ds_lane, limits, c, smem_ptr, bars) -> ConsumerWalk:
        """What every step of the walk uses: the arguments, the second tile's S and P, the PV accumulator. ``lam``:
        the launch's lam (for scores S 2**-7) times 2**-7, for the unscaled scores S."""
        thr_qk, thr_pv = fixed[2], fixed[3]
        acc_s1 = cute.make_rmem_tensor(thr_qk.partition_shape_C((64, TILE_KEYS)), Float32)
        frag_p1 = thr_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_KEYS)))
        acc_pv = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, PV_N)), Float32)
        return ConsumerWalk(*fixed, acc_s1, frag_p1, acc_pv, state, lam, ds_lane, limits, c, smem_ptr, bars)

    @cute.jit
    def _walk_start(self, pipe: ConsumerWalk) -> None:
        """Nothing pending before the first step: O = O 1 + 0."""
        for i in cutlass.range_constexpr(cute.size(pipe.acc_pv)):
            pipe.acc_pv[i] = Float32(0.0)
        for r in cutlass.range_constexpr(2):
            pipe.state[PENDING_ALPHA + r] = Float32(1.0)

    def _fold_pending(self, pipe: ConsumerWalk) -> None:
        """The previous step's O = O alpha + P V."""
        fold_pv(pipe.acc_o, pipe.acc_pv, [pipe.state[PENDING_ALPHA + r] for r in range(2)])

    @cute.jit
    def _wide_step(self, masked: cutlass.Constexpr, step, cta_tiles, pipe: ConsumerWalk,
                   single: cutlass.Constexpr = False):
        """Walk steps ``step`` and ``step + 1`` as one 128-key tile (module docstring), both stages released;
        ``single``: step ``step`` alone (an odd walk's first)."""
        state, smem_ptr = pipe.state, pipe.smem_ptr
        s0, tile_scale0 = self._issue_qk(masked, step, cta_tiles, pipe, pipe.acc_s)
        lane_max = None
        if cutlass.const_expr(single):
            self._fold_pending(pipe)  # the previous step's fold, under this QK
            warpgroup.wait_group(0)
            scores = self._staged_scores(s0, pipe.acc_s, state, pipe.ds_lane, smem_ptr.toint())
        else:
            s1, tile_scale1 = self._issue_qk(masked, step + 1, cta_tiles, pipe, pipe.acc_s1)
            self._fold_pending(pipe)  # the previous step's fold, under both QKs (placed after the first, ptxas put
            # it between its k-steps)
            scores, lane_max = self._pair_scores(s0, s1, (tile_scale0, tile_scale1), pipe)
        probs, alphas = self._softmax(scores, state, pipe.lam, lane_max)
        p_operand_fp8(probs[:N_BLOCKS], cute.recast_tensor(pipe.frag_p, Uint32))
        frag_vt0 = self._vt_fragment(pipe.thr_pv, smem_ptr, s0)
        if cutlass.const_expr(single):
            self._pv_gemm(pipe.mma_pv, pipe.acc_pv, pipe.frag_p, frag_vt0, fresh=True)
        else:
            p_operand_fp8(probs[N_BLOCKS:], cute.recast_tensor(pipe.frag_p1, Uint32))
            frag_vt1 = self._vt_fragment(pipe.thr_pv, smem_ptr, s1)
            self._pv_gemm(pipe.mma_pv, pipe.acc_pv, pipe.frag_p, frag_vt0, fresh=True, wait=False)
            self._pv_gemm(pipe.mma_pv, pipe.acc_pv, pipe.frag_p1, frag_vt1)
        for r in cutlass.range_constexpr(2):
            state[PENDING_ALPHA + r] = alphas[r]
        cute.arch.mbarrier_arrive(pipe.bars + OPERAND_STAGES + s0)  # empty[s0] (and empty[s1]): one of 256 arrivals
        if cutlass.const_expr(not single):
            cute.arch.mbarrier_arrive(pipe.bars + OPERAND_STAGES + s1)

    def _issue_qk(self, masked: bool, step, cta_tiles, pipe: ConsumerWalk, acc_s: cute.Tensor) -> tuple:
        """Wait for walk step ``step``'s stage and issue its QK wgmma into ``acc_s`` (from 0, -inf where masked),
        committed, not waited for -> (its stage, its tile scale)."""
        s, tile = self._await_step(step, cta_tiles, pipe.state, pipe.smem_ptr, pipe.bars)
        k_offset = cute.assume(self.offsets[1] + s * self.image_bytes,
                               divby=math.gcd(self.offsets[1], self.image_bytes))
        _, _, s_k = self._qk_operands(pipe.smem_ptr, self.offsets[0], k_offset)
        frag_k = pipe.thr_qk.make_fragment_B(pipe.thr_qk.partition_B(s_k))
        key0 = tile * TILE_KEYS
        if cutlass.const_expr(masked):
            c = pipe.c
            seen = (pipe.limits[0] - key0 - 2 * c, pipe.limits[1] - key0 - 2 * c)
            for block in range(N_BLOCKS):
                init = tile_math.score_init(None, seen, block)  # 0, or -inf where masked
                for i in range(4):
                    acc_s[4 * block + i] = init[i]
        gemm(pipe.mma_qk, acc_s, pipe.frag_q, frag_k, fresh=not masked, wait=False)
        return s, pipe.state[TILE_SCALE]

    @cute.jit
    def _await_step(self, step, cta_tiles, state: cute.Tensor, smem_ptr, bars):
        """Wait for ``full[s]`` of walk step ``step``; the tile's K exponent (from the stage's image) into
        ``state`` -> (operand stage s, tile index)."""
        s, parity = stage_parity(step)
        cute.arch.mbarrier_wait(bars + s, parity)
        stage = self._stage_address(smem_ptr.toint(), s)
        state[TILE_SCALE] = bits_to_f32(load_shared_u32(stage + self.exponent_offset))
        return s, cta_tiles - 1 - step

    def _ds_words(self, s, ds_lane, smem) -> list | None:
        """This lane's FP32 Delta_S of operand stage ``s`` (one 16-byte load per 2 column blocks); None in the
        direct build."""
        if not self.compensate:
            return None
        base = smem + self.offsets[2] + VT_BYTES + s * self.image_bytes + ds_lane
        return [load_shared_v4_u32(base, ds_staged_read(0, 0, i)) for i in range(N_BLOCKS // 2)]

    def _staged_scores(self, s, acc_s: cute.Tensor, state: cute.Tensor, ds_lane, smem, words=None) -> list:
        """The scores of operand stage ``s``'s tile from its QK accumulator (waited for): times the row and tile
        scales, plus the FP32 Delta_S (``words``: loaded ahead by `_ds_words`, else loaded here)."""
        scale = [state[ROW_SCALE + r] * state[TILE_SCALE] for r in range(2)]
        if cutlass.const_expr(not self.compensate):
            return [[acc_s[4 * block + i] * scale[i >> 1] for i in range(4)] for block in range(N_BLOCKS)]
        words = self._ds_words(s, ds_lane, smem) if words is None else words
        return [[acc_s[4 * block + i] * scale[i >> 1] + bits_to_f32(words[block >> 1][2 * (block & 1) + (i & 1)])
                 for i in range(4)] for block in range(N_BLOCKS)]

    def _pair_scores(self, s0, s1, tile_scales: tuple, pipe: ConsumerWalk) -> tuple:
        """A pair's scores and lane maxima: the first tile's while the second tile's QK runs; each tile's Delta_S
        loaded before the wait for its QK (16 registers live across each wait) -> (both tiles' scores, lane
        maxima)."""
        state, ds_lane = pipe.state, pipe.ds_lane
        smem = pipe.smem_ptr.toint()
        words0 = self._ds_words(s0, ds_lane, smem)
        warpgroup.wait_group(1)  # the first tile's QK
        words1 = self._ds_words(s1, ds_lane, smem)
        state[TILE_SCALE] = tile_scales[0]
        scores = self._staged_scores(s0, pipe.acc_s, state, ds_lane, smem, words0)
        lane_max = tile_math.lane_row_maxima(scores)
        warpgroup.wait_group(0)  # the second's
        state[TILE_SCALE] = tile_scales[1]
        scores1 = self._staged_scores(s1, pipe.acc_s1, state, ds_lane, smem, words1)
        lane_max = [tile_math.fmax(m, m1) for m, m1 in zip(lane_max, tile_math.lane_row_maxima(scores1))]
        return scores + scores1, lane_max

    def _softmax(self, scores: list, state: cute.Tensor, lam, lane_max: list) -> tuple:
        """A step's online softmax (`softmax_update`: P times 448) -> (P, alphas). Ablations (timing only):
        ``exp2`` off, exp2 by `ablation.no_exp2`; ``rowstats`` off, P = exp2(lam S) with no maximum, sum or rescale
        (alphas 1, the state untouched)."""
        exp2 = None if self.ablation.exp2 else no_exp2
        if not self.ablation.rowstats:
            return plain_probs(scores, lam, exp2 or tile_math.exp2_approx), [Float32(1.0), Float32(1.0)]
        return softmax_update(scores, state, lam, P_SCALE_LOG2, lane_max, exp2)

    def _vt_fragment(self, thr_pv, smem_ptr, s):
        """PV's B operand: the V^T tile of operand stage ``s``."""
        v_offset = cute.assume(self.offsets[2] + s * self.image_bytes,
                               divby=math.gcd(self.offsets[2], self.image_bytes))
        _, s_vt = self._pv_operands(smem_ptr, v_offset)
        return thr_pv.make_fragment_B(thr_pv.partition_B(s_vt))

    def _pv_gemm(self, mma_pv, acc_pv: cute.Tensor, frag_p: cute.Tensor, frag_vt: cute.Tensor, fresh: bool = False,
                 wait: bool = True) -> None:
        """The PV wgmma group (`gemm`). Ablation ``pv`` off (timing only): no wgmma; each P word, as FP32 bits with
        the exponent cleared, into one accumulator register (`ablation.fold_p_words`: P stays live), and an empty
        group committed (and waited for) in its place, so that the later ``wait_group`` counts stay."""
        if self.ablation.pv:
            gemm(mma_pv, acc_pv, frag_p, frag_vt, fresh=fresh, wait=wait)
            return
        fold_p_words(acc_pv, [frag_p], fresh)
        warpgroup.commit_group()
        if wait:
            warpgroup.wait_group(0)

    def _row_sum(self, state: cute.Tensor, acc_o: cute.Tensor, r: int):
        """Row g + 8 r's l: PV's column 128, held by lane 4g (register 64 + 2r)."""
        return shuffle_idx(acc_o[HEAD_DIM // 2 + 2 * r], Uint32(cute.arch.lane_idx() & ~3))
