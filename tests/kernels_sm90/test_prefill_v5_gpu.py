"""The FP8-PV prefill (v5, `prefill_wgmma_fp8pv`, and v5w8, its 2-warpgroup CTA) on the GPU: against the oracle of
its numerics, `reference.attention(..., variant="mpfa-qk8tile", block_n=64)` (v4's: P = e4m3(448 P) and e4m3 V in
both, so v5 needs no variant of its own), the float64 reference, and v4; v5w8 against v5, bit for bit.

v5 computes S, P and l with v4's instructions (the same QK code), so v5 - v4 is only PV's summation: e4m3 products
(exact) summed by Hopper's FP8 wgmma (~14 bits aligned to the largest addend, `profiles/NOTES.md`) within each
64-key tile, from a fresh accumulator, then added to O in FP32 as the oracle adds its per-tile P V. A tile's sum
has 64 addends in 2 k-steps, so its error is ~2^-13 of the tile's largest |P V| term; over many tiles it averages
down relative to O. Tolerances: the oracle's v4 bounds (rms 5e-3, max 5% of max |O|: 2x the QK accumulation error
measured for v4) plus 1e-3 rms and 1% max for PV's accumulation; against v4 directly, where only PV differs, rms
1e-3 and max 1% of max |O| (a guess, several times the per-tile bound: the first run measures it). Every output
finite (NaN-poisoned rows left unwritten fail), no further from float64 than the oracle + 1%. Inputs and cases are
v3's (test_prefill_wgmma_gpu): causal and non-causal, ragged batches, lengths off 64 / 128, pages of 64 and 128.

    pytest -q -m gpu tests/kernels_sm90/test_prefill_v5_gpu.py -x
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


v4_tests = load("test_prefill_v4_gpu.py", "_prefill_v4_gpu_v5")
v3_tests, v1_tests = v4_tests.v3_tests, v4_tests.v1_tests

PV8_RMS, PV8_MAX = 1e-3, 0.01  # FP8 wgmma summation of each tile's P V (module docstring)
RMS, MAX = v4_tests.FP8_RMS + PV8_RMS, v4_tests.FP8_MAX + PV8_MAX
CASES, IDS = v3_tests.CASES, v3_tests.IDS
KERNELS = ["v5", "v5w8"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", CASES, ids=IDS)
def test_v5_matches_oracle_and_v4(gen, kernel, q_lens, kv_lens, page_size, causal):
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, page_size)
    out, expected = v4_tests.run_against_oracle(problem, causal, kernel, RMS, MAX)

    v4 = v1_tests._run(problem, causal, kernel="v4")  # the same S, P and l: only PV's summation differs
    scale = float(expected.abs().max())
    assert v1_tests._rms_ratio(out, v4) <= PV8_RMS, f"rms from v4 {v1_tests._rms_ratio(out, v4):.2e}"
    assert v3_tests._max_diff(out, v4) <= PV8_MAX * scale, f"max |diff| from v4 {v3_tests._max_diff(out, v4):.3g}"
    assert torch.equal(v1_tests._run(problem, causal, kernel=kernel, max_seqlen_q=max(q_lens)), out)
    if kernel != "v5":  # v5w8: v5's output, bit for bit (each warpgroup runs v5's arithmetic on v5's tiles)
        v5 = v1_tests._run(problem, causal, kernel="v5")
        assert torch.equal(out, v5), f"{kernel} differs from v5 (max |diff| {v3_tests._max_diff(out, v5)})"


@pytest.mark.parametrize("kernel", KERNELS)
def test_v5_bf16_output_through_the_switch(gen, monkeypatch, kernel):
    """``MPFA_PREFILL_KERNEL=v5`` (``v5w8``) selects it when ``kernel`` is not given; BF16 output, another
    sm_scale."""
    from mpfa.kernels.sm90 import prefill_launch

    problem = v1_tests._problem(gen, [150, 33], [150, 200], 32, 8, 128)
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, kernel)
    out = v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    expected = v4_tests._oracle(problem, True, sm_scale=0.05)
    assert v1_tests._rms_ratio(out.float(), expected) <= RMS + 2**-9  # + BF16 output rounding
    if kernel != "v5":
        assert torch.equal(out, v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05, kernel="v5"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_v5_refuses_other_groups(gen, kernel):
    problem = v1_tests._problem(gen, [40], [40], 40, 8, 128)
    with pytest.raises(ValueError, match="group 4 only"):
        v1_tests._run(problem, True, kernel=kernel)
