"""Log-sum-exp merge of the split-KV decode partials, CuTe DSL.

One CTA per (query head, request), `WARPS` warps: warp w folds partitions w, w + WARPS, ... into its own running
(m, l, O) (lane = 4 head dimensions), then the warps combine through shared memory. Each warp's fold is a chain of
dependent loads, so with few requests (32 CTAs at batch 1) the merge waits on load latency (profiles/NOTES.md,
"Session 18, fourth sitting"): 16 warps (512 threads) keep twice the loads of 8 in flight, which took 32K x 1 from
31.4 to 28.2 us and 128K x 1 from 71.3 to 68.1 with batch 8 unchanged (session 19; at 32 warps ptxas caps the
merge at 64 registers and it spills). Only the request's non-empty partitions, ``ceil(seq_len / partition_size)`` with the split
kernel's per-request size (`decode_layout.partition_keys`), are read; a request without keys gets 0. The result
equals `mpfa.kernels.reference.merge_partials` up to FP32 rounding (the reference weights every partition against
the global max at once, the kernel rescales as it goes).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from mpfa.kernels.sm90.decode_layout import partition_keys
from mpfa.kernels.sm90.ptx import bits_to_f32, exp2_approx, load_v4_u32

HEAD_DIM = 128
WARPS = 16  # 512 threads per CTA


class DecodeMergeSm90:
    """Compile-time choice: the output dtype (``cutlass.BFloat16`` or ``cutlass.Float32``)."""

    def __init__(self, out_dtype) -> None:
        if out_dtype not in (cutlass.BFloat16, cutlass.Float32):
            raise ValueError(f"decode output must be BFloat16 or Float32, got {out_dtype}")
        self.out_dtype = out_dtype
        self.warps = WARPS

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
            grid=(m_part.shape[1], m_part.shape[0], 1), block=(32 * self.warps, 1, 1), stream=stream
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

        running = cute.make_rmem_tensor((6,), Float32)  # m, l, then O over the lane's 4 dimensions
        running[0] = -math.inf
        for i in cutlass.range_constexpr(1, 6):
            running[i] = Float32(0.0)
        for part in cutlass.range(warp, valid_parts, self.warps, unroll=2):
            m_p = m_part[batch_idx, head, part]
            l_p = l_part[batch_idx, head, part]
            words = load_v4_u32(o_base + ((row + part) * HEAD_DIM + 4 * lane) * 4, Uint32(1))
            m_new = cute.arch.fmax(running[0], m_p)
            keep = exp2_approx(running[0] * lam - m_new * lam)
            weight = l_p * exp2_approx(m_p * lam - m_new * lam)
            running[0] = m_new
            running[1] = running[1] * keep + weight
            for i in cutlass.range_constexpr(4):
                running[2 + i] = running[2 + i] * keep + weight * bits_to_f32(words[i])

        smem = cutlass.utils.SmemAllocator()
        s_ml = smem.allocate_tensor(Float32, cute.make_layout((2, self.warps)), 16)
        s_o = smem.allocate_tensor(Float32, cute.make_layout((HEAD_DIM, self.warps)), 16)
        if lane == 0:
            s_ml[0, warp] = running[0]
            s_ml[1, warp] = running[1]
        for i in cutlass.range_constexpr(4):
            s_o[4 * lane + i, warp] = running[2 + i]
        cute.arch.sync_threads()

        if tid < HEAD_DIM:
            m_all = s_ml[0, 0]
            for w in cutlass.range_constexpr(1, self.warps):
                m_all = cute.arch.fmax(m_all, s_ml[0, w])
            m_ref = Float32(cutlass.select_(m_all == -math.inf, Float32(0.0), m_all))
            total = Float32(0.0)
            value = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps):
                factor = exp2_approx(s_ml[0, w] * lam - m_ref * lam)
                total = total + s_ml[1, w] * factor
                value = value + s_o[tid, w] * factor
            result = Float32(cutlass.select_(total > Float32(0.0), value / total, Float32(0.0)))
            out[batch_idx, head, tid] = result.to(self.out_dtype)
