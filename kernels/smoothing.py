"""Sequence centering of Q and K with the rank-one Delta-S compensation.

Per (layer, head) means Q_bar, K_bar are taken over a request's valid (prefill) tokens and frozen for its lifetime;
decode tokens are centered with the frozen means, so every function here takes the means explicitly.

Identity (per query head h, its KV head, query i and key j):
    Q K^T = Q_c K_c^T + Q_bar K_c^T + Q K_bar^T
The last term is constant along each score row and softmax is shift-invariant, so it is dropped. The middle term
``Delta_S[j] = Q_bar . K_c[j]`` depends only on the key: one value per key token and query head (with GQA, group-size
values per key token per KV head), stored in BF16 and added to the scores before masking and the running max.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SmoothingMeans:
    """Frozen per-request means: ``q_mean`` FP32 [batch, Hq, d], ``k_mean`` FP32 [batch, Hkv, d]."""

    q_mean: torch.Tensor
    k_mean: torch.Tensor


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str) -> torch.Tensor:
    """Validate cumulative sequence lengths [batch + 1] (0-based, non-decreasing, ending at ``total``); int64 on CPU."""
    cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor [batch + 1], got shape {tuple(cu.shape)}")
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) != total:
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at {total}, got {cu.tolist()}")
    return cu


def _segment_ids(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """FP32, or float64 when x is float64 (exact-math checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def sequence_means(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence, per-head mean of x [total, H, d] over each sequence's tokens -> [batch, H, d], in FP32
    (float64 for float64 input). An empty sequence gets a zero mean (centering is then the identity)."""
    cu = check_cu_seqlens(cu_seqlens, x.shape[0], "cu_seqlens")
    batch, dtype = cu.numel() - 1, _math_dtype(x)
    sums = torch.zeros((batch, *x.shape[1:]), dtype=dtype, device=x.device)
    sums.index_add_(0, _segment_ids(cu, x.device), x.to(dtype))
    counts = (cu[1:] - cu[:-1]).clamp(min=1).to(x.device, dtype)
    return sums / counts.view(batch, *([1] * (x.dim() - 1)))


def center(x: torch.Tensor, means: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``x - mean`` of each token's sequence in FP32 (float64 for float64 x); x [total, H, d], means [batch, H, d]."""
    cu = check_cu_seqlens(cu_seqlens, x.shape[0], "cu_seqlens")
    if means.shape != (cu.numel() - 1, *x.shape[1:]):
        raise ValueError(f"means shape {tuple(means.shape)} does not match [batch={cu.numel() - 1}, H, d] of x")
    dtype = _math_dtype(x)
    return x.to(dtype) - means.to(x.device, dtype)[_segment_ids(cu, x.device)]


def delta_s(q_mean: torch.Tensor, k_centered: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """``Delta_S[j, h] = Q_bar[b(j), h] . K_c[j, h // group]`` in FP32, rounded to BF16 -> [total_k, Hq].

    q_mean [batch, Hq, d]; k_centered [total_k, Hkv, d] (already centered); group = Hq / Hkv."""
    cu = check_cu_seqlens(cu_seqlens_k, k_centered.shape[0], "cu_seqlens_k")
    batch, num_q_heads, head_dim = q_mean.shape
    num_kv_heads = k_centered.shape[1]
    if batch != cu.numel() - 1 or head_dim != k_centered.shape[2] or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q_mean {tuple(q_mean.shape)} does not fit k_centered {tuple(k_centered.shape)} "
            f"with {cu.numel() - 1} sequences"
        )
    group = num_q_heads // num_kv_heads
    q_bar = q_mean.to(k_centered.device, torch.float32)[_segment_ids(cu, k_centered.device)]  # [total_k, Hq, d]
    k_per_q_head = k_centered.float().repeat_interleave(group, dim=1)  # [total_k, Hq, d]
    return (q_bar * k_per_q_head).sum(-1).to(torch.bfloat16)


def masked_means(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row, per-head mean of a right-padded batch x [B, L, H, d] over the tokens where ``valid`` [B, L] (bool) is
    True (None: all) -> [B, H, d] in FP32 (float64 for float64 x); a row without valid tokens gets 0.

    The sums are formed in float64, where BF16 / FP32 tokens add up exactly (or within 2**-53 relative), and the
    mean is rounded once: it does not depend on the summation order, so a row's mean is the same whatever the batch
    and padding around it and on every device (``sequence_means`` sums in FP32 with ``index_add_``, whose order
    CUDA does not fix); it equals ``sequence_means`` up to that FP32 rounding."""
    if valid is not None and tuple(valid.shape) != tuple(x.shape[:2]):
        raise ValueError(f"valid must be [B, L] = {tuple(x.shape[:2])}, got {tuple(valid.shape)}")
    wide = x.to(torch.float64)
    if valid is None:
        sums, counts = wide.sum(1), torch.full((x.shape[0],), x.shape[1], dtype=torch.float64, device=x.device)
    else:
        valid = valid.to(x.device, torch.bool)
        sums = torch.where(valid[:, :, None, None], wide, torch.zeros((), dtype=wide.dtype, device=x.device)).sum(1)
        counts = valid.sum(1).to(torch.float64)
    means = sums / counts.clamp(min=1).view(-1, *([1] * (x.dim() - 2)))
    return means.to(_math_dtype(x))


def delta_s_padded(q_mean: torch.Tensor, k_centered: torch.Tensor) -> torch.Tensor:
    """``delta_s`` of a padded batch: q_mean [B, Hq, d], k_centered [B, L, Hkv, d] -> Delta_S [B, L, Hq] in BF16 (the
    same products and sums per key as ``delta_s``)."""
    batch, num_q_heads, head_dim = q_mean.shape
    if k_centered.dim() != 4 or k_centered.shape[0] != batch or k_centered.shape[3] != head_dim \
            or num_q_heads % k_centered.shape[2]:
        raise ValueError(
            f"q_mean {tuple(q_mean.shape)} does not fit k_centered {tuple(k_centered.shape)} [B, L, Hkv, d]")
    group = num_q_heads // k_centered.shape[2]
    q_bar = q_mean.to(k_centered.device, torch.float32)[:, None]  # [B, 1, Hq, d]
    k_per_q_head = k_centered.float().repeat_interleave(group, dim=2)  # [B, L, Hq, d]
    return (q_bar * k_per_q_head).sum(-1).to(torch.bfloat16)
