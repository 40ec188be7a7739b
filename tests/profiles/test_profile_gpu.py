"""On a CUDA GPU: each adapter computes attention (checked against float64), run_profile end to end, and the
kernel-name regexes against real kernel names. Skipped without CUDA or without the backend's package."""
import importlib.util
import re
import shutil

import pytest
import torch

from mpfa.profiles import microbench
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.kernel_categories import ATTENTION, classify
from mpfa.profiles.ncu import profile_with_ncu
from mpfa.profiles.registry import adapter_for
from mpfa.profiles.profile_result import OK

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PACKAGE = {"fa4-bf16": "flash_attn", "flashinfer-fp8": "flashinfer", "flashinfer-bf16": "flashinfer"}
WORKLOADS = [
    AttentionWorkload("prefill", 300, 2, 8, 2, 128),  # 300: not a multiple of any tile
    AttentionWorkload("decode", 1000, 3, 8, 2, 128),  # 1000: a partial last page for FA4's page 128
    AttentionWorkload("decode", 777, 2, 4, 4, 64),  # MHA: FlashInfer BF16 decode without tensor cores
]


def _needs(backend):
    if importlib.util.find_spec(PACKAGE[backend]) is None:
        pytest.skip(f"{PACKAGE[backend]} is not installed")
    return adapter_for(backend)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: f"{w.kind}-s{w.seq}-h{w.q_heads}x{w.kv_heads}")
@pytest.mark.parametrize("backend", list(PACKAGE))
def test_adapter_output_matches_float64_reference(backend, workload, float64_reference):
    adapter = _needs(backend)
    prepared = adapter.prepare(workload, 2, torch.device("cuda"), seed=1234)
    for index in range(2):  # both rotated sets hold distinct data and each is computed right
        out = prepared.run(index).double()
        reference = float64_reference(prepared, workload, index)
        assert out.shape == reference.shape and torch.isfinite(out).all()
        error = (out - reference).abs()
        # BF16 P in the PV product and a BF16 output: about 1% of each value, plus a floor for values near 0.
        assert (error <= 5e-3 * reference.abs().amax() + 2e-2 * reference.abs()).all(), error.max().item()
    q0, q1 = prepared.dense_inputs(0)[0], prepared.dense_inputs(1)[0]
    assert not torch.equal(q0, q1)


def test_run_profile_end_to_end(tmp_path):
    result = microbench.run_profile("prefill", 2048, 1, (8, 2), 128, ["fa4-bf16", "flashinfer-fp8", "mpfa"],
                                    ncu=False, nsys=False, out_dir=tmp_path)
    assert result.peaks.copy_gbps and result.peaks.bf16_tflops, result.peaks.errors
    for row in result.backends:
        if row.backend != "mpfa" and importlib.util.find_spec(PACKAGE[row.backend]) is None:
            continue
        assert row.status == OK, row.error_detail
        derived = result.derived(row)
        assert row.timing.median_ms > 0 and 0 < derived.pct_compute_peak < 100  # attention cannot beat a GEMM
    assert (tmp_path / result.json_path.split("/")[-1]).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(PACKAGE))
def test_kernel_regex_matches_the_traced_kernels(backend, tmp_path):
    adapter = _needs(backend)
    workload = AttentionWorkload("decode", 4096, 2, 32, 8, 128)
    trace = microbench._trace_in_process(adapter, workload, torch.device("cuda"), tmp_path, note="test")
    assert trace.error is None and trace.kernels
    main_kernels = [kernel.name for kernel in trace.kernels if re.search(adapter.kernel_regex, kernel.name)]
    assert main_kernels, [kernel.name for kernel in trace.kernels]
    assert {classify(name) for name in main_kernels} == {ATTENTION}  # the serving breakdown counts them right


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ncu") is None, reason="ncu is not on PATH")
def test_ncu_profiles_one_flashinfer_launch(tmp_path):
    adapter = _needs("flashinfer-fp8")
    result = profile_with_ncu(adapter, AttentionWorkload("decode", 8192, 2, 32, 8, 128), tmp_path)
    if result.error and "ERR_NVGPUCTRPERM" in result.error:
        pytest.skip(result.error)
    assert result.error is None and len(result.kernels) == 1
    assert result.kernels[0].metrics["gpu__time_duration.sum"] > 0
