"""On an sm_90 GPU with FlashInfer: the FP8 tensor-core baselines (XQA decode, fa3-template FP8 prefill, FMHAv2
FP8 prefill) compute attention (checked against float64) and their kernel-name regexes match the traced kernels.
Skipped without CUDA, without flashinfer, or off Hopper (these paths are sm_90 ones). FMHAv2's first call JIT-builds
the warp-specialized kernels of its layout and dtype for every variant FlashInfer's generator lists (11 head sizes
x soft-cap, ALiBi, softmax-stats and skip-softmax switches), so its cases are marked slow."""
import importlib.util
import re

import pytest
import torch

from mpfa.profiles import microbench
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.registry import adapter_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                       reason="sm_90 paths"),
]

CASES = [
    ("flashinfer-fp8-xqa", AttentionWorkload("decode", 1000, 3, 32, 8, 128)),  # a partial last page of 64
    ("flashinfer-fp8-fa3", AttentionWorkload("prefill", 300, 2, 32, 8, 128)),  # 300: not a multiple of any tile
    pytest.param("flashinfer-fp8-fmha-v2", AttentionWorkload("prefill", 300, 2, 32, 8, 128), marks=pytest.mark.slow),
]
IDS = ["flashinfer-fp8-xqa", "flashinfer-fp8-fa3", "flashinfer-fp8-fmha-v2"]


@pytest.mark.parametrize("backend,workload", CASES, ids=IDS)
def test_output_matches_float64_reference(backend, workload, float64_reference):
    prepared = adapter_for(backend).prepare(workload, 2, torch.device("cuda"), seed=1234)
    for index in range(2):
        out = prepared.run(index).double()
        torch.cuda.synchronize()
        reference = float64_reference(prepared, workload, index)
        assert out.shape == reference.shape and torch.isfinite(out).all()
        # All three round P to e4m3 before the PV MMA: a few % of each value, not BF16's 1%.
        error = (out - reference).abs()
        assert (error <= 2e-2 * reference.abs().amax() + 8e-2 * reference.abs()).all(), error.max().item()
        assert error.pow(2).mean().sqrt() <= 3e-2 * reference.pow(2).mean().sqrt()


@pytest.mark.slow
@pytest.mark.parametrize("backend,workload", CASES, ids=IDS)
def test_kernel_regex_matches_the_traced_kernels(backend, workload, tmp_path):
    adapter = adapter_for(backend)
    trace = microbench._trace_in_process(adapter, workload, torch.device("cuda"), tmp_path, note="test")
    assert trace.error is None and trace.kernels
    assert [k.name for k in trace.kernels if re.search(adapter.kernel_regex, k.name)], [k.name for k in trace.kernels]
