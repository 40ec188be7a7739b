"""Bit-exact format conversions as Triton device functions, shared by the element-wise Triton kernels.

Rounding is done with integer operations on the FP32 bit patterns rather than Triton's float casts, so the CPU
interpreter (``TRITON_INTERPRET=1``, whose FP8 cast is not round-to-nearest-even) and the GPU give the same bits
as `mpfa.kernels.formats`. Divisions use ``div_rn`` (plain ``/`` compiles to an approximate division).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import E4M3_OVERFLOW

_E4M3_MIN_NORMAL_EXP = tl.constexpr(121)  # biased FP32 exponent of 2**-6, the smallest normal e4m3 value
_E4M3_OVERFLOW = tl.constexpr(E4M3_OVERFLOW)  # a block scale above it does not fit e4m3


@triton.jit
def e4m3_code(x):
    """FP32 -> e4m3fn code (int32 0..255, sign in bit 7), round to nearest even; |x| must be <= 448 (clamp first)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal results: keep 3 mantissa bits, ties to even (a carry into the exponent is the correct result).
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    # Subnormal results (|x| < 2**-6): round |x| * 2**9 to an integer, ties to even; 8 is the smallest normal.
    shift = tl.minimum(141 - (mag >> 23), 25)
    mantissa = (mag & 0x7FFFFF) | 0x800000
    subnormal = (mantissa + (1 << (shift - 1)) - 1 + ((mantissa >> shift) & 1)) >> shift
    return tl.where((mag >> 23) >= _E4M3_MIN_NORMAL_EXP, normal, subnormal) | sign


@triton.jit
def e4m3_value(code):
    """Non-negative e4m3fn code (int32) -> FP32 value."""
    exponent = code >> 3
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    return tl.where(exponent > 0, normal, mantissa.to(tl.float32) * 0.001953125)


@triton.jit
def bf16_bits(x):
    """Finite FP32 -> BF16 bit pattern (int32 0..65535), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def e2m1_code(v):
    """Scaled FP32 value -> e2m1 code (int32 0..15): nearest, ties to the even code, saturating at 6, sign kept."""
    mag = tl.abs(v)
    magnitude = (
        (mag > 0.25).to(tl.int32)
        + (mag >= 0.75).to(tl.int32)
        + (mag > 1.25).to(tl.int32)
        + (mag >= 1.75).to(tl.int32)
        + (mag > 2.5).to(tl.int32)
        + (mag >= 3.5).to(tl.int32)
        + (mag > 5.0).to(tl.int32)
    )
    return magnitude | ((v.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def e2m1_magnitude(code):
    """e2m1 code (int32, sign bit ignored) -> its magnitude in FP32: 0, 0.5, then 1.0 * 2**e or 1.5 * 2**e."""
    m = code & 7
    normal = ((((m >> 1) + 126) << 23) | ((m & 1) << 22)).to(tl.float32, bitcast=True)
    return tl.where(m >= 2, normal, m.to(tl.float32) * 0.5)


@triton.jit
def _nvfp4_encode(even, odd, amax, TARGET: tl.constexpr):
    """Blocks' e2m1 codes (even, odd elements) and e4m3 scale codes with each block's max scaled to ``TARGET``
    (scale ``e4m3(amax / TARGET)`` saturated at 448); a block whose scale is 0 gets codes 0. Also the decoded
    scale [..., 1]."""
    scale_code = e4m3_code(tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, TARGET, tl.float32)), 448.0))
    scale = tl.expand_dims(e4m3_value(scale_code), len(scale_code.shape))
    nonzero = scale > 0
    safe = tl.where(nonzero, scale, 1.0)
    lo = tl.where(nonzero, e2m1_code(tl.math.div_rn(even, safe)), 0)
    hi = tl.where(nonzero, e2m1_code(tl.math.div_rn(odd, safe)), 0)
    return lo, hi, scale_code, scale


@triton.jit
def _squared_error(even, odd, lo, hi, scale):
    """Each block's sum of squared errors of its dequantized values against the FP32 input, in FP64 as the
    reference forms it (a code's sign is its element's: magnitudes suffice)."""
    d_even = (e2m1_magnitude(lo) * scale).to(tl.float64) - tl.abs(even).to(tl.float64)
    d_odd = (e2m1_magnitude(hi) * scale).to(tl.float64) - tl.abs(odd).to(tl.float64)
    return tl.sum(d_even * d_even, axis=-1) + tl.sum(d_odd * d_odd, axis=-1)


@triton.jit
def nvfp4_block(even, odd, SCALE_46: tl.constexpr):
    """NVFP4 of blocks held as their even and odd elements [..., 8] -> (packed bytes [..., 8], scale codes [...]).

    Scale ``e4m3(amax / 6)`` (saturated at 448 where the reference raises), elements ``x / scale`` to e2m1; a block
    whose scale is 0 gets codes 0. Byte i of a block holds element 2i (low nibble) and 2i+1 (high nibble).
    ``SCALE_46``: the "4/6" choice of `formats.quantize_nvfp4`: a block also encoded with ``e4m3(amax / 4)`` (where
    ``amax / 4`` fits e4m3) keeps that encoding if its sum of squared errors is smaller (ties: 6). The FP64 sums add
    the same squares in another order than the reference's: two errors within one FP64 rounding of each other could
    choose differently."""
    amax = tl.maximum(tl.max(tl.abs(even), axis=-1), tl.max(tl.abs(odd), axis=-1))
    lo, hi, scale_code, scale = _nvfp4_encode(even, odd, amax, 6.0)
    if SCALE_46:
        lo4, hi4, scale_code4, scale4 = _nvfp4_encode(even, odd, amax, 4.0)
        fits = tl.math.div_rn(amax, tl.full(amax.shape, 4.0, tl.float32)) <= _E4M3_OVERFLOW
        use4 = fits & (_squared_error(even, odd, lo4, hi4, scale4) < _squared_error(even, odd, lo, hi, scale))
        lo = tl.where(tl.expand_dims(use4, len(use4.shape)), lo4, lo)
        hi = tl.where(tl.expand_dims(use4, len(use4.shape)), hi4, hi)
        scale_code = tl.where(use4, scale_code4, scale_code)
    return lo | (hi << 4), scale_code
