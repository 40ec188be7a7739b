"""The fused quantize + paged-cache write (Triton) against the reference formats: codes, scales, FP8 V and the
centered Q bit for bit, Delta_S to one BF16 ulp, each at its place in the cache layout (K codes and V at [slot,
KV head], K scales and Delta_S head-major at [KV head, slot], Delta_S padding untouched); K's "4/6" block scales
(``k_scale_choice``) and FP32 Q/K inputs (the rotated ones of ``MPFA_NUMERICS=had128-k46``) the same way; and the
smoothing-means reduction against float64.

Runs on the GPU when there is one, else in Triton's CPU interpreter (see conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mpfa.kernels import SmoothingMeans, center, delta_s, quantize_fp8, quantize_nvfp4  # noqa: E402
from mpfa.kernels.cache_layout import MpfaKVCache  # noqa: E402
from mpfa.kernels.rotation import GemmRotation  # noqa: E402
from mpfa.kernels.smoothing import sequence_means as reference_means  # noqa: E402
from mpfa.kernels.sm90.quantize_cache import quantize_to_cache  # noqa: E402
from mpfa.kernels.sm90.sequence_means import sequence_means  # noqa: E402

HEAD_DIM = 128
POISON = 0xFF  # NaN in e4m3 and BF16


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def _random_rows(gen: torch.Generator, tokens: int, heads: int, scale: float, offset_std: float) -> torch.Tensor:
    """Gaussian rows plus fixed per-channel offsets on 8 channels (the outliers real Q/K carry)."""
    offsets = torch.zeros(HEAD_DIM)
    offsets[torch.randperm(HEAD_DIM, generator=gen)[:8]] = torch.randn(8, generator=gen) * offset_std
    return (torch.randn(tokens, heads, HEAD_DIM, generator=gen) * scale + offsets).bfloat16()


def _write(q, k, v, lengths, slots, means, num_q_heads, num_kv_heads, device, num_pages=8, page_size=16,
           k_scale_choice="6"):
    cache = MpfaKVCache.allocate(num_pages, page_size, num_q_heads, num_kv_heads, HEAD_DIM, device).fill_(POISON)
    request = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    dev_means = SmoothingMeans(means.q_mean.to(device), means.k_mean.to(device))
    query = quantize_to_cache(q.to(device), k.to(device), v.to(device), slots.to(device), request.to(device),
                              dev_means, cache, k_scale_choice=k_scale_choice)
    return cache, query


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.uint8)


def _head_major(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a head-major cache array [Hkv, slots, row], token-major: [T, Hkv, row] (indexed here
    rather than through `MpfaKVCache.token_scales` so that the test pins the layout)."""
    return x.cpu()[:, slots].transpose(0, 1)


def _assert_written_exactly(cache, query, q, k, v, slots, means, cu, k_scale_choice="6"):
    k_ref = quantize_nvfp4(center(k.float(), means.k_mean, cu), scale_choice=k_scale_choice)
    q_ref = quantize_nvfp4(center(q.float(), means.q_mean, cu))
    assert torch.equal(cache.k_codes.cpu()[slots], k_ref.codes)
    assert torch.equal(_head_major(cache.k_scales.view(torch.uint8), slots), _bits(k_ref.scales))
    assert torch.equal(cache.token_scales(slots.to(cache.k_scales.device)).cpu().view(torch.uint8),
                       _bits(k_ref.scales))
    assert torch.equal(_bits(cache.v)[slots], _bits(quantize_fp8(v)))
    assert torch.equal(query.codes.cpu(), q_ref.codes)
    assert torch.equal(_bits(query.scales), _bits(q_ref.scales))


@pytest.mark.parametrize("means_dtype", [torch.bfloat16, torch.float32], ids=["bf16-means", "fp32-means"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (10, 2)], ids=["gqa4", "gqa5"])
def test_cache_write_is_bit_exact(device, gen, num_q_heads, num_kv_heads, means_dtype):
    """BF16 means (as the SGLang plugin stores them) are widened exactly: the formats of ``bf16(x) - mean``."""
    lengths = [5, 1, 9]
    tokens = sum(lengths)
    q = _random_rows(gen, tokens, num_q_heads, 1.0, 4.0)
    k = _random_rows(gen, tokens, num_kv_heads, 1.5, 8.0)
    v = _random_rows(gen, tokens, num_kv_heads, 1.0, 0.0)
    cu = _cumulative(lengths)
    means = SmoothingMeans(reference_means(q, cu).to(means_dtype), reference_means(k, cu).to(means_dtype))
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    cache, query = _write(q, k, v, lengths, slots, means, num_q_heads, num_kv_heads, device)

    _assert_written_exactly(cache, query, q, k, v, slots, means, cu)
    group = num_q_heads // num_kv_heads
    assert cache.delta_s.shape == (num_kv_heads, cache.num_slots, 4 if group == 4 else 8)
    ds_ref = delta_s(means.q_mean, center(k.float(), means.k_mean, cu), cu)  # [T, Hq], head h = group * kv + i
    rows = _head_major(cache.delta_s, slots)  # [T, Hkv, row]
    ds = rows[:, :, :group].reshape(tokens, num_q_heads)
    assert torch.equal(cache.token_delta_s(slots.to(cache.delta_s.device)).cpu(), ds)
    ulp = torch.finfo(torch.bfloat16).eps * ds_ref.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert bool(((ds.float() - ds_ref.float()).abs() <= ulp).all()), "Delta_S differs by more than one BF16 ulp"
    assert (ds == ds_ref).float().mean() > 0.99, "Delta_S should almost always round like the reference"
    assert bool((rows[:, :, group:].view(torch.uint8) == POISON).all()), "the Delta_S padding was written"
    untouched = torch.ones(cache.num_slots, dtype=torch.bool)
    untouched[slots] = False
    for field in (cache.k_codes, cache.v):
        assert bool((_bits(field)[untouched] == POISON).all()), "a slot that was not written changed"
    for field in (cache.k_scales, cache.delta_s):
        assert bool((_bits(field)[:, untouched] == POISON).all()), "a slot that was not written changed"


def _edge_blocks() -> torch.Tensor:
    """One row whose 8 blocks hit the rounding edges: e2m1 ties, subnormal/flushed/tied/large/saturated scales."""
    midpoints = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    blocks = [
        midpoints,  # scale 1: every element on an e2m1 midpoint (ties to the even code), -0.0 keeps its sign
        [x * 2.0**-8 for x in midpoints],  # scale 2**-8: an e4m3 subnormal
        [x * 2.0**-11 for x in midpoints],  # scale 2**-11 < 2**-10: flushed to zero
        [x * 2.0**-10 for x in midpoints],  # scale exactly 2**-10: the tie rounds to 0, flushed
        [6.375] + [1.0] * 15,  # scale 1.0625: halfway between 1 and 1.125, rounds to even (1.0)
        [2688.0, -1000.0] + [3.0] * 14,  # scale 448: the largest e4m3
        [2752.0] + [-7.0] * 15,  # scale 458.7: in (448, 464], rounds to 448, elements saturate at 6
        [0.0] * 16,  # all zero
    ]
    return torch.tensor(blocks, dtype=torch.float32).flatten()


def test_cache_write_rounding_edges(device):
    row = _edge_blocks()
    q = torch.stack([row, -row]).view(1, 2, HEAD_DIM).bfloat16()
    k = row.view(1, 1, HEAD_DIM).bfloat16()
    v = torch.tensor([448.0, -448.0, 500.0, -1e4, 2.0**-9, 2.0**-10, 3 * 2.0**-11, -0.0] * 16).view(1, 1, HEAD_DIM)
    v = v.bfloat16()
    assert torch.equal(q.float().view(2, -1)[0], row), "the edge values must be exact in BF16"
    means = SmoothingMeans(torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 1, HEAD_DIM))
    slots = torch.tensor([3])
    cache, query = _write(q, k, v, [1], slots, means, 2, 1, device)
    _assert_written_exactly(cache, query, q, k, v, slots, means, _cumulative([1]))


def _four_wins(k: torch.Tensor, means: SmoothingMeans, cu: torch.Tensor) -> torch.Tensor:
    """Per K block: whether the "4/6" choice took the scale e4m3(amax / 4) that differs from amax / 6's."""
    centered = center(k.float(), means.k_mean, cu)
    chosen = quantize_nvfp4(centered, scale_choice="4/6").scales.view(torch.uint8)
    return chosen != quantize_nvfp4(centered).scales.view(torch.uint8)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (10, 2)], ids=["gqa4", "gqa5"])
def test_k46_scales_and_fp32_rotated_inputs_are_bit_exact(device, gen, num_q_heads, num_kv_heads):
    """``MPFA_NUMERICS=had128-k46``'s write: Q and K rotated in FP32 (not rounded back to BF16), BF16 means of the
    rotated values, K's block scales chosen 4/6 (both choices occur on these blocks), Q's kept at 6."""
    lengths = [7, 1, 12]
    tokens, cu = sum(lengths), _cumulative(lengths)
    rotate = GemmRotation(HEAD_DIM)
    q = rotate(_random_rows(gen, tokens, num_q_heads, 1.0, 4.0))
    k = rotate(_random_rows(gen, tokens, num_kv_heads, 1.5, 8.0))
    v = _random_rows(gen, tokens, num_kv_heads, 1.0, 0.0)
    assert q.dtype == k.dtype == torch.float32 and not torch.equal(k, k.bfloat16().float())
    means = SmoothingMeans(reference_means(q, cu).bfloat16(), reference_means(k, cu).bfloat16())
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    cache, query = _write(q, k, v, lengths, slots, means, num_q_heads, num_kv_heads, device, k_scale_choice="4/6")
    _assert_written_exactly(cache, query, q, k, v, slots, means, cu, k_scale_choice="4/6")
    assert 0.1 < float(_four_wins(k, means, cu).float().mean()) < 0.9


def _k46_edge_blocks() -> list[tuple[list[float], str]]:
    """K blocks at the edges of the 4/6 choice, each with the scale target it must take."""
    return [
        ([4.0, 3.0, -1.5], "4"),  # amax / 6 rounds to 0.6875, which misses 4, 3, 1.5; amax / 4 = 1 is exact
        ([6.0, 1.0], "6"),  # scale 1 is exact; 1.5 would round 1 to 0.75
        ([6.0, 3.0, -1.5], "6"),  # a tie: both exact (scales 1 and 1.5), the standard scale stays
        ([0.0], "6"),  # all zero: scale 0 either way
        ([1800.0], "4"),  # amax / 4 = 450 in (448, 464]: saturates at 448, still fits, and errs 8 against 72
        ([2560.0, 1792.0], "6"),  # amax / 4 = 640 > 464: never taken, though 448 would err less (16384 < 20480)
        ([2752.0, -7.0], "6"),  # amax / 6 in (448, 464]: the standard scale saturates at 448
        ([4 * 2.0**-8, 3 * 2.0**-8, -1.5 * 2.0**-8], "4"),  # e4m3 subnormal scales: 2**-8 exact, amax / 6 is not
        ([5 * 2.0**-10], "4"),  # amax / 6 flushes to 0 (error 5 * 2**-10); amax / 4 rounds to 2**-9 (error 2**-10)
    ]


def test_k46_choice_at_its_edges(device, gen):
    edges = _k46_edge_blocks()
    blocks = torch.zeros(16, 16)  # two tokens of one KV head: 16 blocks, the edge ones, then Gaussian ones
    for i, (values, _) in enumerate(edges):
        blocks[i, : len(values)] = torch.tensor(values)
    blocks[len(edges):] = torch.randn(16 - len(edges), 16, generator=gen) * 3
    k = blocks.view(2, 1, HEAD_DIM).bfloat16()
    assert torch.equal(k.float().view(16, 16)[: len(edges)], blocks[: len(edges)]), "edges must be exact in BF16"
    means = SmoothingMeans(torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 1, HEAD_DIM))
    cu = _cumulative([2])
    amax = blocks[: len(edges)].abs().amax(-1)
    for target in ("4", "6"):  # each edge block takes the scale its target names
        rows = [i for i, (_, t) in enumerate(edges) if t == target]
        expected = (amax[rows] / float(target)).clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
        chosen = quantize_nvfp4(blocks[rows], scale_choice="4/6").scales.view(torch.uint8).flatten()
        assert torch.equal(chosen, expected), f"edge blocks {rows} do not take scale amax / {target}"
    q = _random_rows(gen, 2, 2, 1.0, 4.0)
    v = _random_rows(gen, 2, 1, 1.0, 0.0)
    slots = torch.tensor([3, 17])
    cache, query = _write(q, k, v, [2], slots, means, 2, 1, device, k_scale_choice="4/6")
    _assert_written_exactly(cache, query, q, k, v, slots, means, cu, k_scale_choice="4/6")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-rotated"])
def test_sequence_means_match_float64(device, gen, dtype):
    lengths = [40, 0, 3, 70, 1000]  # 1000: 16 slices of 64 tokens, the last one partial
    x = _random_rows(gen, sum(lengths), 3, 2.0, 20.0)
    if dtype == torch.float32:  # the rotated Q and K of MPFA_NUMERICS=had128-k46
        x = GemmRotation(HEAD_DIM)(x)
    cu = _cumulative(lengths)
    means = sequence_means(x.to(device), cu.to(device, torch.int32)).cpu()
    expected = reference_means(x.double(), cu)
    assert torch.equal(means[1], torch.zeros_like(means[1])), "an empty sequence has a zero mean"
    torch.testing.assert_close(means.double(), expected, rtol=1e-6, atol=1e-6 * float(x.float().abs().max()))


def test_bad_inputs_raise_clear_errors(device):
    cache = MpfaKVCache.allocate(2, 16, 8, 2, HEAD_DIM, device)
    q = torch.zeros(3, 8, HEAD_DIM, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(3, 2, HEAD_DIM, dtype=torch.bfloat16, device=device)
    slots = torch.arange(3, device=device)
    request = torch.zeros(3, dtype=torch.int32, device=device)
    means = SmoothingMeans(torch.zeros(1, 8, HEAD_DIM, device=device), torch.zeros(1, 2, HEAD_DIM, device=device))
    with pytest.raises(ValueError, match="k must be BF16 or FP32"):
        quantize_to_cache(q, kv.half(), kv, slots, request, means, cache)
    with pytest.raises(ValueError, match="v must be BF16 "):
        quantize_to_cache(q, kv, kv.float(), slots, request, means, cache)
    with pytest.raises(ValueError, match="k_scale_choice must be one of 6, 4/6"):
        quantize_to_cache(q, kv, kv, slots, request, means, cache, k_scale_choice="4")
    with pytest.raises(ValueError, match="slots and request_index"):
        quantize_to_cache(q, kv, kv, slots[:2], request, means, cache)
    with pytest.raises(ValueError, match="k_mean must be contiguous BF16 or FP32"):
        quantize_to_cache(q, kv, kv, slots, request, SmoothingMeans(means.q_mean, means.k_mean[:, :1]), cache)
    with pytest.raises(ValueError, match="head_dim"):
        MpfaKVCache.allocate(2, 16, 8, 2, 64, device)
    with pytest.raises(ValueError, match="power-of-two page_size"):
        MpfaKVCache.allocate(2, 12, 8, 2, HEAD_DIM, device)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,row", [(8, 8, 4), (8, 2, 4), (10, 2, 8), (5, 1, 8), (16, 2, 8)])
def test_cache_layout_is_head_major_with_padded_delta_s_rows(num_q_heads, num_kv_heads, row):
    """K scales [Hkv, slots, 8] and Delta_S [Hkv, slots, group rounded up to 4] (8- or 16-byte rows); the bytes
    per token count the padding; a token-major (old-layout) array is refused."""
    cache = MpfaKVCache.allocate(3, 16, num_q_heads, num_kv_heads, HEAD_DIM, "cpu")
    assert cache.k_scales.shape == (num_kv_heads, 48, 8) and cache.delta_s.shape == (num_kv_heads, 48, row)
    assert cache.num_q_heads == num_q_heads and cache.group == num_q_heads // num_kv_heads
    assert cache.bytes_per_token() == num_kv_heads * (64 + 8 + 128 + 2 * row)
    old_scales = cache.k_scales.transpose(0, 1).contiguous()
    with pytest.raises(ValueError, match=r"k_scales must be \[%d, 48, 8\]" % num_kv_heads):
        type(cache)(cache.k_codes, old_scales, cache.v, cache.delta_s, cache.page_size, cache.group)
    old_delta_s = torch.empty((48, num_q_heads), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="delta_s must be"):
        type(cache)(cache.k_codes, cache.k_scales, cache.v, old_delta_s, cache.page_size, cache.group)
