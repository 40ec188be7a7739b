"""`dispatch`, the one place that chooses the sm90 prefill kernel (host-side only): the default for each shape, the
override (``kernel=`` over ``MPFA_PREFILL_KERNEL``, case-insensitive), the wgmma kernels' limits as one clear error,
and the numerics and softmax tiles each kernel computes."""

from __future__ import annotations

import pytest

from mpfa.kernels.sm90 import dispatch
from mpfa.kernels.sm90.dispatch import PREFILL_KERNEL_ENV, prefill_kernel


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)


def test_the_default_for_each_shape():
    """fp8 for GQA groups 1-8 (8:8 to 64:8, 28:4 of Qwen2.5-7B, 12:2 of Qwen2.5-1.5B) with pages of >= 64 keys and
    an even number of query heads; mma-sync for the rest: pages of 32, an odd number of query heads (5:1, Qwen3-14B
    at tensor parallelism 8), groups above 8."""
    assert prefill_kernel(32, 8, 128) == prefill_kernel(40, 8, 64) == prefill_kernel(32, 8, 256) == "fp8"
    assert prefill_kernel(8, 8, 128) == prefill_kernel(16, 8, 128) == prefill_kernel(24, 8, 128) == "fp8"
    assert prefill_kernel(48, 8, 128) == prefill_kernel(28, 4, 128) == prefill_kernel(64, 8, 128) == "fp8"
    assert prefill_kernel(12, 2, 128) == prefill_kernel(56, 8, 64) == "fp8"
    assert prefill_kernel(32, 8, 32) == prefill_kernel(40, 8, 32) == prefill_kernel(64, 8, 32) == "mma-sync"
    assert prefill_kernel(5, 1, 128) == prefill_kernel(15, 3, 128) == prefill_kernel(72, 8, 128) == "mma-sync"


def test_the_override(monkeypatch: pytest.MonkeyPatch):
    assert prefill_kernel(32, 8, 128, "Exact") == "exact" and prefill_kernel(32, 8, 128, " mma-sync") == "mma-sync"
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "EXACT")
    assert prefill_kernel(32, 8, 128) == "exact" and prefill_kernel(40, 8, 128, "fp8") == "fp8"  # kernel= wins
    assert prefill_kernel(48, 8, 32, "mma-sync") == "mma-sync"
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "")
    assert prefill_kernel(32, 8, 128) == "fp8"  # set but empty: not an override
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "turbo")
    with pytest.raises(ValueError, match=f"{PREFILL_KERNEL_ENV} must be one of fp8, exact, mma-sync, got 'turbo'"):
        prefill_kernel(32, 8, 128)
    with pytest.raises(ValueError, match="kernel must be one of fp8, exact, mma-sync, got 'fast'"):
        prefill_kernel(32, 8, 128, "fast")


@pytest.mark.parametrize("kernel", dispatch.WGMMA_KERNELS)
@pytest.mark.parametrize("shape", [(72, 8, 128), (32, 8, 32), (5, 1, 128)], ids=["group-9", "page-32", "odd-heads"])
def test_a_pinned_wgmma_kernel_refuses_other_shapes(monkeypatch: pytest.MonkeyPatch, kernel, shape):
    message = (f"the {kernel} prefill kernel needs a GQA group of 1 to 8, an even number of query heads and pages "
               f"of >= 64 keys; got {shape[0]}:{shape[1]} heads, pages of {shape[2]}: use mma-sync")
    with pytest.raises(ValueError, match=message):
        prefill_kernel(*shape, kernel)
    monkeypatch.setenv(PREFILL_KERNEL_ENV, kernel)
    with pytest.raises(ValueError, match=message):
        prefill_kernel(*shape)
    with pytest.raises(ValueError, match=message):
        dispatch.check_wgmma_shape(kernel, *shape)


@pytest.mark.parametrize("kernel", dispatch.WGMMA_KERNELS)
def test_a_wgmma_kernel_runs_by_name_at_every_group(monkeypatch: pytest.MonkeyPatch, kernel):
    """Both wgmma kernels pass their GPU tests at GQA groups 1-8: by name, each runs at every one."""
    for group in dispatch.WGMMA_GROUPS:
        assert prefill_kernel(8 * group, 8, 128, kernel) == kernel
    monkeypatch.setenv(PREFILL_KERNEL_ENV, kernel)
    assert [prefill_kernel(8 * group, 8, 128) for group in dispatch.WGMMA_GROUPS] == [kernel] * 8


def test_each_kernel_says_what_it_computes():
    """The reference variant (`mpfa.kernels.reference`) and the softmax tiles (its ``block_n``) of each kernel: the
    fp8 kernel's requantized QK and row sums of the e4m3 P over 128 keys, the exact kernel's paper numerics over 64,
    the mma-sync kernel's over 32."""
    assert [dispatch.prefill_numerics(k) for k in dispatch.PREFILL_KERNELS] == ["mpfa-qk8tile-psum", "mpfa", "mpfa"]
    assert [dispatch.softmax_keys(k) for k in dispatch.PREFILL_KERNELS] == [128, 64, 32]
    assert dispatch.WGMMA_KERNELS[0] == "fp8" and dispatch.DECODE_KERNEL == "split-kv"
