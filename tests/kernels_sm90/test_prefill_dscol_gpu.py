"""v3c / v3w8c (`prefill_wgmma_dscol`: Delta_S as an extra K column of QK) on the GPU, on v3's cases: against the
oracle with v3's tiling and bounds (`test_prefill_wgmma_gpu`'s checks), against v3 within the FP32 summation-order
allowance (Delta_S is added last instead of being the accumulator's initial value: the same values summed in
another order), v3w8c against v3c bit for bit (each warpgroup runs v3c's arithmetic), and the direct builds
against v3's bit for bit (no Delta_S, no extra k-step); GQA 32:8 and 40:8 (v3's shapes). Inputs and poisoning as
in test_prefill_gpu.

    pytest -q -m gpu tests/kernels_sm90/test_prefill_dscol_gpu.py -x
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

v1_tests = load("test_prefill_gpu.py", "_prefill_gpu_v1")
v3_tests = load("test_prefill_wgmma_gpu.py", "_prefill_wgmma_gpu_v3")



@pytest.mark.parametrize("kernel", ["v3c", "v3w8c"])
@pytest.mark.parametrize("hq,q_lens,kv_lens,page_size,causal", v3_tests.SHAPES, ids=v3_tests.SHAPE_IDS)
def test_ds_column_matches_oracle_and_v3(gen, kernel, hq, q_lens, kv_lens, page_size, causal):
    problem = v1_tests._problem(gen, q_lens, kv_lens, hq, 8, page_size)
    out = v1_tests._run(problem, causal, kernel=kernel)
    _, exact = v1_tests._expected(problem, causal)
    v1_tests._check(out, v3_tests._oracle(problem, causal, v3_tests.V3_TILE_KEYS), exact)
    v3 = v1_tests._run(problem, causal, kernel="v3")
    assert v1_tests._rms_ratio(out, v3) <= v3_tests.V1_SLACK, f"{kernel}: {v1_tests._rms_ratio(out, v3):.3g} from v3"
    if kernel == "v3w8c":
        assert torch.equal(out, v1_tests._run(problem, causal, kernel="v3c")), "v3w8c differs from v3c"


@pytest.mark.parametrize("hq", [32, 40])
def test_ds_column_direct_build_is_v3s(gen, hq):
    problem = v1_tests._problem(gen, [300, 64], [300, 200], hq, 8, 128)
    for kernel, base in (("v3c", "v3"), ("v3w8c", "v3w8")):
        out = v1_tests._run(problem, True, kernel=kernel, compensate=False)
        assert bool(torch.isfinite(out).all())
        assert torch.equal(out, v1_tests._run(problem, True, kernel=base, compensate=False)), kernel
