"""Log-sum-exp merge of the split-KV decode partials, CuTe DSL.

One CTA per (query head, request), `WARPS` warps, in two passes: the CTA's threads load the partitions' maxima
(one each per pass) and reduce them to the head's maximum M; then warp w sums partitions w, w + WARPS, ... weighted
by l_p 2**(lam (m_p - M)) (lane = 4 head dimensions), and the warps add up through shared memory: O = sum / sum of
weights, as the reference (`merge_partials`) computes it. With few requests (32 CTAs at batch 1) the merge waits on
load latency (docs/kernels.md): against one maximum nothing carries between partitions, so each warp loads
`UNROLL` partitions before it sums them (ptxas still sinks some of those loads to their first use), and 32 warps
(34 registers, no local memory) keep many loads in flight; a merge that folded a running (m, l, O) in 8 warps, each
partition's loads after the previous one's rescale, took 31.4 us at 32K x 1, this one 27.0 (128K x 1: 66.6 us). It
is launched as a programmatic dependent of the split kernel (PDL, ``griddepcontrol.wait`` before the partials are
read), so its launch overlaps the split kernel's tail. Only the request's non-empty partitions,
``ceil(seq_len / partition_size)`` with the split kernel's per-request size (`decode_layout.partition_keys`), are
read; a request without keys gets 0. The result equals `mpfa.kernels.reference.merge_partials` up to FP32 rounding
and summation order.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from .decode_layout import partition_keys
from .ptx import bits_to_f32, exp2_approx, load_u32_group

HEAD_DIM = 128
WARPS = 32  # 1,024 threads per CTA (the most: ptxas then caps the registers at 64)
UNROLL = 4  # partitions a warp has in flight


class DecodeMergeSm90:
    """Compile-time choice: the output dtype (``cutlass.BFloat16`` or ``cutlass.Float32``)."""

    def __init__(self, out_dtype) -> None:
        if out_dtype not in (cutlass.BFloat16, cutlass.Float32):
            raise ValueError(f"decode output must be BFloat16 or Float32, got {out_dtype}")
        self.out_dtype = out_dtype

    @cute.jit
    def __call__(
        self,
        m_part: cute.Tensor,  # fp32 [B, Hq, P]
        l_part: cute.Tensor,  # fp32 [B, Hq, P]
        o_part: cute.Tensor,  # fp32 [B, Hq, P, 128]
        seq_lens: cute.Tensor,  # int32 [B]
        out: cute.Tensor,  # [B, Hq, 128]
        lam: Float32,  # log2(e) * sm_scale
        min_partition: Int32,
        stream,
    ):
        self.kernel(m_part, l_part, o_part, seq_lens, out, lam, min_partition).launch(
            grid=(m_part.shape[1], m_part.shape[0], 1), block=(32 * WARPS, 1, 1), stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, m_part, l_part, o_part, seq_lens, out, lam: Float32, min_partition: Int32):
        tid, _, _ = cute.arch.thread_idx()
        warp = tid // 32
        lane = tid % 32
        head, batch_idx, _ = cute.arch.block_idx()
        num_heads = m_part.shape[1]
        num_parts = m_part.shape[2]
        seq_len = seq_lens[batch_idx]
        partition_size = partition_keys(seq_len, num_parts, min_partition, cutlass.max)
        valid_parts = cutlass.min((seq_len + partition_size - 1) // partition_size, num_parts)
        row = Int64(batch_idx * num_heads + head) * num_parts
        o_base = o_part.iterator.toint()
        m_base, l_base = m_part.iterator.toint(), l_part.iterator.toint()  # compact [B, Hq, P], as o_part

        smem = cutlass.utils.SmemAllocator()
        s_max = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), 16)
        s_l = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), 16)
        s_o = smem.allocate_tensor(Float32, cute.make_layout((HEAD_DIM, WARPS)), 16)

        # launched as a programmatic dependent of the split kernel (PDL): its CTAs may start while the split kernel
        # still runs; the partials are read only once it has completed and its writes are visible
        cute.arch.griddepcontrol_wait()
        # 1. the maximum over the partitions (one m per thread and pass: independent loads)
        m_max = -math.inf
        for part in cutlass.range(tid, valid_parts, 32 * WARPS, unroll=1):
            m_max = cute.arch.fmax(m_max, m_part[batch_idx, head, part])
        m_max = cute.arch.warp_reduction_max(Float32(m_max))
        if lane == 0:
            s_max[warp] = m_max
        cute.arch.sync_threads()
        m_all = s_max[0]
        for w in cutlass.range_constexpr(1, WARPS):
            m_all = cute.arch.fmax(m_all, s_max[w])
        m_lam = Float32(cutlass.select_(m_all == -math.inf, Float32(0.0), m_all)) * lam

        # 2. each warp sums its partitions' l and O weighted against it: no running rescale, so nothing carries
        # from one partition's loads to the next (unrolled, several loads in flight)
        running = cute.make_rmem_tensor((5,), Float32)  # l, then O over the lane's 4 dimensions
        for i in cutlass.range_constexpr(5):
            running[i] = Float32(0.0)
        for first in cutlass.range(warp, valid_parts, WARPS * UNROLL, unroll=1):
            # every load of the UNROLL partitions first, in one block (a partition past the last reads the last:
            # weight 0)
            offsets = [row + cutlass.min(first + WARPS * u, valid_parts - 1) for u in range(UNROLL)]
            ml = load_u32_group([m_base + 4 * o for o in offsets] + [l_base + 4 * o for o in offsets])
            vectors = load_u32_group([o_base + (o * HEAD_DIM + 4 * lane) * 4 for o in offsets], vector=4)
            loads = [(ml[u][0], ml[UNROLL + u][0], vectors[u]) for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                m_p, l_p, words = loads[u]
                weight = Float32(cutlass.select_(first + WARPS * u < valid_parts,
                                                 bits_to_f32(l_p) * exp2_approx(bits_to_f32(m_p) * lam - m_lam),
                                                 Float32(0.0)))
                running[0] = running[0] + weight
                for i in cutlass.range_constexpr(4):
                    running[1 + i] = running[1 + i] + weight * bits_to_f32(words[i])
        if lane == 0:
            s_l[warp] = running[0]
        for i in cutlass.range_constexpr(4):
            s_o[4 * lane + i, warp] = running[1 + i]
        cute.arch.sync_threads()

        if tid < HEAD_DIM:
            total = Float32(0.0)
            value = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                total = total + s_l[w]
                value = value + s_o[tid, w]
            result = Float32(cutlass.select_(total > Float32(0.0), value / total, Float32(0.0)))
            out[batch_idx, head, tid] = result.to(self.out_dtype)
