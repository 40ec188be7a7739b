"""The sm90 MpFA prefill (CuTe DSL) against the reference attention of each kernel's numerics, on the GPU: the
inputs, runners and checks the kernels' GPU tests share (`siblings.load`), and the tests of all three kernels.

Fresh random BF16 Q/K/V with a per-channel offset (so centering and Delta_S matter) are written by the Triton
KV-write kernel (bit-exact, tested in test_quantize_cache) into a NaN-poisoned paged cache behind a shuffled page
table whose unused entries point far outside the cache; the queries of each sequence are its last ``q_len``
tokens (chunked prefill when ``q_len < kv_len``). The oracle is `reference.attention` with the kernel's numerics
(`dispatch.PREFILL_KERNELS`: its ``numerics``) and softmax tiles (its ``softmax_keys``: keys walked in reverse; a kernel skips
tiles its rows cannot see, which is bit-identical to the reference's masking), so what remains is FP32 summation
order, the SFU's exp2 (~2 ulp), the rare e4m3 flip of a P on a rounding boundary and a one-ulp BF16 difference of
Delta_S (the Triton kernel sums in another order); for the fp8 kernel also Hopper's FP8 wgmma, which sums a k-step's
products with ~14 bits aligned to the largest addend instead of FP32 (measured 1.5-2.3e-3 rms from its oracle for QK
alone). Tolerances (`BOUNDS`): the mma-sync and exact kernels within 1e-3 rms of the oracle's RMS (a different
tiling of the same formats already moves the output by ~4e-3; the NVFP4 format error against float64 is ~1e-1 on
these inputs) and 2% of the largest output; the fp8 kernel within 7e-3 and 7% (2x its measured accumulation error,
plus PV's); every kernel no further from float64 than its oracle is (+1%). The output is NaN-poisoned before the
launch and every compared value must be finite, so NaN never passes. The direct build of each kernel
(``compensate=False``, no Delta_S) must equal, bit for bit, the compensated build on an all-zero Delta_S.

    pytest -q -m gpu tests/kernels/sm90 -k prefill
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from mpfa.kernels import SmoothingMeans, attention, attention_float64  # noqa: E402
from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache  # noqa: E402
from mpfa.kernels.smoothing import sequence_means  # noqa: E402
from mpfa.kernels.sm90.dispatch import PREFILL_KERNEL_ENV, PREFILL_KERNELS  # noqa: E402
from mpfa.kernels.sm90.dispatch import prefill_kernel  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import mpfa_prefill  # noqa: E402
from mpfa.kernels.sm90.quantize_cache import quantize_to_cache  # noqa: E402

HEAD_DIM = 128
UNUSED_PAGE = 1 << 30  # page-table entries past a sequence's end: reading one would fault
BOUNDS = {"fp8": (7e-3, 0.07), "exact": (1e-3, 0.02), "mma-sync": (1e-3, 0.02)}  # (rms, max |diff| / max |O|)
BF16_SLACK = 3e-3  # the BF16 output's rounding (2**-9) on top of the rms bound


@dataclass
class Problem:
    query: CenteredQuery
    cache: MpfaKVCache
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    reference_inputs: dict


def _rows(gen: torch.Generator, tokens: int, heads: int, scale: float, offset_std: float) -> torch.Tensor:
    """Gaussian rows plus a fixed offset on 8 random channels (what makes centering matter)."""
    offsets = torch.zeros(HEAD_DIM)
    offsets[torch.randperm(HEAD_DIM, generator=gen)[:8]] = torch.randn(8, generator=gen) * offset_std
    return (torch.randn(tokens, heads, HEAD_DIM, generator=gen) * scale + offsets).bfloat16()


def _problem(gen: torch.Generator, q_lens: list[int], kv_lens: list[int], num_q_heads: int, num_kv_heads: int,
             page_size: int) -> Problem:
    tokens = sum(kv_lens)
    q, k, v = (_rows(gen, tokens, num_q_heads, 1.0, 4.0), _rows(gen, tokens, num_kv_heads, 1.5, 8.0),
               _rows(gen, tokens, num_kv_heads, 1.0, 0.5))
    cu_k = torch.tensor([0, *kv_lens]).cumsum(0)
    means = SmoothingMeans(sequence_means(q, cu_k).float(), sequence_means(k, cu_k).float())

    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((len(kv_lens), max(pages_per_seq) + 1), UNUSED_PAGE, dtype=torch.int32)
    for b, count in enumerate(pages_per_seq):
        page_table[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    request = torch.repeat_interleave(torch.arange(len(kv_lens)), torch.tensor(kv_lens))
    position = torch.arange(tokens) - cu_k[:-1][request]
    slots = page_table[request, position // page_size].long() * page_size + position % page_size

    cache = MpfaKVCache.allocate(num_pages, page_size, num_q_heads, num_kv_heads, HEAD_DIM, "cuda").fill_(0xFF)
    dev_means = SmoothingMeans(means.q_mean.cuda(), means.k_mean.cuda())
    centered = quantize_to_cache(q.cuda(), k.cuda(), v.cuda(), slots.cuda(), request.int().cuda(), dev_means, cache)
    queries = torch.cat([torch.arange(end - n, end) for end, n in zip(cu_k[1:].tolist(), q_lens)])  # last q_len
    paged = {}
    for name, x in (("k", k), ("v", v)):
        pages = torch.full((num_pages * page_size, num_kv_heads, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
        pages[slots] = x
        paged[name] = pages.view(num_pages, page_size, num_kv_heads, HEAD_DIM)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0)
    reference_inputs = dict(q=q[queries], k=paged["k"], v=paged["v"], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            page_table=page_table, page_size=page_size)
    index = queries.cuda()
    return Problem(CenteredQuery(centered.codes[index].contiguous(), centered.scales[index].contiguous()), cache,
                   page_table.cuda(), cu_q.int().cuda(), torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
                   dict(reference_inputs, means=means))


def _run(problem: Problem, causal: bool, out_dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    total_q, num_q_heads = problem.query.codes.shape[:2]
    out = torch.full((total_q, num_q_heads, HEAD_DIM), float("nan"), dtype=out_dtype, device="cuda")
    result = mpfa_prefill(problem.query, problem.cache, problem.page_table, problem.cu_seqlens_q, problem.seq_lens_k,
                          causal=causal, out=out, **kwargs)
    torch.cuda.synchronize()
    assert result is out
    return out.cpu()


def _expected(problem: Problem, causal: bool, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the oracle of ``kernel``, dense float64)."""
    plain = {name: value for name, value in problem.reference_inputs.items() if name != "means"}
    return oracle(problem, causal, kernel), attention_float64(**plain, causal=causal)


def oracle(problem: Problem, causal: bool, kernel: str, sm_scale: float | None = None) -> torch.Tensor:
    """`reference.attention` with ``kernel``'s numerics and softmax tiles."""
    spec = PREFILL_KERNELS[kernel]
    return attention(**problem.reference_inputs, variant=spec.numerics, causal=causal, block_m=64,
                     block_n=spec.softmax_keys, sm_scale=sm_scale)


def run_against_oracle(problem: Problem, causal: bool, kernel: str, **run) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel``'s output on ``problem`` checked against its oracle (`BOUNDS`) and float64 (`_check`), and
    repeatable: the launch given the longest query length (no host synchronisation) computes the same -> (the
    output, the oracle's)."""
    out = _run(problem, causal, kernel=kernel, **run)
    expected, exact = _expected(problem, causal, kernel)
    _check(out, expected, exact, *BOUNDS[kernel])
    q_lens = torch.diff(problem.cu_seqlens_q).tolist()
    assert torch.equal(_run(problem, causal, kernel=kernel, max_seqlen_q=max(q_lens), **run), out)
    return out, expected


def _rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _check(got: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, rms: float = 1e-3,
           max_fraction: float = 0.02) -> None:
    """``got`` finite, within ``rms`` (relative) and ``max_fraction`` of max |O| of the oracle ``expected``, and no
    further from float64 (``exact``) than the oracle is (+1%)."""
    assert bool(torch.isfinite(got).all()), "NaN/Inf in the output (or rows left unwritten)"
    assert _rms_ratio(got, expected) <= rms, f"rms {_rms_ratio(got, expected):.3g} from the oracle > {rms}"
    assert float((got.double() - expected.double()).abs().max()) <= max_fraction * float(expected.abs().max())
    assert _rms_ratio(got, exact) <= 1.01 * _rms_ratio(expected, exact)


DEFAULT_CASES = [  # (q_lens, kv_lens, Hq, Hkv, page size, causal): the kernel `dispatch` chooses
    ([1, 77, 300], [1, 77, 420], 32, 8, 128, True),  # Llama-3.1-8B heads: fp8
    ([300, 45], [300, 1000], 40, 8, 128, True),  # Qwen3-14B heads, a 45-token chunk after 955 cached tokens: fp8
    ([77, 129, 1], [77, 300, 33], 32, 8, 32, False),  # pages of 32 keys: mma-sync
    ([200, 64], [257, 64], 5, 1, 128, True),  # 5:1, Qwen3-14B at tensor parallelism 8 (odd Hq): mma-sync
    ([130, 17], [200, 17], 48, 8, 64, False),  # GQA group 6: mma-sync
]


@pytest.mark.parametrize("q_lens,kv_lens,num_q_heads,num_kv_heads,page_size,causal", DEFAULT_CASES,
                         ids=["32x8-fp8", "40x8-chunked-fp8", "32x8-page32-mma-sync", "5x1-mma-sync",
                              "48x8-mma-sync"])
def test_the_default_kernel_matches_its_oracle(gen, monkeypatch, q_lens, kv_lens, num_q_heads, num_kv_heads,
                                               page_size, causal):
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    problem = _problem(gen, q_lens, kv_lens, num_q_heads, num_kv_heads, page_size)
    kernel = prefill_kernel(num_q_heads, num_kv_heads, page_size)
    got = _run(problem, causal)
    expected, exact = _expected(problem, causal, kernel)
    _check(got, expected, exact, *BOUNDS[kernel])
    assert torch.equal(got, _run(problem, causal, kernel=kernel)), "the default is the kernel dispatch names"


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
def test_bf16_output_and_sm_scale_through_the_switch(gen, monkeypatch, kernel):
    """``MPFA_PREFILL_KERNEL`` selects the kernel when ``kernel`` is not given; a new BF16 output, another
    sm_scale."""
    problem = _problem(gen, [150, 33], [150, 200], 32, 8, 128)
    monkeypatch.setenv(PREFILL_KERNEL_ENV, kernel)
    out = mpfa_prefill(problem.query, problem.cache, problem.page_table, problem.cu_seqlens_q, problem.seq_lens_k,
                       sm_scale=0.05)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (problem.query.codes.shape[0], 32, HEAD_DIM)
    assert bool(torch.isfinite(out).all())
    expected = oracle(problem, True, kernel, sm_scale=0.05)
    assert _rms_ratio(out.float().cpu(), expected) <= BOUNDS[kernel][0] + BF16_SLACK
    assert torch.equal(out.cpu(), _run(problem, True, torch.bfloat16, kernel=kernel, sm_scale=0.05))


def test_nan_output_fails_the_check(gen):
    """The comparison rejects a NaN (an unwritten row of the poisoned output)."""
    problem = _problem(gen, [40], [40], 32, 8, 128)
    got = _run(problem, True, kernel="mma-sync")
    expected, exact = _expected(problem, True, "mma-sync")
    _check(got, expected, exact)
    got[7, 3, 5] = float("nan")
    with pytest.raises(AssertionError):
        _check(got, expected, exact)


DIRECT_CASES = [  # (q_lens, kv_lens, page size, causal), GQA 32:8 and pages of >= 64 keys (every kernel's shape)
    ([1, 77, 300], [1, 77, 420], 128, True),  # a single token, ragged, one chunked prefill
    ([77, 129, 1], [77, 300, 64], 64, False),  # non-causal, chunked, page 64
]


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", DIRECT_CASES, ids=["causal", "noncausal-page64"])
def test_direct_build_is_the_compensated_build_on_zero_delta_s(gen, kernel, q_lens, kv_lens, page_size, causal):
    """``compensate=False`` reads no Delta_S and starts every visible score at 0: bit for bit the compensated
    kernel (same inputs) on a cache whose Delta_S is all zeros (a zero Delta_S adds +0 to each score: the fp8
    kernel's FFMA rounds the product once either way, the exact kernel's Delta_S k-step adds zero products). The
    direct build runs first, on the real Delta_S (NaN-poisoned past the written slots), which must not reach its
    output."""
    problem = _problem(gen, q_lens, kv_lens, 32, 8, page_size)
    direct = _run(problem, causal, kernel=kernel, compensate=False)
    compensated = _run(problem, causal, kernel=kernel)
    assert not torch.equal(direct, compensated), "these inputs' Delta_S must matter"
    problem.cache.delta_s.zero_()
    zero_delta_s = _run(problem, causal, kernel=kernel)
    assert bool(torch.isfinite(direct).all()), "NaN/Inf in the output (or rows left unwritten)"
    assert torch.equal(direct, zero_delta_s)
