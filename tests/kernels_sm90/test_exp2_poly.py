"""`ptx.exp2_poly` (v7e's exponentials on the FMA pipe) mirrored step for step in NumPy FP32 on the CPU: its error
against 2**x, its floor, and how rarely it moves an e4m3 P (the GPU tests compare v7e with v7 and the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90.ptx import EXP2_POLY, EXP2_POLY_FLOOR  # noqa: E402

SHIFTER = np.float32(1.5 * 2.0 ** 23)


def _fma(a: np.ndarray, b, c) -> np.ndarray:
    """fma.rn.f32: the FP32 product is exact in FP64, so one rounding of the FP64 sum (up to a double-rounding tie)."""
    return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)


def exp2_poly_mirror(x: np.ndarray) -> np.ndarray:
    """The PTX of `exp2_poly`, instruction for instruction (``max.f32`` ignores a NaN operand, as ``np.fmax``)."""
    c0, c1, c2, c3 = (np.float32(c) for c in EXP2_POLY)
    x = np.fmax(x.astype(np.float32), np.float32(EXP2_POLY_FLOOR))
    t = (x + SHIFTER).astype(np.float32)
    f = (x - (t - SHIFTER).astype(np.float32)).astype(np.float32)
    p = _fma(_fma(_fma(f, c3, c2), f, c1), f, c0)
    bits = (t.view(np.uint32).astype(np.uint64) << np.uint64(23)) + p.view(np.uint32).astype(np.uint64)
    return (bits % (1 << 32)).astype(np.uint32).view(np.float32)


def _e4m3(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.float8_e4m3fn).float().numpy()


def test_relative_error_over_the_softmax_range():
    """From the floor to log2(448) (the largest exponent argument: P times 448 in the exponent), <= 7.5e-5."""
    x = np.random.default_rng(0).uniform(EXP2_POLY_FLOOR + 1, np.log2(448.0), 1_000_000).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, 0.5, -0.5, np.log2(448.0), -100.25])])
    error = np.abs(exp2_poly_mirror(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert error.max() <= 7.5e-5, error.max()


def test_below_the_floor_is_the_floor():
    """-inf (a masked score), anything below -126 and a NaN give 2**-126 (times the cubic at 0): 0 to any e4m3 P,
    and no wrap of the exponent field."""
    out = exp2_poly_mirror(np.float32([-np.inf, -126.0, -127.5, -1e30, np.nan]))
    assert np.all(out == out[0]) and 0 < out[0] < 2.0 ** -125 and np.all(_e4m3(out) == 0)


def test_an_e4m3_p_moves_rarely():
    """Against the exact 2**x, the e4m3 rounding of P (the kernel's P operand) differs for ~1e-4 of the values (the
    cubic's error lands them across a rounding boundary); the row maximum's P (x = log2(448)) is exactly 448."""
    x = np.random.default_rng(1).uniform(-20.0, np.log2(448.0), 2_000_000).astype(np.float32)
    exact = np.exp2(x.astype(np.float64)).astype(np.float32)
    moved = _e4m3(exact) != _e4m3(exp2_poly_mirror(x))
    assert 0 < moved.mean() < 1e-3, moved.mean()
    assert _e4m3(exp2_poly_mirror(np.float32([np.log2(448.0)])))[0] == 448.0
