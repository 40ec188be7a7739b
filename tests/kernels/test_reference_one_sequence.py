"""`attention_one_sequence` (every KV tile at once, for the task runner) against the tiled reference and float64."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import VARIANTS, SmoothingMeans, attention, attention_float64, sequence_means
from mpfa.kernels.reference import attention_one_sequence

# Same operands and running maxima as the tiled form; only the rescaled sums are rounded differently (a few FP32
# roundings per tile). 2**-18 of max|O| leaves room for that and fails on any real formula difference (those move
# outputs by >= 2**-9 relative: one FP8 / BF16 rounding of P).
TOLERANCE = 2.0**-18


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "float64"])
@pytest.mark.parametrize("q_len, k_len, hq, hkv, block_n", [
    (300, 300, 12, 2, 128),  # prefill, 3 tiles, last one partial
    (1, 300, 12, 2, 128),    # one decode step
    (3, 129, 4, 1, 64),      # a continuation scored on a cache
    (5, 5, 8, 8, 16),        # shorter than one tile
])
def test_matches_the_tiled_reference(make_batch, variant, q_len, k_len, hq, hkv, block_n) -> None:
    b = make_batch([q_len], [k_len], hq, hkv, 128, q_offset=3.0, k_offset=6.0)
    means = None
    if VARIANTS[variant].smoothing:  # frozen means of a longer prompt, as in a decode step
        one = torch.tensor([0, k_len])
        means = SmoothingMeans(sequence_means(b.q[:1].expand(k_len, -1, -1).contiguous(), one) + 0.25,
                               sequence_means(b.k, one))
    tiled = attention(b.q, b.k, b.v, variant=variant, causal=True, block_n=block_n, means=means)
    fast = attention_one_sequence(b.q, b.k, b.v, variant=variant, block_n=block_n, means=means)
    assert fast.dtype == tiled.dtype == torch.float32 and fast.shape == b.q.shape
    assert bool(torch.isfinite(fast).all())
    assert float((fast - tiled).abs().max()) <= TOLERANCE * float(tiled.abs().max())


def test_bf16_is_close_to_float64_and_rows_without_keys_are_zero(make_batch) -> None:
    b = make_batch([40], [24], 8, 2, 128)  # causal, q longer than kv: the first 16 rows see no key
    fast = attention_one_sequence(b.q, b.k, b.v, variant="bf16", block_n=16)
    ref = attention_float64(b.q, b.k, b.v, causal=True)
    assert bool((fast[:16] == 0).all()) and bool((fast[16:].abs().sum((1, 2)) > 0).all())
    assert float((fast.double() - ref).abs().max()) < 2.0**-7 * float(ref.abs().max())


def test_float64_variant_is_the_dense_reference(make_batch) -> None:
    b = make_batch([20], [20], 4, 2, 64)
    assert torch.equal(attention_one_sequence(b.q, b.k, b.v, variant="float64"),
                       attention_float64(b.q, b.k, b.v, causal=True))


def test_nan_input_is_rejected(make_batch) -> None:
    b = make_batch([4], [4], 4, 2, 64)
    k = b.k.clone()
    k[2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        attention_one_sequence(b.q, k, b.v, variant="mpfa")
