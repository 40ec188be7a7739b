"""Bit-exactness of the e2m1, NVFP4 and e4m3 formats against brute-force nearest-value oracles."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import (E2M1_GRID, FormatError, decode_e2m1, dequantize_fp8, dequantize_nvfp4, e4m3_pow2_scale,
                          encode_e2m1, fake_quant_fp8, fake_quant_fp8_pow2, fake_quant_nvfp4, fake_quant_p_fp8,
                          nvfp4_global_scale, pack_e2m1, quantize_fp8, quantize_nvfp4, unpack_e2m1)

# Code -> value, written out from the e2m1 definition (sign bit 3, exponent bits 2-1, mantissa bit 0, bias 1).
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# Exact midpoints and the code a tie goes to (the even one).
E2M1_TIES = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}


def nearest_code(values: torch.Tensor, grid: torch.Tensor, saturate_at: float) -> torch.Tensor:
    """Brute force: index of the nearest grid magnitude (ties to the even index), saturating; sign handled by caller."""
    mag = values.double().abs().clamp(max=saturate_at).unsqueeze(-1)
    dist = (mag - grid.double()).abs()
    best = dist.min(-1, keepdim=True).values
    candidates = dist == best
    even_first = torch.where(candidates, torch.arange(grid.numel()) % 2, 2)  # prefer even indices among ties
    return even_first.argmin(-1)


def oracle_e2m1(values: torch.Tensor) -> torch.Tensor:
    code = nearest_code(values, torch.tensor(E2M1_GRID), 6.0)
    return (code | (torch.signbit(values).long() << 3)).to(torch.uint8)


def e4m3_positive_values() -> torch.Tensor:
    """All finite non-negative e4m3fn values in code order 0..126, from the bit layout (bias 7, subnormals)."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


def oracle_e4m3_bits(values: torch.Tensor) -> torch.Tensor:
    code = nearest_code(values, e4m3_positive_values(), 448.0)
    return (code | (torch.signbit(values).long() << 7)).to(torch.uint8)


def within_nvfp4_rounding(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> bool:
    """Nearest rounding on the e2m1 grid: error <= one scale unit (half the widest gap, 4..6), or the excess over
    6 * scale for saturated elements (a scale that rounded down, e.g. a coarse subnormal one)."""
    unit = scale.repeat_interleave(16, -1)
    return bool(((deq - x).abs() <= torch.maximum(unit, x.abs() - 6 * unit)).all())


def test_decode_every_e2m1_code() -> None:
    decoded = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(decoded, torch.tensor(E2M1_TABLE))
    assert torch.equal(torch.signbit(decoded), torch.arange(16) >= 8)
    assert torch.equal(encode_e2m1(decoded), torch.arange(16, dtype=torch.uint8))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_rounding_boundaries_ties_to_even(sign: float) -> None:
    ties = torch.tensor(list(E2M1_TIES), dtype=torch.float32)
    below = torch.nextafter(ties, torch.zeros_like(ties))
    above = torch.nextafter(ties, torch.full_like(ties, 10.0))
    sign_bit = 8 if sign < 0 else 0
    expected_tie = torch.tensor(list(E2M1_TIES.values()), dtype=torch.uint8) | sign_bit
    lower = torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.uint8) | sign_bit
    assert torch.equal(encode_e2m1(sign * ties), expected_tie)
    assert torch.equal(encode_e2m1(sign * below), lower)
    assert torch.equal(encode_e2m1(sign * above), lower + 1)


def test_e2m1_saturates_and_keeps_sign_of_zero() -> None:
    values = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, -6.5, -1e30, 0.1, -0.1, -0.0, 0.0])
    expected = torch.tensor([7, 7, 7, 7, 7, 15, 15, 0, 8, 8, 0], dtype=torch.uint8)
    assert torch.equal(encode_e2m1(values), expected)


def test_e2m1_random_values_match_brute_force(gen: torch.Generator) -> None:
    values = (torch.rand(50_000, generator=gen) - 0.5) * 16
    assert torch.equal(encode_e2m1(values), oracle_e2m1(values))


def test_e2m1_rejects_nan_and_inf() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(FormatError):
            encode_e2m1(torch.tensor([1.0, bad]))


def test_pack_low_nibble_first_and_round_trip(gen: torch.Generator) -> None:
    assert pack_e2m1(torch.tensor([0x1, 0x2, 0xF, 0x8], dtype=torch.uint8)).tolist() == [0x21, 0x8F]
    codes = torch.randint(0, 16, (7, 64), generator=gen, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    with pytest.raises(FormatError):
        pack_e2m1(codes[:, :3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packing_agrees_with_torch_float4_e2m1fn_x2(gen: torch.Generator) -> None:
    """torch.float4_e2m1fn_x2 stores element 2i in the low nibble; compared where torch converts it (its CPU build
    has no float4 copy kernel)."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch has no float4_e2m1fn_x2")
    codes = torch.randint(0, 16, (4, 32), generator=gen, dtype=torch.uint8)
    try:
        decoded = pack_e2m1(codes).cuda().view(torch.float4_e2m1fn_x2).to(torch.float32).cpu()
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch cannot convert float4_e2m1fn_x2: {err}")
    assert torch.equal(decoded.reshape(codes.shape), decode_e2m1(codes))


def test_nvfp4_scales_and_codes_match_brute_force(gen: torch.Generator) -> None:
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-2, 2, 64).unsqueeze(-1)
    t = quantize_nvfp4(x.bfloat16())
    blocks = x.bfloat16().float().unflatten(-1, (-1, 16))
    expected_scale_bits = oracle_e4m3_bits(blocks.abs().amax(-1) / 6)
    assert t.scales.dtype == torch.float8_e4m3fn and t.codes.shape == (64, 64) and t.scales.shape == (64, 8)
    assert torch.equal(t.scales.view(torch.uint8), expected_scale_bits)
    expected_codes = oracle_e2m1(blocks / t.scales.float().unsqueeze(-1)).flatten(-2)
    assert torch.equal(unpack_e2m1(t.codes), expected_codes)
    deq = dequantize_nvfp4(t)
    expected = decode_e2m1(expected_codes).unflatten(-1, (-1, 16)) * t.scales.float()[..., None]
    assert torch.equal(deq, expected.flatten(-2))
    assert within_nvfp4_rounding(x.bfloat16().float(), deq, t.scales.float())


def test_nvfp4_zero_block_gives_zero_scale_and_codes(gen: torch.Generator) -> None:
    x = torch.randn(2, 32, generator=gen)
    x[1, 16:] = 0.0
    t = quantize_nvfp4(x)
    assert t.scales.float()[1, 1] == 0 and torch.equal(unpack_e2m1(t.codes)[1, 16:], torch.zeros(16, dtype=torch.uint8))
    assert torch.equal(dequantize_nvfp4(t)[1, 16:], torch.zeros(16))
    assert bool(torch.isfinite(dequantize_nvfp4(t)).all())


def test_nvfp4_scale_underflow_flushes_block(gen: torch.Generator) -> None:
    """amax/6 <= 2**-10 rounds (ties to even) to a zero scale: the block flushes to zero; just above -> 2**-9."""
    base = torch.rand(3, 16, generator=gen) * 0.5 + 0.25
    amax = torch.tensor([6 * 2.0**-11, 6 * 2.0**-10, 6 * 2.0**-10 * 1.01])
    x = base / base.amax(-1, keepdim=True) * amax.unsqueeze(-1)
    t = quantize_nvfp4(x)
    assert t.scales.float().flatten().tolist() == [0.0, 0.0, 2.0**-9]
    assert torch.equal(dequantize_nvfp4(t)[:2], torch.zeros(2, 16))
    assert dequantize_nvfp4(t)[2].abs().max() > 0


def test_nvfp4_subnormal_scale_saturates_elements(gen: torch.Generator) -> None:
    """A subnormal scale (3.4 * 2**-9 -> 3 * 2**-9) rounds down: the block max lands above 6 and saturates."""
    x = (torch.rand(16, generator=gen) - 0.5) * 0.01
    x[5] = 6 * 3.4 * 2.0**-9
    t = quantize_nvfp4(x)
    assert t.scales.view(torch.uint8).item() == 3
    codes = unpack_e2m1(t.codes)
    assert codes[5].item() == 7
    assert torch.equal(codes, oracle_e2m1(x / (3 * 2.0**-9)))


def test_nvfp4_scale_range_limit_and_global_scale(gen: torch.Generator) -> None:
    block = torch.rand(16, generator=gen) + 0.5
    at_max = block / block.max() * (448 * 6)
    tie = block / block.max() * (464 * 6)  # amax/6 = 464, the tie that still rounds (to even) to 448
    assert quantize_nvfp4(at_max).scales.float().item() == 448
    assert quantize_nvfp4(tie).scales.float().item() == 448
    over = block / block.max() * (470 * 6)
    with pytest.raises(FormatError, match="global_scale"):
        quantize_nvfp4(over)
    big = torch.randn(8, 64, generator=gen) * 1e4
    g = nvfp4_global_scale(big)
    assert g.item() == pytest.approx(big.abs().max().item() / 2688, rel=1e-6)
    t = quantize_nvfp4(big, g)
    assert t.scales.float().max().item() == 448
    assert within_nvfp4_rounding(big, dequantize_nvfp4(t), t.scales.float() * g)


def test_nvfp4_rejects_bad_input() -> None:
    with pytest.raises(FormatError):
        quantize_nvfp4(torch.ones(2, 24))
    for bad in (float("nan"), float("inf")):
        x = torch.ones(32)
        x[3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            fake_quant_nvfp4(x)
    with pytest.raises(FormatError):
        quantize_nvfp4(torch.ones(16), global_scale=0.0)


def test_fp8_matches_brute_force_and_saturates(gen: torch.Generator) -> None:
    x = torch.randn(20_000, generator=gen) * torch.logspace(-4, 2.5, 20_000)
    x8 = quantize_fp8(x)
    assert torch.equal(x8.view(torch.uint8), oracle_e4m3_bits(x))
    assert torch.equal(quantize_fp8(torch.tensor([500.0, -1e9])).float(), torch.tensor([448.0, -448.0]))
    scale = torch.tensor(0.01)
    assert torch.equal(dequantize_fp8(quantize_fp8(x, scale), scale), quantize_fp8(x / scale).float() * scale)
    with pytest.raises(FormatError):
        quantize_fp8(torch.tensor([1.0, float("nan")]))


def test_p_fp8_uses_analytic_scale_448(gen: torch.Generator) -> None:
    p = torch.rand(10_000, generator=gen)
    p[:3] = torch.tensor([1.0, 0.0, 1e-7])
    expected = e4m3_positive_values()[nearest_code(p.double() * 448, e4m3_positive_values(), 448.0)] / 448
    assert torch.equal(fake_quant_p_fp8(p), expected.float())


def test_fp8_v_scale_one_is_enough_unless_v_is_tiny(gen: torch.Generator) -> None:
    """Policy check for V's FP8 scale 1.0: for RMS >= 0.1 it matches a per-tensor amax/448 scale within 1% of the
    error; at RMS 0.003 most values are e4m3 subnormals and scale 1.0 is several times worse."""

    def rel_error(v: torch.Tensor, scale: float | torch.Tensor) -> float:
        return float((dequantize_fp8(quantize_fp8(v, scale), scale) - v).norm() / v.norm())

    for rms, ratio in ((0.1, 1.01), (1.0, 1.01), (10.0, 1.01)):
        v = torch.randn(4096, 128, generator=gen) * rms
        assert rel_error(v, 1.0) <= ratio * rel_error(v, v.abs().max() / 448)
    tiny = torch.randn(4096, 128, generator=gen) * 0.003
    assert rel_error(tiny, 1.0) > 3 * rel_error(tiny, tiny.abs().max() / 448)


def oracle_pow2_scale(x: torch.Tensor) -> torch.Tensor:
    """Brute force per row: the smallest 2**e, e in [-40, 40], with amax / 2**e <= 448 (1 for a zero row)."""
    amax = x.double().abs().amax(-1, keepdim=True)
    powers = 2.0 ** torch.arange(-40, 41, dtype=torch.float64)
    fits = amax / powers <= 448  # [rows, 81]: True from the first fitting exponent on
    return torch.where(amax > 0, powers[fits.long().argmax(-1, keepdim=True)], 1.0).float()


def test_pow2_requantization_hand_checked() -> None:
    """A block at the largest NVFP4 block scale (6 * 448 = 2688): 2688 / 8 = 336 is an e4m3 tie (320 | 352) and goes
    to the even 320; 672 / 8 = 84 ties (80 | 88) to 80. With scale 1, e4m3 subnormals (multiples of 2**-9): 2**-7
    is exact, 1.5 and 2.5 * 2**-9 tie to 2 * 2**-9, 0.5 * 2**-9 ties to 0."""
    block = torch.zeros(16)
    block[:3] = torch.tensor([2688.0, -672.0, 1.5 * 448])
    x = fake_quant_nvfp4(block)
    assert x[:3].tolist() == [2688.0, -672.0, 672.0]  # scale e4m3(448), codes 6, -1.5, 1.5: exact
    assert e4m3_pow2_scale(x).item() == 8.0
    assert fake_quant_fp8_pow2(x)[:3].tolist() == [2560.0, -640.0, 640.0]
    tiny = torch.tensor([448.0, 2.0**-7, 1.5 * 2.0**-9, -2.5 * 2.0**-9, 0.5 * 2.0**-9])
    assert e4m3_pow2_scale(tiny).item() == 1.0
    assert fake_quant_fp8_pow2(tiny).tolist() == [448.0, 2.0**-7, 2.0**-8, -(2.0**-8), 0.0]
    assert fake_quant_fp8_pow2(tiny * 2.0**-20).tolist() == (fake_quant_fp8_pow2(tiny) * 2.0**-20).tolist()


def test_pow2_scale_is_the_smallest_that_does_not_saturate() -> None:
    amax = torch.tensor([448.0, 449.0, 224.0, 224.0001, 1.0, 2688.0, 3e38, 2.0**-140])
    scale = e4m3_pow2_scale(amax[:, None]).flatten()
    assert scale.tolist() == [1.0, 2.0, 0.5, 1.0, 2.0**-8, 8.0, 2.0**120, 2.0**-126]
    assert bool((amax / scale <= 448).all()) and bool((amax[:-1] / scale[:-1] > 224).all())  # max in (224, 448]


def test_pow2_requantization_matches_brute_force(gen: torch.Generator) -> None:
    """NVFP4 rows (block scales spread over 2**-8..2**8, so small blocks hit e4m3 subnormals at the row's scale) vs
    the brute-force scale and e4m3 oracle; the scale is a power of two, nothing saturates."""
    spread = 2.0 ** torch.randint(-8, 9, (256, 8), generator=gen).float().repeat_interleave(16, -1)
    x = fake_quant_nvfp4(torch.randn(256, 128, generator=gen) * spread)
    scale = e4m3_pow2_scale(x)
    assert torch.equal(scale, oracle_pow2_scale(x))
    assert bool((torch.frexp(scale).mantissa == 0.5).all())
    expected = e4m3_positive_values()[oracle_e4m3_bits(x / scale).long() & 0x7F].float() * scale
    out = fake_quant_fp8_pow2(x)
    assert torch.equal(out, torch.where(x < 0, -expected, expected))
    assert bool(((out - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * scale).all())  # RNE: half an ulp


def test_pow2_requantization_groups_over_given_dims(gen: torch.Generator) -> None:
    """One scale per group: per row over the last dim, or over several dims (a KV tile: keys x head_dim)."""
    x = fake_quant_nvfp4(torch.randn(3, 64, 2, 128, generator=gen) * torch.tensor([1.0, 300.0]).view(1, 1, 2, 1))
    scale = e4m3_pow2_scale(x, (1, 3))
    assert scale.shape == (3, 1, 2, 1)
    assert torch.equal(scale, oracle_pow2_scale(x.transpose(1, 2).flatten(2)).view(3, 1, 2, 1))
    assert torch.equal(fake_quant_fp8_pow2(x, (1, 3)), fake_quant_fp8(x, scale))


def test_pow2_requantization_is_idempotent(gen: torch.Generator) -> None:
    """Values already e4m3 at a power-of-two scale come back unchanged (the requantized max may fall to 224 * 2**e,
    halving the next scale: doubled e4m3 values are e4m3 again)."""
    codes = torch.randint(0, 256, (64, 128), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    x = codes.view(torch.float8_e4m3fn).float() * 2.0 ** torch.randint(-20, 20, (64, 1), generator=gen).float()
    assert torch.equal(fake_quant_fp8_pow2(x), x)
    once = fake_quant_fp8_pow2(fake_quant_nvfp4(torch.randn(64, 128, generator=gen) * 3))
    assert torch.equal(fake_quant_fp8_pow2(once), once)
    at_224 = torch.tensor([[224.1, 1.0]])
    assert fake_quant_fp8_pow2(at_224).tolist() == [[224.0, 1.0]] and e4m3_pow2_scale(at_224).item() == 1.0
    assert e4m3_pow2_scale(fake_quant_fp8_pow2(at_224)).item() == 0.5


def test_pow2_requantization_of_zero_groups_is_zero_without_nan() -> None:
    x = torch.zeros(3, 32)
    x[1, 5] = -3.0
    assert e4m3_pow2_scale(x).flatten().tolist() == [1.0, 2.0**-7, 1.0]
    out = fake_quant_fp8_pow2(x)
    assert torch.equal(out, x) and not bool(torch.signbit(out[0]).any())
    assert torch.equal(fake_quant_fp8_pow2(torch.zeros(2, 4, 16), (1, 2)), torch.zeros(2, 4, 16))
    with pytest.raises(FormatError):
        fake_quant_fp8_pow2(torch.tensor([1.0, float("inf")]))
