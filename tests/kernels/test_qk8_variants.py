"""`mpfa-qk8row` / `mpfa-qk8tile`: NVFP4 Q/K requantized to e4m3 with power-of-two scales (an FP8 QK^T MMA) per row,
or for K per KV tile, through every form of the reference (tiled, all tiles at once, padded batch, split-KV decode);
`mpfa-qk8tile-psum`: l sums the FP8 P (a kernel's row sums on its PV MMA)."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import SmoothingMeans, attention, attention_float64, decode_partials, merge_partials, sequence_means
from mpfa.kernels.reference import (_requantize_key_tiles, attend_prepared, attend_prepared_batch,
                                    attention_one_sequence, prepare_one_sequence)

QK8 = ("mpfa-qk8row", "mpfa-qk8tile")
OUTLIER_KEY, OUTLIER_CHANNEL, OUTLIER = 40, 3, 2688.0  # 6 * 448: the largest NVFP4 value without a global scale


def with_outlier_key(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys 32-63 of KV head 0 scaled by 2**-4 and key OUTLIER_KEY among them given OUTLIER on a channel no query
    reads: at that tile's scale (8) the keys' NVFP4 values below 2**-3 are e4m3 subnormals (steps of 2**-6), while at
    their rows' scales they are normal; the scores stay moderate."""
    q, k = q.clone(), k.clone()
    q[..., OUTLIER_CHANNEL] = 0
    k[32:64, 0] *= 2.0**-4
    k[OUTLIER_KEY, 0, OUTLIER_CHANNEL] = OUTLIER
    return q, k


def test_error_vs_float64_with_channel_outliers(make_batch) -> None:
    """On the inputs of the variant-ordering test the requantized variants stay finite, add at most 10% to mpfa's
    error (one e4m3 rounding of the NVFP4 values: their significands need up to 6 bits, e4m3 keeps 4) and stay
    below the unsmoothed qk4-pv8-direct. Measured: ~2-3% above mpfa, per tile as per row."""
    b = make_batch([192, 64], [192, 128], 8, 2, 128, q_offset=1.0, k_offset=6.0)
    ref = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)
    errors = {}
    for variant in ("fp8", "mpfa", *QK8, "qk4-pv8-direct"):
        out = attention(b.q, b.k, b.v, variant=variant, causal=True, block_n=64, **b.varlen)
        assert bool(torch.isfinite(out).all()), variant
        errors[variant] = float((out.double() - ref).norm() / ref.norm())
    for variant in QK8:
        assert errors["fp8"] < errors[variant] < min(1.1 * errors["mpfa"], errors["qk4-pv8-direct"]), errors


@pytest.mark.parametrize("variant", QK8)
def test_decode_matches_prefill_attention_with_frozen_means(make_batch, variant: str) -> None:
    """Split-KV decode of one-token queries with frozen means equals the tiled attention (one partition: only the
    merge's rescaling differs; the K tiles and their scales are the same)."""
    prefill = make_batch([40, 70], [40, 70], 8, 2, 64, q_offset=2.0, k_offset=4.0)
    means = SmoothingMeans(sequence_means(prefill.q, prefill.cu_q), sequence_means(prefill.k, prefill.cu_k))
    b = make_batch([1, 1], [41, 200], 8, 2, 64, q_offset=2.0, k_offset=4.0)
    parts = decode_partials(b.q, b.k, b.v, variant=variant, cu_seqlens_k=b.cu_k, means=means, partition_size=256,
                            block_n=32)
    tiled = attention(b.q, b.k, b.v, variant=variant, causal=True, means=means, block_n=32, **b.varlen)
    assert bool(torch.isfinite(parts.o).all())
    torch.testing.assert_close(merge_partials(parts), tiled, rtol=1e-5, atol=1e-6)


def test_k_tile_scales_follow_the_tiles(make_batch) -> None:
    """With one partition per 32-key tile, only the partition holding the outlier key (tile 1 of request 0, KV head
    0's query heads) differs from per-row scaling; elsewhere the partials are bit-identical (a power-of-two scale
    does not change the e4m3 rounding of normal values, and no tile spans e4m3's normal range)."""
    b = make_batch([1, 1], [150, 97], 8, 2, 64)
    q, k = with_outlier_key(b.q, b.k)
    means = SmoothingMeans(torch.zeros(2, 8, 64), torch.zeros(2, 2, 64))  # no centering: K's values as made
    row, tile = (decode_partials(q, k, b.v, variant=v, cu_seqlens_k=b.cu_k, means=means, partition_size=32,
                                 block_n=32) for v in QK8)
    differs = (row.o != tile.o).any(-1) | (row.l != tile.l) | (row.m != tile.m)  # [batch, Hq, partitions]
    expected = torch.zeros_like(differs)
    expected[0, :4, OUTLIER_KEY // 32] = True
    assert torch.equal(differs, expected)


@pytest.mark.parametrize("variant", ["mpfa-qk8tile", "mpfa-qk8tile-psum"])
@pytest.mark.parametrize("block_n", [32, 64])
def test_all_tiles_at_once_agree_with_the_tiled_loop(make_batch, block_n: int, variant: str) -> None:
    """The all-tiles-at-once form tiles K like the loop (the outlier's tile differs from per-row scaling) and sums l
    as the variant says."""
    b = make_batch([150], [150], 8, 2, 128, q_offset=3.0, k_offset=6.0)
    q, k = with_outlier_key(b.q, b.k)
    tiled = attention(q, k, b.v, variant=variant, causal=True, block_n=block_n)
    fast = attention_one_sequence(q, k, b.v, variant=variant, block_n=block_n)
    assert float((fast - tiled).abs().max()) <= 2.0**-18 * float(tiled.abs().max())
    assert not torch.equal(fast, attention_one_sequence(q, k, b.v, variant="mpfa-qk8row", block_n=block_n))


def test_psum_output_is_a_weighted_mean_of_v(make_batch) -> None:
    """With l summing the FP8 P that weights V, every row's output on V = 1 is 1 (to FP32 rounding) in the tiled and
    the batched forms and in split-KV decode; with l summing the FP32 P (mpfa-qk8tile) it is sum e4m3(P) / sum P,
    off by the FP8 roundings of P (~1e-3)."""
    b = make_batch([60, 1], [200, 90], 8, 2, 64)
    ones = torch.ones_like(b.v)
    for form in (lambda v: attention(b.q, b.k, ones, variant=v, causal=True, block_n=64, **b.varlen),
                 lambda v: attention_one_sequence(b.q[:60], b.k[:200], ones[:200], variant=v, block_n=64)):
        psum, fp32_sums = form("mpfa-qk8tile-psum"), form("mpfa-qk8tile")
        assert float((psum - 1).abs().max()) < 1e-6
        assert float((fp32_sums - 1).abs().max()) > 1e-4
    means = SmoothingMeans(torch.zeros(2, 8, 64), torch.zeros(2, 2, 64))
    parts = decode_partials(b.q[[59, 60]], b.k, ones, variant="mpfa-qk8tile-psum", cu_seqlens_k=b.cu_k, means=means,
                            partition_size=64, block_n=32)
    assert float((merge_partials(parts) - 1).abs().max()) < 1e-6


def _gpu_test_inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [tokens, 32, 128], k, v [tokens, 8, 128] as the prefill kernels' GPU tests draw them (seed 0): Gaussian rows
    plus a fixed offset on 8 random channels per tensor (`test_prefill_gpu._rows`)."""
    gen = torch.Generator().manual_seed(0)

    def rows(heads: int, scale: float, offset_std: float) -> torch.Tensor:
        offsets = torch.zeros(128)
        offsets[torch.randperm(128, generator=gen)[:8]] = torch.randn(8, generator=gen) * offset_std
        return (torch.randn(tokens, heads, 128, generator=gen) * scale + offsets).bfloat16()

    return rows(32, 1.0, 4.0), rows(8, 1.5, 8.0), rows(8, 1.0, 0.5)


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative rms distance of ``a`` from ``b``."""
    return float(((a - b).double().pow(2).mean() / b.double().pow(2).mean()).sqrt())


@pytest.mark.parametrize("q_lens,kv_lens,causal", [([1, 77, 300], [1, 77, 420], True),
                                                   ([95, 33, 47], [130, 33, 47], False)])
def test_psum_moves_o_by_the_fp8_roundings_of_p(q_lens, kv_lens, causal) -> None:
    """On the inputs of the prefill kernels' GPU tests (Gaussian rows with channel offsets), l summing the e4m3 P
    moves O by 3e-3 to 7e-3 rms and under 2.5% of max |O| from l summing the FP32 P: the tolerance a kernel whose l
    sums the e4m3 P (the fp8 prefill kernel's) needs against one summing the FP32 P."""
    q, k, v = _gpu_test_inputs(sum(kv_lens))
    cu_k, cu_q = torch.tensor([0, *kv_lens]).cumsum(0), torch.tensor([0, *q_lens]).cumsum(0)
    queries = torch.cat([torch.arange(end - n, end) for end, n in zip(cu_k[1:].tolist(), q_lens)])
    run = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, block_n=64)
    fp32_sums = attention(q[queries], k, v, variant="mpfa-qk8tile", **run)
    psum = attention(q[queries], k, v, variant="mpfa-qk8tile-psum", **run)
    assert 3e-3 < _rms(psum, fp32_sums) < 7e-3
    assert float((psum - fp32_sums).abs().max()) < 0.025 * float(fp32_sums.abs().max())


def test_128_key_softmax_tiles_with_64_key_k_scales() -> None:
    """The fp8 prefill kernel requantizes K per 64-key tile but updates the softmax (P's maxima) per 128-key tile
    (its ``softmax_keys`` in `dispatch.PREFILL_KERNELS`); its GPU tests' oracle is the reference with block_n 128
    (K per 128 keys too). On those tests' inputs the two K requantizations give the same operands (K per 64 keys,
    then the attention with its K taken as prepared, is the block_n-128 oracle to 1e-6), while P's maxima per 64 keys
    (block_n 64) move O by ~3-6e-3 rms: the oracle must follow the softmax tiles, not the K scales."""
    q, k, v = _gpu_test_inputs(420)
    ops = prepare_one_sequence(q[120:], k, v, variant="mpfa-qk8tile")
    oracle = attend_prepared(ops.q, ops.k, ops.v, ops.delta_s, variant="mpfa-qk8tile", block_n=128)
    k_per_64 = _requantize_key_tiles(ops.k[None], 64, None)[0]
    kernel = attend_prepared(ops.q, k_per_64, ops.v, ops.delta_s, variant="mpfa-qk8row", block_n=128)  # K as given
    tiles_64 = attend_prepared(ops.q, ops.k, ops.v, ops.delta_s, variant="mpfa-qk8tile", block_n=64)
    assert _rms(kernel, oracle) < 1e-6
    assert 2e-3 < _rms(tiles_64, oracle) < 1e-2


def test_padding_keys_stay_out_of_the_tile_scales(make_batch) -> None:
    """A padded row's keys past its length (here prepared operands of 6 * 448, as the compacted slots of a batch
    may hold) do not enter its last tile's scales: small keys (2**-4 of the usual) would become e4m3 subnormals."""
    b = make_batch([5], [40], 8, 2, 64)
    variant = "mpfa-qk8tile"
    ops = prepare_one_sequence(b.q, (b.k.float() * 2.0**-4).bfloat16(), b.v, variant=variant)
    garbage = torch.full((24, 2, 64), 2688.0)
    k_op, v_op = torch.cat([ops.k, garbage]), torch.cat([ops.v, garbage])
    ds = torch.cat([ops.delta_s, torch.zeros(24, 8)])
    batch = attend_prepared_batch(ops.q[None], k_op[None], v_op[None], ds[None], variant=variant, block_n=64,
                                  key_lengths=torch.tensor([40]), exact_sums=True)[0]
    alone = attend_prepared(ops.q, ops.k, ops.v, ops.delta_s, variant=variant, block_n=64, exact_sums=True)
    assert torch.equal(batch, alone)
