"""Bit-exact NVFP4 and FP8 (e4m3) formats used by MpFA.

NVFP4 (as NVIDIA defines it for Blackwell block-scaled MMA, here used as a storage/compute format):

* Blocks of ``NVFP4_BLOCK`` = 16 consecutive elements along the last dimension (head_dim for Q/K).
* Block scale ``s = amax / 6`` computed in FP32, then cast to FP8 e4m3 (``torch.float8_e4m3fn``) with
  round-to-nearest-even. With the optional per-tensor FP32 global scale ``g`` the stored scale is
  ``e4m3(amax / 6 / g)`` (both divisions in FP32) and the decoded scale is ``e4m3 * g``.
* Scale edge cases:
  - all-zero block: scale 0, codes 0, dequantizes to 0 (no division by zero);
  - nonzero block whose scale rounds to 0 (``amax / 6 <= 2**-10``, half the smallest e4m3 subnormal): the block is
    flushed to zero (scale 0, codes 0), as NVIDIA's reference conversion does; the global scale avoids this for
    tensors whose values are all tiny;
  - scale that rounds to an e4m3 subnormal (``2**-10 < amax / 6 < 2**-6``): kept; its coarser rounding only means
    more elements saturate at +-6;
  - scale whose RNE cast overflows e4m3 (``amax / 6 > 464``; 448 is the largest finite e4m3fn value and 464 the
    tie that still rounds to it): ``FormatError`` naming the global scale as the fix, never a silent NaN block.
* Elements: ``x / s_decoded`` in FP32 (a true division), rounded to e2m1 (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) with
  round-to-nearest, ties to the even code, saturating at +-6. Code bits: sign bit 3, exponent bits 2-1, mantissa
  bit 0. Values that round to zero keep their sign (code 0x8 for negatives, as IEEE conversions and CUDA's cvt).
* Packing: two codes per byte, element ``2i`` in the LOW nibble, ``2i+1`` in the high nibble (the layout of
  ``torch.float4_e2m1fn_x2`` and CUDA's ``__nv_fp4x2_e2m1``). Scales live in their own tensor.
* NaN/Inf input: ``FormatError`` (a ``ValueError``).
* "4/6" block scales (``scale_choice="4/6"``, for the K cache): each block is also encoded with its
  max scaled to 4 instead of 6 (finer steps near the max: 3, 4 instead of 4, 6) and keeps the encoding with the
  smaller sum of squared errors; the stored format and its decoding are unchanged.

FP8 e4m3 (K/V in the FP8 baseline, V and P in MpFA): ``cast_rne(x / scale)`` saturating at +-448 (like CUDA's
``cvt.rn.satfinite``); NaN/Inf input is an error. P uses the fixed analytic scale 448 (P is in [0, 1]):
``P_hat = cast_e4m3(448 * P) / 448``.

Power-of-two e4m3 requantization (NVFP4 Q/K for an FP8 MMA, which applies one scale per operand row or tile outside
the MMA instead of NVFP4's 16-element block scales): one scale ``2**e`` per group of elements, ``e`` the smallest
integer with ``amax / 2**e <= 448``, so nothing saturates and the group's max lands in (224, 448]; then
``cast_rne(x / 2**e) * 2**e``. A power of two keeps both rescalings exact, so the e4m3 rounding is the only error:
at most 2**-4 relative for elements within 2**13.8 of the group's max (e4m3 normals: the same rounding whatever the
scale, so the group's extent matters only below that), at most 2**-10 * 2**e absolute below (subnormals). NVFP4
values need up to 6 significant bits (e2m1 1.5 times a 4-bit e4m3 block scale); e4m3 keeps 4. Aligning the max to
the top binade instead ([256, 512)) would keep one more binade normal at the bottom of the groups whose max it puts
in (448, 512), where elements barely count in a dot product, but saturate those maxima. An all-zero group gets scale 1
(zeros).

V scale policy: 1.0 (the FlashInfer FP8 KV-cache default in SGLang), optionally one FP32 scale per (layer, KV head)
folded into the output (free in the kernel). e4m3's relative precision does not depend on the scale while values are
normal (|v| >= 2**-6): on Gaussian V, 1.0 matches a per-tensor amax/448 scale for RMS >= ~0.1, is ~10% worse at
RMS 0.03 and several times worse below 0.01, where values become e4m3 subnormals (a test measures both regimes).
A per-token V scale is avoided: it would multiply P's columns before P's own FP8 cast. Whether real V needs the
per-head scale is for the real-activation accuracy study to measure (V RMS per layer). Likewise NVFP4's per-tensor
global scale is only needed when a block amax exceeds 6 * 464 or a nonzero block's falls below 6 * 2**-10; post-RoPE
Q/K activations are expected to sit well inside that range, which the same study should confirm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of e2m1 codes 0..7 (code | 0x8 is the negative)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
P_FP8_SCALE = 448.0

E4M3_OVERFLOW = 464.0  # values above this round (RNE) past E4M3_MAX
# Midpoint i lies between codes i and i+1; a tie goes to the even code, i.e. up exactly when i is odd.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


class FormatError(ValueError):
    """Input a quantization format cannot represent (NaN/Inf, scale overflow, bad shape)."""


@dataclass(frozen=True)
class NVFP4Tensor:
    """NVFP4 data: ``codes`` uint8 [..., n/2] (two e2m1 codes per byte, low nibble first), ``scales``
    float8_e4m3fn [..., n/16], and the optional FP32 per-tensor ``global_scale`` (0-dim tensor)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None = None


def _divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """IEEE (correctly rounded) ``x / divisor`` on every device: CUDA turns division by a Python scalar into a
    multiplication by its rounded reciprocal, which would change roundings against the CPU."""
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise FormatError(f"{what} contains NaN or Inf; cannot quantize")


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to e2m1 codes (uint8 in 0..15): RNE, ties to even, saturating at +-6."""
    _check_finite(v, "e2m1 input")
    mag = v.float().abs().unsqueeze(-1)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=v.device)
    tie_up = torch.tensor(_E2M1_TIE_UP, device=v.device)
    magnitude_code = ((mag > mids) | ((mag == mids) & tie_up)).sum(-1, dtype=torch.uint8)
    return magnitude_code | (torch.signbit(v).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, low 4 bits used) -> FP32 values."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes -> [..., n/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise FormatError(f"cannot pack an odd number ({codes.shape[-1]}) of e2m1 codes")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] codes (inverse of ``pack_e2m1``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _as_global_scale(global_scale: float | torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if global_scale is None:
        return None
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.dim() != 0 or not bool(torch.isfinite(g)) or not bool(g > 0):
        raise FormatError(f"NVFP4 global_scale must be a positive finite scalar, got {global_scale!r}")
    return g


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """NVIDIA's per-tensor FP32 decode scale ``amax(x) / (448 * 6)``, mapping the largest block scale to 448.

    An all-zero tensor gets 1.0 (any positive scale encodes zeros)."""
    _check_finite(x, "NVFP4 input")
    amax = x.detach().float().abs().amax()
    return torch.where(amax > 0, _divide(amax, E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def _block_scale(blocks: torch.Tensor, target: float, g: torch.Tensor | None) -> torch.Tensor:
    """FP32 scale [..., nb] that maps each block's max to ``target`` (6: NVFP4's ``amax / 6``; 4: the 4/6 choice's
    alternative), before its e4m3 rounding."""
    scale = _divide(blocks.abs().amax(-1), target)
    return scale if g is None else scale / g


def _encode_blocks(blocks: torch.Tensor, scale: torch.Tensor,
                   g: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., nb, 16] and e4m3 scales [..., nb] of FP32 blocks with the FP32 block ``scale`` (`_block_scale`).
    Scales beyond e4m3's range saturate at 448 (callers check)."""
    scales = scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    decoded = scales.float() if g is None else scales.float() * g
    nonzero = (decoded > 0).unsqueeze(-1)
    safe = torch.where(nonzero, decoded.unsqueeze(-1), torch.ones_like(decoded).unsqueeze(-1))
    scaled = torch.where(nonzero, blocks / safe, torch.zeros_like(blocks))
    return encode_e2m1(scaled), scales


def _block_values(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    decoded = scales.float() if g is None else scales.float() * g
    return decode_e2m1(codes) * decoded.unsqueeze(-1)


NVFP4_SCALE_CHOICES = ("6", "4/6")


def quantize_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor | None = None, *,
                   scale_choice: str = "6") -> NVFP4Tensor:
    """Quantize along the last dimension (a multiple of 16) to NVFP4; see the module docstring for rounding rules.

    ``scale_choice="4/6"``: per block, also encode with the block max scaled to 4 (scale ``e4m3(amax / 4)``, where
    that scale fits e4m3) and keep whichever encoding has the smaller sum of squared errors of its 16 dequantized
    values against the FP32 input (ties: 6). Decoding is unchanged: only the encoder chooses."""
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise FormatError(f"NVFP4 needs a last dimension that is a multiple of {NVFP4_BLOCK}, got {tuple(x.shape)}")
    if scale_choice not in NVFP4_SCALE_CHOICES:
        raise FormatError(
            f"unknown NVFP4 scale choice {scale_choice!r}; choose one of {', '.join(NVFP4_SCALE_CHOICES)}")
    _check_finite(x, "NVFP4 input")
    g = _as_global_scale(global_scale, x.device)
    blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK))
    scale = _block_scale(blocks, E2M1_MAX, g)
    if scale.numel() and bool((scale > E4M3_OVERFLOW).any()):
        raise FormatError(
            f"NVFP4 block scale amax/6 = {float(scale.max()):.6g} overflows e4m3 (max {E4M3_MAX:g}); "
            "pass global_scale=nvfp4_global_scale(x)"
        )
    codes, scales = _encode_blocks(blocks, scale, g)
    if scale_choice == "4/6":
        scale4 = _block_scale(blocks, 4.0, g)
        codes4, scales4 = _encode_blocks(blocks, scale4, g)
        errors = [(_block_values(c, s, g).double() - blocks.double()).square().sum(-1)
                  for c, s in ((codes, scales), (codes4, scales4))]
        use4 = (errors[1] < errors[0]) & (scale4 <= E4M3_OVERFLOW)
        codes = torch.where(use4.unsqueeze(-1), codes4, codes)
        scales = torch.where(use4, scales4.view(torch.uint8), scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    return NVFP4Tensor(pack_e2m1(codes.flatten(-2)), scales, g)


def dequantize_nvfp4(t: NVFP4Tensor) -> torch.Tensor:
    """NVFP4 -> FP32 values ``e2m1 * scale (* global_scale)``."""
    values = decode_e2m1(unpack_e2m1(t.codes)).unflatten(-1, (-1, NVFP4_BLOCK))
    decoded = t.scales.float() if t.global_scale is None else t.scales.float() * t.global_scale
    return (values * decoded.unsqueeze(-1)).flatten(-2)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor | None = None, *,
                     scale_choice: str = "6") -> torch.Tensor:
    """``dequantize_nvfp4(quantize_nvfp4(x, global_scale, scale_choice=scale_choice))`` in FP32."""
    return dequantize_nvfp4(quantize_nvfp4(x, global_scale, scale_choice=scale_choice))


def _as_fp8_scale(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise FormatError("FP8 scale must be positive and finite")
    return s


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``cast_rne_e4m3(x / scale)`` saturating at +-448; ``scale`` is a float or a broadcastable FP32 tensor."""
    _check_finite(x, "FP8 input")
    scaled = x.float() / _as_fp8_scale(scale, x.device)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x8: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """e4m3 tensor -> FP32 ``x8 * scale``."""
    return x8.float() * _as_fp8_scale(scale, x8.device)


def fake_quant_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``dequantize_fp8(quantize_fp8(x, scale), scale)`` in FP32."""
    return dequantize_fp8(quantize_fp8(x, scale), scale)


def e4m3_amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """A calibrated e4m3 scale per group from its largest magnitude: ``amax / 448`` (the group's largest value maps
    to e4m3's largest), 1 for an all-zero group."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def e4m3_pow2_scale(x: torch.Tensor, dim: int | tuple[int, ...] = -1) -> torch.Tensor:
    """Power-of-two scale ``2**e`` per group of ``x`` (the elements along ``dim``, kept as size-1 dims): ``e`` the
    smallest integer with ``amax / 2**e <= 448``, at least -126 (the scale stays a normal FP32 number; only groups
    with amax below 448 * 2**-126 notice); 1 for an all-zero group. NaN/Inf input is an error."""
    _check_finite(x, "e4m3 requantization input")
    amax = x.float().abs().amax(dim, keepdim=True)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # 448 = 0.875 * 2**9: amax <= 448 * 2**e  <=>  mantissa <= 0.875 * 2**(e + 9 - exponent)
    e = (exponent - 9 + (mantissa > 0.875).int()).clamp(min=-126)
    return torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), torch.ones_like(amax))


def fake_quant_fp8_pow2(x: torch.Tensor, dim: int | tuple[int, ...] = -1) -> torch.Tensor:
    """``x`` through e4m3 with one power-of-two scale per group along ``dim`` (`e4m3_pow2_scale`), in FP32."""
    return fake_quant_fp8(x, e4m3_pow2_scale(x, dim))


def fake_quant_p_fp8(p: torch.Tensor) -> torch.Tensor:
    """Softmax numerators P in [0, 1] through FP8 with the analytic scale 448: ``cast_e4m3(448 * P) / 448``.

    The kernel keeps ``448 * P`` in FP8 and divides once at the end; dividing here in FP32 differs from that by at
    most one FP32 rounding (2**-24 relative)."""
    _check_finite(p, "P")
    return _divide((p.float() * P_FP8_SCALE).to(torch.float8_e4m3fn).float(), P_FP8_SCALE)
