"""The prefill's host side (`prefill_launch`) on the CPU: input checks fail with one clear line before anything
touches a device, the kernel `dispatch` chooses and the compensation reach the compile (its cache key), the launch
sizes the grid with the kernel's rows per CTA, and an empty batch launches nothing."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache
from mpfa.kernels.sm90 import prefill_launch
from mpfa.kernels.sm90.ablation import FULL
from mpfa.kernels.sm90.dispatch import PREFILL_KERNEL_ENV, PREFILL_KERNELS
from mpfa.kernels.sm90.prefill_launch import kernel_block_m, mpfa_prefill


def _inputs(total_q=5, hq=8, hkv=2, page_size=128, batch=2):
    query = CenteredQuery.allocate(total_q, hq, 128, "cpu")
    cache = MpfaKVCache.allocate(4, page_size, hq, hkv, 128, "cpu")
    return dict(query=query, cache=cache, page_table=torch.zeros((batch, 2), dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 2, total_q], dtype=torch.int32),
                seq_lens_k=torch.tensor([2, 3], dtype=torch.int32))


@pytest.mark.parametrize("change,message", [
    (dict(seq_lens_k=torch.tensor([2, 3])), "seq_lens_k must be int32"),
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens_q must be int32 \[3\]"),
    (dict(page_table=torch.zeros((2, 2), dtype=torch.int64)), "page_table must be int32"),
    (dict(cache=MpfaKVCache.allocate(4, 16, 8, 2, 128, "cpu")), "page_size >= 32"),
    (dict(cache=MpfaKVCache.allocate(4, 128, 16, 2, 128, "cpu")), "query has 8 heads, the cache 16"),
    (dict(out=torch.empty((5, 8, 128), dtype=torch.float16)), "out must be contiguous BF16 or FP32"),
    (dict(sm_scale=-1.0), "sm_scale must be positive"),
    (dict(kernel="fast"), "kernel must be one of fp8, exact, mma-sync, got 'fast'"),
    (dict(cache=MpfaKVCache.allocate(4, 32, 8, 2, 128, "cpu"), kernel="exact"), "use mma-sync"),
])
def test_bad_inputs_raise_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        mpfa_prefill(**{**_inputs(), "max_seqlen_q": 3, **change})


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list:
    """The calls `mpfa_prefill` makes to `compile_prefill_kernel`, which returns kernels that launch nothing (a
    kernel with an operand pass, the fp8 kernel: the pass and the attention)."""
    calls = []

    def no_launch(*_) -> None:
        return None

    def compile_prefill_kernel(*args):
        calls.append(args)
        return (no_launch, no_launch) if PREFILL_KERNELS[args[6]].operand_pass_class else no_launch

    monkeypatch.setattr(prefill_launch, "compile_prefill_kernel", compile_prefill_kernel)
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    return calls


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
def test_the_kernel_and_the_compensation_reach_the_compile(compiles, kernel):
    """``mpfa_prefill(..., kernel=k, compensate=False)`` compiles k's direct build (the flag is part of the compile
    key), the default the compensated kernel; the fp8 kernel's ablated path (`FULL`: the real kernel) the same."""
    inputs = {**_inputs(), "max_seqlen_q": 3}
    mpfa_prefill(**inputs, kernel=kernel, compensate=False)
    mpfa_prefill(**inputs, kernel=kernel)
    config = (2, 4, 128, True, "BFloat16", None, kernel)  # (KV heads, group, page, causal, out, ablation, kernel)
    expected = [(*config, False), (*config, True)]
    if PREFILL_KERNELS[kernel].ablations:
        prefill_launch.mpfa_prefill_ablated(FULL, **inputs, kernel=kernel, compensate=False)
        expected.append((*config, False))
    assert compiles == expected


def test_the_environment_and_the_shape_choose_the_kernel(compiles, monkeypatch: pytest.MonkeyPatch):
    """No ``kernel``: ``MPFA_PREFILL_KERNEL``, else the shape's default (fp8 for GQA 4 at pages of 128, mma-sync at
    pages of 32)."""
    inputs = {**_inputs(), "max_seqlen_q": 3}
    mpfa_prefill(**inputs)
    mpfa_prefill(**{**inputs, "cache": MpfaKVCache.allocate(8, 32, 8, 2, 128, "cpu")})
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "Exact")
    mpfa_prefill(**inputs)
    assert [call[6] for call in compiles] == ["fp8", "mma-sync", "exact"]


def test_rows_per_cta():
    """The grid's row blocks: the wgmma kernels' two warpgroups (4 heads x 16 rows, or 1 head x 64 rows each), the
    mma-sync kernel's 4 warps (the group's heads x 16 rows, or fewer heads x more rows)."""
    assert kernel_block_m(4, "fp8") == kernel_block_m(4, "exact") == 32
    assert kernel_block_m(5, "fp8") == kernel_block_m(5, "exact") == 128
    assert kernel_block_m(4, "mma-sync") == kernel_block_m(8, "mma-sync") == 16
    assert kernel_block_m(5, "mma-sync") == kernel_block_m(1, "mma-sync") == 64 and kernel_block_m(2, "mma-sync") == 32
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernel_block_m(4, None)


def test_no_queries_launch_nothing():
    inputs = _inputs(total_q=0)
    inputs["query"] = CenteredQuery.allocate(0, 8, 128, "cpu")
    inputs["cu_seqlens_q"] = torch.zeros(3, dtype=torch.int32)
    out = mpfa_prefill(**inputs)
    assert out.shape == (0, 8, 128) and out.dtype == torch.bfloat16
