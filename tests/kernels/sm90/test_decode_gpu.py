"""The sm90 split-KV decode (CuTe DSL) against the reference `mpfa` decode, on the GPU.

The cache is written by the Triton KV-write kernel (bit-exact, tested in test_quantize_cache), so the kernel and
the oracle see the same NVFP4/FP8 operands; the oracle runs with the kernel's tiling (partitions of
``partition_size`` keys, 32-key tiles in reverse order), so what remains is FP32 summation order, the SFU's
exp2 (~2 ulp) and the rare e4m3 rounding flip of a P that sits on a rounding boundary. Tolerances:

* partials m, l: FP32 rounding of 128-term dot products and 32-term sums (1e-4 relative);
* outputs: RMS difference <= 1e-3 of the reference's RMS (a different tiling of the same formats already moves
  the output by ~4e-3, the NVFP4 format error vs float64 is ~1e-1 on these inputs), no element further than
  2% of the largest output, and the kernel no further from float64 than the oracle is (+1%).
Outputs and workspaces are NaN-poisoned before every launch; NaN never passes (every compared value must be
finite).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from mpfa.kernels import SmoothingMeans, attention_float64, decode_partials, merge_partials  # noqa: E402
from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache  # noqa: E402
from mpfa.kernels.smoothing import sequence_means  # noqa: E402
from mpfa.kernels.sm90.decode_launch import DecodeWorkspace, mpfa_decode  # noqa: E402
from mpfa.kernels.sm90.decode_layout import TILE_KEYS  # noqa: E402
from mpfa.kernels.sm90.quantize_cache import quantize_to_cache  # noqa: E402

HEAD_DIM = 128
UNUSED_PAGE = 1 << 30  # page-table entries past a sequence's end: reading one would fault


@dataclass
class Problem:
    query: CenteredQuery
    cache: MpfaKVCache
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    reference_inputs: dict


def _rows(gen: torch.Generator, tokens: int, heads: int, scale: float, offset_std: float) -> torch.Tensor:
    offsets = torch.zeros(HEAD_DIM)
    offsets[torch.randperm(HEAD_DIM, generator=gen)[:8]] = torch.randn(8, generator=gen) * offset_std
    return (torch.randn(tokens, heads, HEAD_DIM, generator=gen) * scale + offsets).bfloat16()


def _problem(gen: torch.Generator, lengths: list[int], num_q_heads: int, num_kv_heads: int, page_size: int) -> Problem:
    """Random requests written through the KV-write kernel into a shuffled, NaN-poisoned paged cache; the
    frozen means come from each request's first 3/4 (its "prefill"); the decode query is its last token."""
    tokens = sum(lengths)
    q, k, v = _rows(gen, tokens, num_q_heads, 1.0, 4.0), _rows(gen, tokens, num_kv_heads, 1.5, 8.0), \
        _rows(gen, tokens, num_kv_heads, 1.0, 0.0)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    prefill = [max(1, 3 * n // 4) for n in lengths]
    take = torch.cat([torch.arange(a, a + n) for a, n in zip(cu[:-1].tolist(), prefill)])
    cu_prefill = torch.tensor([0, *prefill]).cumsum(0)
    means = SmoothingMeans(sequence_means(q[take], cu_prefill).float(), sequence_means(k[take], cu_prefill).float())

    pages_per_seq = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((len(lengths), max(pages_per_seq) + 1), UNUSED_PAGE, dtype=torch.int32)
    for b, count in enumerate(pages_per_seq):
        page_table[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    request = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(tokens) - cu[:-1][request]
    slots = page_table[request, position // page_size].long() * page_size + position % page_size

    cache = MpfaKVCache.allocate(num_pages, page_size, num_q_heads, num_kv_heads, HEAD_DIM, "cuda").fill_(0xFF)
    dev_means = SmoothingMeans(means.q_mean.cuda(), means.k_mean.cuda())
    query = quantize_to_cache(q.cuda(), k.cuda(), v.cuda(), slots.cuda(), request.int().cuda(), dev_means, cache)
    last = cu[1:] - 1
    paged = {}
    for name, x in (("k", k), ("v", v)):
        pages = torch.full((num_pages * page_size, num_kv_heads, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
        pages[slots] = x
        paged[name] = pages.view(num_pages, page_size, num_kv_heads, HEAD_DIM)
    reference_inputs = dict(q=q[last], k=paged["k"], v=paged["v"], cu_seqlens_k=cu, page_table=page_table,
                            page_size=page_size, means=means)
    return Problem(CenteredQuery(query.codes[last.cuda()].contiguous(), query.scales[last.cuda()].contiguous()),
                   cache, page_table.cuda(), torch.tensor(lengths, dtype=torch.int32, device="cuda"), reference_inputs)


def _run(problem: Problem, partition_size: int, out_dtype: torch.dtype = torch.float32, **kwargs):
    batch, num_q_heads = problem.query.codes.shape[:2]
    workspace = DecodeWorkspace.allocate(batch, num_q_heads, problem.cache.num_kv_heads,
                                         int(problem.seq_lens.max()), "cuda", partition_size)
    for x in (workspace.m, workspace.l, workspace.o):
        x.fill_(float("nan"))
    out = torch.full((batch, num_q_heads, HEAD_DIM), float("nan"), dtype=out_dtype, device="cuda")
    mpfa_decode(problem.query, problem.cache, problem.page_table, problem.seq_lens, workspace, out=out, **kwargs)
    torch.cuda.synchronize()
    return workspace, out


def _rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


CASES = [  # (lengths, Hq, Hkv, page size, partition size)
    ([1, 31, 33, 200, 517], 8, 2, 1, 64),  # GQA 4, page 1 (FlashInfer's layout), many partitions, ragged tails
    ([300, 45, 1000], 10, 2, 16, 128),  # GQA 5, page 16
    ([129, 1500], 32, 8, 128, 256),  # Llama-3.1-8B heads, page 128 (SGLang's FA4 page size)
    ([77, 640], 5, 1, 16, 128),  # Qwen3-14B at tensor parallelism 8: 5 query heads, one KV head (odd Hq)
    ([300, 4097], 12, 2, 128, 256),  # Qwen2.5-1.5B (the served accuracy model): GQA 6
    ([129, 2000], 64, 8, 128, 256),  # 70B-class models: GQA 8, the kernel's largest group
]
CASE_IDS = ["gqa4-page1", "gqa5-page16", "32x8-page128", "5x1-page16", "12x2-page128", "64x8-page128"]


@pytest.mark.parametrize("lengths,num_q_heads,num_kv_heads,page_size,partition_size", CASES,
                         ids=CASE_IDS)
def test_decode_matches_reference(gen, lengths, num_q_heads, num_kv_heads, page_size, partition_size):
    problem = _problem(gen, lengths, num_q_heads, num_kv_heads, page_size)
    workspace, out = _run(problem, partition_size)
    ref = decode_partials(**problem.reference_inputs, variant="mpfa", partition_size=partition_size,
                          block_n=TILE_KEYS)

    parts = torch.tensor([-(-n // partition_size) for n in lengths])
    valid = (torch.arange(ref.m.shape[-1])[None, None, :] < parts[:, None, None]).expand_as(ref.m)
    m, l, o = workspace.m.cpu(), workspace.l.cpu(), workspace.o.cpu()
    assert bool(torch.isfinite(m[valid]).all() & torch.isfinite(l[valid]).all() & torch.isfinite(o[valid]).all())
    torch.testing.assert_close(m[valid], ref.m[valid], rtol=1e-4, atol=1e-4 * float(ref.m[valid].abs().max()))
    torch.testing.assert_close(l[valid], ref.l[valid], rtol=1e-4, atol=0.0)
    assert _rms_ratio(o[valid], ref.o[valid]) <= 1e-3

    expected = merge_partials(ref)
    exact = attention_float64(problem.reference_inputs["q"], problem.reference_inputs["k"],
                              problem.reference_inputs["v"], causal=False,
                              cu_seqlens_q=torch.arange(len(lengths) + 1), cu_seqlens_k=problem.reference_inputs[
                                  "cu_seqlens_k"], page_table=problem.reference_inputs["page_table"],
                              page_size=page_size)
    got = out.cpu()
    assert bool(torch.isfinite(got).all())
    assert _rms_ratio(got, expected) <= 1e-3
    assert float((got - expected).abs().max()) <= 0.02 * float(expected.abs().max())
    assert _rms_ratio(got, exact) <= 1.01 * _rms_ratio(expected, exact)


@pytest.mark.parametrize("page_size", [16, 128], ids=["page16", "page128"])
def test_direct_build_equals_a_zero_side_cache(gen, page_size):
    """The direct build (``compensate=False``, no Delta_S read) computes bit for bit what the compensated build
    computes once the side cache holds zeros: what separates their timings is the compensation alone."""
    problem = _problem(gen, [1, 33, 517, 1000], 10, 2, page_size)
    direct = _run(problem, 128, compensate=False)
    assert bool(torch.isfinite(direct[1]).all())
    compensated = _run(problem, 128)
    assert not torch.equal(direct[1], compensated[1])  # the side cache is not zero: Delta_S matters
    problem.cache.delta_s.zero_()
    zero_side_cache = _run(problem, 128)
    outputs = [[ws.m, ws.l, ws.o, out] for ws, out in (direct, zero_side_cache)]
    for got, expected in zip(*outputs):  # partitions a request does not use stay NaN in both
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_partitions_sized_by_each_request_length(gen):
    """Workspace for 20K keys with a 64-key floor (as CUDA-graph buffers use): each request's keys spread over all
    partitions; its partials equal the reference's with that request's partition size."""
    lengths = [100, 1000, 5000]
    problem = _problem(gen, lengths, 8, 2, 1)
    workspace = DecodeWorkspace.allocate(3, 8, 2, 20_000, "cuda", 1024, min_partition=64)
    for x in (workspace.m, workspace.l, workspace.o):
        x.fill_(float("nan"))
    out = torch.full((3, 8, HEAD_DIM), float("nan"), dtype=torch.float32, device="cuda")
    mpfa_decode(problem.query, problem.cache, problem.page_table, problem.seq_lens, workspace, out=out)
    m, l, o = workspace.m.cpu(), workspace.l.cpu(), workspace.o.cpu()
    for b, n in enumerate(lengths):
        size = workspace.partition_keys(n)
        assert size < 1024
        ref = decode_partials(**problem.reference_inputs, variant="mpfa", partition_size=size, block_n=TILE_KEYS)
        used = -(-n // size)
        assert bool(torch.isfinite(m[b, :, :used]).all() & torch.isfinite(o[b, :, :used]).all())
        torch.testing.assert_close(m[b, :, :used], ref.m[b, :, :used], rtol=1e-4,
                                   atol=1e-4 * float(ref.m[b].abs().max()))
        torch.testing.assert_close(l[b, :, :used], ref.l[b, :, :used], rtol=1e-4, atol=0.0)
        assert _rms_ratio(o[b, :, :used], ref.o[b, :, :used]) <= 1e-3
        assert _rms_ratio(out[b].cpu(), merge_partials(ref)[b]) <= 1e-3


@pytest.mark.parametrize("lengths,num_q_heads,num_kv_heads,page_size,warps_per_sm",
                         [([700, 5], 8, 2, 1, None), ([8000], 40, 8, 128, 3)], ids=["default", "40x8-3-warps-per-sm"])
def test_bf16_output_and_chosen_partitions(gen, lengths, num_q_heads, num_kv_heads, page_size, warps_per_sm):
    """The workspace's own partitions: the default's, or aimed at 3 warps per SM (at 8K x 1 on 132 SMs: 42
    partitions of 192 keys, 63 of 128 by default)."""
    problem = _problem(gen, lengths, num_q_heads, num_kv_heads, page_size)
    batch, heads = problem.query.codes.shape[:2]
    workspace = DecodeWorkspace.allocate(batch, heads, num_kv_heads, max(lengths), "cuda", warps_per_sm=warps_per_sm)
    out = mpfa_decode(problem.query, problem.cache, problem.page_table, problem.seq_lens, workspace)
    assert out.dtype == torch.bfloat16
    expected = decode_partials(**problem.reference_inputs, variant="mpfa", partition_size=workspace.partition_size,
                               block_n=TILE_KEYS)
    assert bool(torch.isfinite(out).all())
    assert _rms_ratio(out.float().cpu(), merge_partials(expected)) <= 4e-3  # + BF16 output rounding (2**-9)


@pytest.mark.parametrize("page_size", [1, 128], ids=["page1", "page128"])
def test_cuda_graph_replay_equals_eager(gen, page_size):
    problem = _problem(gen, [900, 300, 64], 8, 2, page_size)
    batch, heads = problem.query.codes.shape[:2]
    workspace = DecodeWorkspace.allocate(batch, heads, 2, 1024, "cuda", 128)
    out = torch.empty((batch, heads, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    mpfa_decode(problem.query, problem.cache, problem.page_table, problem.seq_lens, workspace, out=out)  # compile
    eager = out.clone()
    shorter = torch.tensor([512, 1, 64], dtype=torch.int32, device="cuda")
    mpfa_decode(problem.query, problem.cache, problem.page_table, shorter, workspace, out=out)
    eager_shorter = out.clone()

    seq_lens = problem.seq_lens.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mpfa_decode(problem.query, problem.cache, problem.page_table, seq_lens, workspace, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    seq_lens.copy_(shorter)  # new lengths on the device, no re-capture
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_shorter)


def test_bad_inputs_raise_clear_errors(gen):
    problem = _problem(gen, [40], 8, 2, 1)
    workspace = DecodeWorkspace.allocate(1, 8, 2, 64, "cuda", 32)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        mpfa_decode(problem.query, problem.cache, problem.page_table, problem.seq_lens.long(), workspace)
    with pytest.raises(ValueError, match="partition_size must be a positive multiple of 32"):
        DecodeWorkspace.allocate(1, 8, 2, 64, "cuda", 48)
    with pytest.raises(ValueError, match="workspace is for"):
        mpfa_decode(problem.query, problem.cache, problem.page_table, problem.seq_lens,
                    DecodeWorkspace.allocate(2, 8, 2, 64, "cuda", 32))

