"""`ptx.exp2_poly` (v7e's exponentials on the FMA pipe) mirrored step for step in NumPy FP32 on the CPU: its error
against 2**x, its floor, NaN, and how rarely it moves an e4m3 P; on the GPU, the PTX itself against the mirror, bit
for bit (the prefill GPU tests compare v7e with v7 and the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpfa.kernels.sm90.compile import target_sm90a

target_sm90a()  # before cutlass is imported
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from mpfa.kernels.sm90.compile import compile_kernel, fake_tensor  # noqa: E402
from mpfa.kernels.sm90.ptx import EXP2_POLY, EXP2_POLY_FLOOR, exp2_poly  # noqa: E402

SHIFTER = np.float32(1.5 * 2.0 ** 23)


def _fma(a: np.ndarray, b, c) -> np.ndarray:
    """fma.rn.f32: the FP32 product is exact in FP64, so one rounding of the FP64 sum (up to a double-rounding tie)."""
    return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)


def exp2_poly_mirror(x: np.ndarray) -> np.ndarray:
    """The PTX of `exp2_poly`, instruction for instruction."""
    c0, c1, c2, c3 = (np.float32(c) for c in EXP2_POLY)
    with np.errstate(invalid="ignore"):
        x = np.maximum(x.astype(np.float32), np.float32(EXP2_POLY_FLOOR))  # max.NaN: a NaN stays NaN
    t = (x + SHIFTER).astype(np.float32)
    f = (x - (t - SHIFTER).astype(np.float32)).astype(np.float32)
    p = _fma(_fma(_fma(f, c3, c2), f, c1), f, c0)
    bits = ((t.view(np.uint32).astype(np.uint64) << np.uint64(23)) + np.uint64(0x3F800000)) % (1 << 32)
    scale = bits.astype(np.uint32).view(np.float32)  # 2**n
    return (p.astype(np.float64) * scale.astype(np.float64)).astype(np.float32)  # exact product, one rounding


def _e4m3(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.float8_e4m3fn).float().numpy()


def test_relative_error_over_the_softmax_range():
    """From the floor to log2(448) (the largest exponent argument: P times 448 in the exponent), <= 7.5e-5."""
    x = np.random.default_rng(0).uniform(EXP2_POLY_FLOOR + 1, np.log2(448.0), 1_000_000).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, 0.5, -0.5, np.log2(448.0), -100.25])])
    error = np.abs(exp2_poly_mirror(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert error.max() <= 7.5e-5, error.max()


def test_below_the_floor_is_the_floor_and_nan_stays():
    """-inf (a masked score) and anything below -126 give 2**-126 (times the cubic at 0): 0 to any e4m3 P, and no
    wrap of the exponent field; a NaN score stays NaN, as with ``ex2.approx``."""
    out = exp2_poly_mirror(np.float32([-np.inf, -126.0, -127.5, -1e30]))
    assert np.all(out == out[0]) and 0 < out[0] < 2.0 ** -125 and np.all(_e4m3(out) == 0)
    assert np.isnan(exp2_poly_mirror(np.float32([np.nan])))[0]


def test_an_e4m3_p_moves_rarely():
    """Against the exact 2**x, the e4m3 rounding of P (the kernel's P operand) differs for ~3-5e-4 of the values
    (the cubic's error lands them across a rounding boundary); the row maximum's P (x = log2(448)) is exactly 448."""
    x = np.random.default_rng(1).uniform(-20.0, np.log2(448.0), 2_000_000).astype(np.float32)
    exact = np.exp2(x.astype(np.float64)).astype(np.float32)
    moved = _e4m3(exact) != _e4m3(exp2_poly_mirror(x))
    assert 0 < moved.mean() < 1e-3, moved.mean()
    assert _e4m3(exp2_poly_mirror(np.float32([np.log2(448.0)])))[0] == 448.0


class _Exp2PolyKernel:
    """y = exp2_poly(x), one value per thread: the PTX under test, alone."""

    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, stream):
        self.kernel(x, y).launch(grid=((x.shape[0] + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, y: cute.Tensor):
        i = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        if i < x.shape[0]:
            y[i] = exp2_poly(x[i])


def _compiled():
    vector = fake_tensor(cutlass.Float32, (None,), align=4)
    return compile_kernel(_Exp2PolyKernel(), vector, vector)


def test_the_kernel_compiles_for_sm90a():
    assert _compiled() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ptx_is_the_mirror_bit_for_bit():
    """The PTX on the GPU against the NumPy mirror: a million random x over the softmax's range and the edges
    (-inf, NaN, the floor, halves where the rounding trick ties, log2(448)); the output poisoned before the launch.
    The mirror's FMA rounds an FP64 sum (exact product) to FP32: a double rounding that can differ from the FMA's
    single rounding by an ulp, at odds of ~2**-29 per FMA."""
    rng = np.random.default_rng(2)
    edges = np.float32([-np.inf, np.nan, EXP2_POLY_FLOOR, -126.5, -0.5, 0.5, 1.5, -3.5, 0.0, np.log2(448.0), 9.0])
    x = np.concatenate([rng.uniform(-130.0, 9.0, 1_000_000).astype(np.float32), edges])
    x_gpu = torch.from_numpy(x).cuda()
    y = torch.full_like(x_gpu, float("nan"))
    y.view(torch.int32).fill_(0x7FA00000)  # a NaN payload the kernel never writes
    _compiled()(x_gpu, y)
    torch.cuda.synchronize()
    got, want = y.cpu().numpy().view(np.uint32), exp2_poly_mirror(x).view(np.uint32)
    assert not np.any(got == 0x7FA00000), "values left unwritten"
    nan_at = len(x) - len(edges) + 1
    assert np.isnan(y.cpu().numpy()[nan_at])  # the NaN stays NaN (its payload is the GPU's, 0x7FFFFFFF on the H100)
    differ = got != want
    differ[nan_at] = False
    assert differ.sum() <= 2 and np.all(np.abs(got[differ].astype(np.int64) - want[differ].astype(np.int64)) <= 1)
