"""Centering identity, shift invariance of the dropped Q K_bar^T term, and Delta_S in BF16."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import attention, attention_float64, center, delta_s, sequence_means


def test_means_are_per_sequence_and_empty_is_zero(gen: torch.Generator) -> None:
    x = torch.randn(9, 2, 16, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 4, 4, 9])
    means = sequence_means(x, cu)
    assert means.dtype == torch.float64
    torch.testing.assert_close(means[0], x[:4].mean(0), rtol=0, atol=1e-15)
    assert torch.equal(means[1], torch.zeros(2, 16, dtype=torch.float64))
    torch.testing.assert_close(means[2], x[4:].mean(0), rtol=0, atol=1e-15)
    centered = center(x, means, cu)
    torch.testing.assert_close(sequence_means(centered, cu), torch.zeros_like(means), rtol=0, atol=1e-15)
    with pytest.raises(ValueError):
        center(x, means[:2], cu)


def test_score_identity_and_shift_invariance(gen: torch.Generator) -> None:
    """Q K^T = Q_c K_c^T + Q_bar K_c^T + Q K_bar^T exactly; dropping the row-constant Q K_bar^T leaves softmax
    unchanged. Float64 with GQA (4 query heads per KV head) and channel offsets."""
    group, num_kv_heads, head_dim, length = 4, 2, 64, 37
    q = torch.randn(length, group * num_kv_heads, head_dim, generator=gen, dtype=torch.float64) + 3
    k = torch.randn(length, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) - 5
    cu = torch.tensor([0, length])
    q_mean, k_mean = sequence_means(q, cu), sequence_means(k, cu)
    q_c, k_c = center(q, q_mean, cu), center(k, k_mean, cu)
    k_full = k.repeat_interleave(group, 1)
    k_c_full = k_c.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k_full)
    centered = torch.einsum("ihd,jhd->hij", q_c, k_c_full)
    delta = torch.einsum("hd,jhd->hj", q_mean[0], k_c_full)
    row_constant = torch.einsum("ihd,hd->hi", q, k_mean[0].repeat_interleave(group, 0))
    torch.testing.assert_close(centered + delta[:, None, :] + row_constant[..., None], scores, rtol=1e-12, atol=1e-9)
    assert row_constant.std() > 1  # the dropped term is large, not a no-op ...
    torch.testing.assert_close(  # ... yet softmax ignores it
        torch.softmax((centered + delta[:, None, :]) / head_dim**0.5, -1),
        torch.softmax(scores / head_dim**0.5, -1),
        rtol=0,
        atol=1e-12,
    )


def test_delta_s_is_bf16_rounded_q_bar_dot_k_c(gen: torch.Generator) -> None:
    group, num_kv_heads, head_dim = 5, 2, 128
    cu = torch.tensor([0, 7, 7, 30])
    q_mean = torch.randn(3, group * num_kv_heads, head_dim, generator=gen)
    k_c = torch.randn(30, num_kv_heads, head_dim, generator=gen) * 2
    ds = delta_s(q_mean, k_c, cu)
    assert ds.dtype == torch.bfloat16 and ds.shape == (30, group * num_kv_heads)
    seq = torch.tensor([0] * 7 + [2] * 23)
    exact = torch.einsum("jhd,jhd->jh", q_mean.double()[seq], k_c.double().repeat_interleave(group, 1))
    # one BF16 rounding (relative 2**-8) of an FP32 dot product
    assert bool(((ds.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-4).all())
    with pytest.raises(ValueError):
        delta_s(q_mean[:, :3], k_c, cu)


def test_smoothing_only_variant_matches_float64_without_quantization_loss(make_batch) -> None:
    """With large per-channel offsets, centering + Delta_S (qk4-pv16) keeps NVFP4 close to float64, while the same
    NVFP4 without centering (qk4-pv8-direct) is far off: the offsets dominate its block scales."""
    b = make_batch([90, 40], [90, 70], 4, 2, 64, q_offset=4.0, k_offset=8.0)
    ref = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)

    def rel(variant: str) -> float:
        out = attention(b.q, b.k, b.v, variant=variant, causal=True, **b.varlen)
        assert bool(torch.isfinite(out).all())
        return float((out.double() - ref).norm() / ref.norm())

    assert 1.5 * rel("qk4-pv16") < rel("qk4-pv8-direct")
