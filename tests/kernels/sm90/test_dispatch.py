"""`dispatch`, where each sm90 kernel is declared and the one place that chooses the prefill kernel (host-side
only): the default for each shape, the override (``kernel=`` over ``MPFA_PREFILL_KERNEL``, case-insensitive), the
wgmma kernels' limits as one clear error, and what each declaration says: numerics, softmax tiles, classes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpfa.kernels.reference import VARIANTS
from mpfa.kernels.sm90 import dispatch
from mpfa.kernels.sm90.dispatch import DECODE_KERNEL, PREFILL_KERNEL_ENV, PREFILL_KERNELS, prefill_kernel

WGMMA_KERNELS = [name for name, kernel in PREFILL_KERNELS.items() if kernel.wgmma]


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


@pytest.mark.parametrize("kernel", WGMMA_KERNELS)
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


@pytest.mark.parametrize("kernel", WGMMA_KERNELS)
def test_a_wgmma_kernel_runs_by_name_at_every_group(monkeypatch: pytest.MonkeyPatch, kernel):
    """Both wgmma kernels pass their GPU tests at GQA groups 1-8: by name, each runs at every one."""
    for group in dispatch.WGMMA_GROUPS:
        assert prefill_kernel(8 * group, 8, 128, kernel) == kernel
    monkeypatch.setenv(PREFILL_KERNEL_ENV, kernel)
    assert [prefill_kernel(8 * group, 8, 128) for group in dispatch.WGMMA_GROUPS] == [kernel] * 8


def test_each_kernel_says_what_it_computes():
    """The numerics (a `mpfa.kernels.reference` variant) and the softmax tiles (its ``block_n``) of each kernel: the
    fp8 kernel's requantized QK and row sums of the e4m3 P over 128 keys, the exact kernel's paper numerics over 64,
    the mma-sync kernel's over 32; the split-KV decode computes the paper's numerics."""
    assert list(PREFILL_KERNELS) == ["fp8", "exact", "mma-sync"]
    assert [k.numerics for k in PREFILL_KERNELS.values()] == ["mpfa-qk8tile-psum", "mpfa", "mpfa"]
    assert [k.softmax_keys for k in PREFILL_KERNELS.values()] == [128, 64, 32]
    assert WGMMA_KERNELS == ["fp8", "exact"]
    assert [name for name, k in PREFILL_KERNELS.items() if k.default] == ["fp8", "mma-sync"]
    assert [name for name, k in PREFILL_KERNELS.items() if k.operand_pass_class] == ["fp8"]
    assert [name for name, k in PREFILL_KERNELS.items() if k.ablations] == ["fp8"]
    assert DECODE_KERNEL.name == "split-kv" and DECODE_KERNEL.numerics == "mpfa"
    assert {k.numerics for k in [*PREFILL_KERNELS.values(), DECODE_KERNEL]} <= set(VARIANTS)


def test_each_declaration_names_its_kernel_classes():
    """The classes each declaration names load (the CuTe DSL is imported then, not with `dispatch`); a wgmma
    kernel's class carries its declaration's name (its shape errors say it: `check_wgmma_shape`)."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is not installed (pip install '.[kernels-compile]')")
    classes = {name: kernel.load_class() for name, kernel in PREFILL_KERNELS.items()}
    assert [cls.__name__ for cls in classes.values()] == ["PrefillSm90Fp8", "PrefillSm90Exact", "PrefillSm90MmaSync"]
    assert [classes[name].name for name in WGMMA_KERNELS] == WGMMA_KERNELS
    assert PREFILL_KERNELS["fp8"].load_operand_pass_class().__name__ == "OperandPass"
    assert [cls.__name__ for cls in DECODE_KERNEL.load_classes()] == ["SplitKVDecodeSm90", "DecodeMergeSm90"]


def test_importing_dispatch_imports_no_cute_dsl():
    code = ("import sys, mpfa.kernels.sm90.dispatch; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'cutlass', 'torch'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
