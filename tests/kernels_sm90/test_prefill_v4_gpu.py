"""The FP8-QK prefill (v4, `prefill_wgmma_fp8qk`, and v4w8, its 2-warpgroup CTA) on the GPU: against the oracle of
its numerics, `reference.attention(..., variant="mpfa-qk8tile", block_n=64)` (Q requantized to e4m3 per row and
head, K per 64-key tile of a KV head, power-of-two scales; everything else MpFA's), the float64 reference and v3;
v4w8 against v4, bit for bit.

The requantization is bit-exact with the reference's (`test_prefill_v4_compile`: the exponent from the NVFP4 block
scales is the reference's; the FP16 path rounds nothing) and the e4m3 products are exact, but Hopper's FP8 wgmma
sums them with fewer bits than FP32 (DeepSeek-V3's report: ~14, aligned to the largest addend), so v4 does not
equal its oracle up to FP32 summation order as v3 does. Measured on the H200 on these cases (session 14,
`profiles/NOTES.md`): 1.5-2.3e-3 rms from the oracle, max |diff| 1.0-3.6% of max |O|, and as far from float64 as
the oracle to three digits (0.12-0.14: the accumulation adds ~1.5% to the format's own error). Tolerances: rms <=
5e-3, max |diff| <= 5% of max |O| (about 2x the worst measured), every output finite (NaN-poisoned rows left
unwritten fail), no further from float64 than the oracle + 1%. Against v3 the difference may not exceed what the
requantization alone explains (the distance between the ``mpfa`` and ``mpfa-qk8tile`` oracles, ~3.5e-2) by more
than 10% + the accumulation allowance. Inputs and cases are v3's (test_prefill_wgmma_gpu).

    pytest -q -m gpu tests/kernels_sm90/test_prefill_v4_gpu.py -x
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

from mpfa.kernels.sm90.prefill_launch import prefill_numerics, softmax_keys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


v3_tests = load("test_prefill_wgmma_gpu.py", "_prefill_wgmma_gpu_v3")
v1_tests = v3_tests.v1_tests

TILE_KEYS = 64
VARIANT = "mpfa-qk8tile"
FP8_RMS, FP8_MAX = 5e-3, 0.05  # the FP8 wgmma's accumulation (module docstring)
CASES, IDS = v3_tests.CASES, v3_tests.IDS
KERNELS = ["v4", "v4w8"]


def _oracle(problem, causal: bool, variant: str = VARIANT, sm_scale: float | None = None,
            block_n: int = TILE_KEYS) -> torch.Tensor:
    return v1_tests.attention(**problem.reference_inputs, variant=variant, causal=causal, block_m=64,
                              block_n=block_n, sm_scale=sm_scale)


def run_against_oracle(problem, causal: bool, kernel: str, rms: float, max_fraction: float) -> tuple:
    """(``kernel``'s output on ``problem``, the oracle's: the reference variant the kernel computes, ``mpfa-qk8tile``
    or v6n's ``mpfa-qk8tile-psum``, with the kernel's softmax tiles: 64 keys, 128 for v6l .. v7), the output checked
    against the oracle (``rms``, ``max_fraction`` of max |O|) and float64 (`v1_tests._check`): the common part of
    the FP8 kernels' (v4, v5, v6, v7) tests."""
    out = v1_tests._run(problem, causal, kernel=kernel)
    expected = _oracle(problem, causal, prefill_numerics(kernel), block_n=softmax_keys(kernel))
    _, exact = v1_tests._expected(problem, causal)
    v1_tests._check(out, expected, exact, rms=rms, max_fraction=max_fraction)
    return out, expected


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", CASES, ids=IDS)
def test_v4_matches_oracle_and_v3(gen, kernel, q_lens, kv_lens, page_size, causal):
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, page_size)
    out, expected = run_against_oracle(problem, causal, kernel, FP8_RMS, FP8_MAX)

    v3 = v1_tests._run(problem, causal, kernel="v3")
    requant = _oracle(problem, causal, "mpfa")  # v3's oracle: what the requantization alone changes
    scale = float(expected.abs().max())
    assert v1_tests._rms_ratio(out, v3) <= 1.1 * v1_tests._rms_ratio(expected, requant) + FP8_RMS
    assert v3_tests._max_diff(out, v3) <= 1.1 * v3_tests._max_diff(expected, requant) + FP8_MAX * scale
    assert torch.equal(v1_tests._run(problem, causal, kernel=kernel, max_seqlen_q=max(q_lens)), out)
    if kernel != "v4":  # v4w8: v4's output, bit for bit
        v4 = v1_tests._run(problem, causal, kernel="v4")
        assert torch.equal(out, v4), f"{kernel} differs from v4 (max |diff| {v3_tests._max_diff(out, v4)})"


@pytest.mark.parametrize("kernel", KERNELS)
def test_v4_bf16_output_through_the_switch(gen, monkeypatch, kernel):
    """``MPFA_PREFILL_KERNEL=v4`` (``v4w8``) selects it when ``kernel`` is not given; BF16 output, another
    sm_scale."""
    from mpfa.kernels.sm90 import prefill_launch

    problem = v1_tests._problem(gen, [150, 33], [150, 200], 32, 8, 128)
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, kernel)
    out = v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    expected = _oracle(problem, True, sm_scale=0.05)
    assert v1_tests._rms_ratio(out.float(), expected) <= FP8_RMS + 2**-9  # + BF16 output rounding
    if kernel != "v4":
        assert torch.equal(out, v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05, kernel="v4"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_v4_refuses_other_groups(gen, kernel):
    problem = v1_tests._problem(gen, [40], [40], 40, 8, 128)
    with pytest.raises(ValueError, match="group 4 only"):
        v1_tests._run(problem, True, kernel=kernel)
