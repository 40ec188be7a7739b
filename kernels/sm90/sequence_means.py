"""Per-request means of Q or K over the prefill tokens (the frozen smoothing means), a Triton reduction.

Each (request, head) sequence is cut into ``SPLITS`` slices summed by their own programs in FP32 (so a 8K-token
chunk is not one program's serial walk: with 8 KV heads that was 8 programs on 132 SMs), then the partial sums are
added in a fixed order and divided by the length (an empty sequence gets 0, as
`mpfa.kernels.smoothing.sequence_means`). The summation order differs from the reference's, so the means agree to
FP32 rounding, not bit for bit; the cache formats are bit-exact *given* the means.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TOKENS_PER_STEP = 32
SPLITS = 16  # slices per (request, head)


@triton.jit
def _sequence_means_kernel(x_ptr, cu_ptr, out_ptr, x_stride,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                           SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    per = tl.cdiv(tl.cdiv(end - start, SPLITS), TOKENS) * TOKENS  # whole steps per slice
    first = start + split * per
    last = tl.minimum(first + per, end)
    d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, TOKENS)
    acc = tl.zeros((TOKENS, HEAD_DIM), tl.float32)
    while first < last:  # a while loop: the CPU interpreter cannot index range() with a runtime bound
        token = first + rows
        mask = (token < last)[:, None] & (d >= 0)[None, :]
        x = tl.load(x_ptr + token.to(tl.int64)[:, None] * x_stride + head * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32)
        first += TOKENS
    tl.store(out_ptr + ((seq * NUM_HEADS + head) * SPLITS + split) * HEAD_DIM + d, tl.sum(acc, axis=0))


def sequence_means(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] BF16 or FP32 (heads contiguous), cu_seqlens [B + 1] int32 on x's device -> FP32 means
    [B, H, d].

    The sequence bounds are read on the device: no host synchronisation."""
    tokens, num_heads, head_dim = x.shape
    if x.dtype not in (torch.bfloat16, torch.float32) or x.stride()[1:] != (head_dim, 1) or head_dim & (head_dim - 1):
        raise ValueError(f"x must be BF16 or FP32 [T, H, d] with contiguous heads and a power-of-two d, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [batch + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    batch = cu_seqlens.numel() - 1
    partial = torch.empty((batch, num_heads, SPLITS, head_dim), dtype=torch.float32, device=x.device)
    _sequence_means_kernel[(batch, num_heads, SPLITS)](
        x, cu_seqlens, partial, x.stride(0), NUM_HEADS=num_heads, HEAD_DIM=head_dim, TOKENS=_TOKENS_PER_STEP,
        SPLITS=SPLITS,
    )
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).clamp(min=1).to(torch.float32)
    return partial.sum(dim=2) / counts[:, None, None]
