"""The staged prefill (v2, `prefill_staged`, CTAs of 4 warps and of 8: ``v2w8``) on the GPU: bit-identical to v1
and within the oracle's tolerances.

v2 runs v1's per-warp arithmetic on the same 32-key tiles in the same (reverse) order, only reading K / V /
Delta_S from a shared-memory ring instead of global memory, so its output must equal v1's exactly (the CPU tests
check the byte plumbing and that the tile loops' floating-point instructions are v1's). The inputs and checks are
test_prefill_gpu's (loaded from that file): fresh random non-zero BF16 Q/K/V through the Triton KV write into a
NaN-poisoned paged cache behind a shuffled page table, NaN-poisoned outputs, the `mpfa` oracle with the kernel's
tiling and the float64 reference. Cases: test_prefill_gpu's (GQA 32:8 and 40:8, causal / chunked / non-causal,
page 128 and 64, ragged lengths) plus longer and more ragged ones, so the ring wraps many times and CTAs of one
launch walk very different numbers of tiles, and short ones where the two 16-row blocks of an 8-warp CTA have
different diagonals, or the second has one row or none (GQA 40:8 runs the 4-warp shape in both variants).

    pytest -q -m gpu tests/kernels_sm90/test_prefill_staged_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


v1_tests = load("test_prefill_gpu.py", "_prefill_gpu_v1")

CASES = v1_tests.CASES + [  # (q_lens, kv_lens, Hq, Hkv, page size, causal)
    ([1000, 555, 17], [1000, 2100, 17], 32, 8, 128, True),  # ~66 tiles per CTA: the ring wraps many times
    ([333, 129], [900, 129], 40, 8, 64, True),  # GQA 5, page 64, chunked
    ([250, 97], [250, 400], 32, 8, 64, False),  # GQA 4, page 64, non-causal
    ([640, 1, 130], [700, 1, 130], 40, 8, 128, False),  # GQA 5 non-causal, a single-token sequence
    ([17, 48, 1, 95], [500, 48, 1, 95], 32, 8, 64, True),  # 8 warps: 1 row / no row in a CTA's second block
    ([95, 33, 47], [130, 33, 47], 32, 8, 128, False),  # ... non-causal, lengths off every tile size
]
IDS = ["32x8-causal", "40x8-causal-chunked", "32x8-noncausal", "40x8-page64-noncausal", "32x8-long-chunked",
       "40x8-page64-chunked", "32x8-page64-noncausal", "40x8-noncausal-ragged", "32x8-page64-short-rowblocks",
       "32x8-noncausal-short-rowblocks"]
STAGED = ["v2", "v2w8"]


def _differences(got: torch.Tensor, want: torch.Tensor) -> str:
    differ = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
    return f"{int(differ.sum())} of {got.numel()} differ, max |diff| {float((got - want).abs().nan_to_num().max())}"


@pytest.mark.parametrize("kernel", STAGED)
@pytest.mark.parametrize("q_lens,kv_lens,num_q_heads,num_kv_heads,page_size,causal", CASES, ids=IDS)
def test_staged_equals_v1_and_reference(gen, q_lens, kv_lens, num_q_heads, num_kv_heads, page_size, causal, kernel):
    problem = v1_tests._problem(gen, q_lens, kv_lens, num_q_heads, num_kv_heads, page_size)
    v1 = v1_tests._run(problem, causal, kernel="v1")
    v2 = v1_tests._run(problem, causal, kernel=kernel)
    assert bool(torch.isfinite(v2).all()), "NaN/Inf in the output (or rows left unwritten)"
    assert torch.equal(v2, v1), _differences(v2, v1)
    expected, exact = v1_tests._expected(problem, causal)
    v1_tests._check(v2, expected, exact)
    # Repeatable, and the launch with the longest query length given computes the same.
    assert torch.equal(v1_tests._run(problem, causal, kernel=kernel, max_seqlen_q=max(q_lens)), v2)


@pytest.mark.parametrize("kernel", STAGED)
@pytest.mark.parametrize("num_q_heads", [32, 40])
def test_staged_bf16_output_through_the_switch(gen, monkeypatch, num_q_heads, kernel):
    """``MPFA_PREFILL_KERNEL=v2|v2w8`` selects it when ``kernel`` is not given; BF16 output, another sm_scale."""
    from mpfa.kernels.sm90 import prefill_launch

    problem = v1_tests._problem(gen, [150, 33], [150, 200], num_q_heads, 8, 128)
    v1 = v1_tests._run(problem, True, torch.bfloat16, kernel="v1", sm_scale=0.05)
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, kernel)
    v2 = v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05)
    assert bool(torch.isfinite(v2).all()) and torch.equal(v2, v1), _differences(v2.float(), v1.float())
    expected = v1_tests.attention(**problem.reference_inputs, variant="mpfa", causal=True, block_m=64,
                                  block_n=v1_tests.TILE_KEYS, sm_scale=0.05)
    assert v1_tests._rms_ratio(v2.float(), expected) <= 4e-3  # + BF16 output rounding (2**-9)
