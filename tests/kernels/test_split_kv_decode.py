"""Split-KV decode: partitions merged by log-sum-exp equal the unsplit computation; empty partitions are inert."""

from __future__ import annotations

import math

import pytest
import torch

from mpfa.kernels import (DecodePartials, SmoothingMeans, attention, attention_float64, decode, decode_partials,
                          merge_partials, sequence_means)

KV_LENS = [1, 300, 129, 0]


def decode_inputs(make_batch, kv_lens: list[int], hq: int = 8, hkv: int = 2, d: int = 64):
    """One query token per request (q [batch, Hq, d]) against packed caches of the given lengths."""
    b = make_batch([1] * len(kv_lens), kv_lens, hq, hkv, d)
    return b, b.q  # packed q of one token per request is already [batch, Hq, d]


def test_float64_split_equals_unsplit_and_dense(make_batch) -> None:
    b, q = decode_inputs(make_batch, KV_LENS)
    split = decode_partials(q, b.k, b.v, variant="float64", cu_seqlens_k=b.cu_k, partition_size=64, block_n=32)
    assert split.m.shape == (4, 8, 5) and split.o.shape == (4, 8, 5, 64) and split.m.dtype == torch.float64
    whole = decode(q, b.k, b.v, variant="float64", cu_seqlens_k=b.cu_k, partition_size=512, block_n=32)
    dense = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)
    merged = merge_partials(split)
    assert bool(torch.isfinite(merged).all())
    torch.testing.assert_close(merged, dense, rtol=0, atol=1e-12)
    torch.testing.assert_close(whole, dense, rtol=0, atol=1e-12)
    assert not bool(merged[3].any())  # no keys -> 0


def test_empty_partitions_hold_neutral_state(make_batch) -> None:
    b, q = decode_inputs(make_batch, KV_LENS)
    parts = decode_partials(q, b.k, b.v, variant="bf16", cu_seqlens_k=b.cu_k, partition_size=128, block_n=64)
    used = torch.tensor([[math.ceil(n / 128) > p for p in range(3)] for n in KV_LENS])  # [batch, partitions]
    used = used[:, None, :].expand_as(parts.m)
    assert bool(torch.isinf(parts.m[~used]).all()) and bool((parts.m[~used] < 0).all())
    assert not bool(parts.l[~used].any()) and not bool(parts.o[~used].any())
    assert bool(torch.isfinite(parts.m[used]).all()) and bool((parts.l[used] >= 1).all())
    assert bool(torch.isfinite(parts.o).all())


def test_bf16_split_equals_unsplit_within_p_rounding(make_batch) -> None:
    b, q = decode_inputs(make_batch, KV_LENS)
    dense = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)
    bound = (2.0**-8 + 2.0**-12) * attention_float64(b.q, b.k, b.v.abs(), causal=True, **b.varlen)
    split = decode(q, b.k, b.v, variant="bf16", cu_seqlens_k=b.cu_k, partition_size=64, block_n=32)
    whole = decode(q, b.k, b.v, variant="bf16", cu_seqlens_k=b.cu_k, partition_size=1024, block_n=32)
    for out in (split, whole):
        assert bool(torch.isfinite(out).all()) and bool(((out.double() - dense).abs() <= bound).all())
    assert bool(((split - whole).double().abs() <= 2 * bound).all())


def test_mpfa_decode_matches_prefill_attention_with_frozen_means(make_batch, to_paged) -> None:
    """Decode with the prefill means equals the tiled attention of the same one-token queries (one partition: only
    the merge's rescaling differs), and a paged cache gives bit-identical partials."""
    prefill = make_batch([40, 70], [40, 70], 8, 2, 64, q_offset=2.0, k_offset=4.0)
    means = SmoothingMeans(sequence_means(prefill.q, prefill.cu_q), sequence_means(prefill.k, prefill.cu_k))
    b, q = decode_inputs(make_batch, [41, 71])
    whole = decode(q, b.k, b.v, variant="mpfa", cu_seqlens_k=b.cu_k, means=means)
    tiled = attention(b.q, b.k, b.v, variant="mpfa", causal=True, means=means, **b.varlen)
    assert bool(torch.isfinite(whole).all())
    torch.testing.assert_close(whole, tiled, rtol=1e-5, atol=1e-6)
    k_cache, v_cache, table = to_paged(b.k, b.v, b.cu_k, 16)
    kwargs = dict(variant="mpfa", cu_seqlens_k=b.cu_k, means=means, partition_size=32, block_n=32)
    paged = decode_partials(q, k_cache, v_cache, page_table=table, page_size=16, **kwargs)
    packed = decode_partials(q, b.k, b.v, **kwargs)
    assert all(torch.equal(x, y) for x, y in ((paged.m, packed.m), (paged.l, packed.l), (paged.o, packed.o)))


def test_merge_of_all_empty_partitions_is_zero() -> None:
    empty = DecodePartials(
        m=torch.full((2, 4, 3), -math.inf), l=torch.zeros(2, 4, 3), o=torch.zeros(2, 4, 3, 64), lam=0.18
    )
    merged = merge_partials(empty)
    assert merged.shape == (2, 4, 64) and bool(torch.isfinite(merged).all()) and not bool(merged.any())


def test_decode_argument_errors(make_batch) -> None:
    b, q = decode_inputs(make_batch, [5, 9])
    with pytest.raises(ValueError, match="means"):
        decode(q, b.k, b.v, variant="mpfa", cu_seqlens_k=b.cu_k)
    with pytest.raises(ValueError, match="partition_size"):
        decode(q, b.k, b.v, variant="bf16", cu_seqlens_k=b.cu_k, partition_size=100, block_n=64)
    with pytest.raises(ValueError, match="sequences"):
        decode(q, b.k, b.v, variant="bf16", cu_seqlens_k=torch.tensor([0, 14]))


def test_merge_is_stable_for_large_scores(make_batch) -> None:
    """Scores of several thousand (exp2 of them overflows FP32 and float64) merge without overflow."""
    b, q = decode_inputs(make_batch, [300, 200])
    q = q * 1024  # exact in BF16
    dense = attention_float64(q, b.k, b.v, causal=True, **b.varlen)
    for variant in ("float64", "bf16"):
        parts = decode_partials(q, b.k, b.v, variant=variant, cu_seqlens_k=b.cu_k, partition_size=64, block_n=64)
        assert float(parts.m[torch.isfinite(parts.m)].abs().max()) * parts.lam > 1100
        merged = merge_partials(parts)
        assert bool(torch.isfinite(merged).all())
        torch.testing.assert_close(merged.double(), dense, rtol=0, atol=0.02)
