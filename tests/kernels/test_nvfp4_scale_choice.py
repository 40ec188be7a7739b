"""NVFP4's "4/6" block-scale choice at cache write (`quantize_nvfp4(..., scale_choice="4/6")`)."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import FormatError, decode_e2m1, dequantize_nvfp4, encode_e2m1, quantize_nvfp4


def _block(*values: float) -> torch.Tensor:
    return torch.tensor([*values, *[0.0] * (16 - len(values))])


def _candidate(blocks: torch.Tensor, target: float) -> torch.Tensor:
    """Dequantized blocks [n, 16] with the block max scaled to `target`, written from the format's definition."""
    scale = (blocks.abs().amax(-1, keepdim=True) / target).to(torch.float8_e4m3fn).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return decode_e2m1(encode_e2m1(torch.where(scale > 0, blocks / safe, 0.0))) * scale


def test_hand_checked_blocks() -> None:
    # max 4: amax/6 rounds to the e4m3 scale 0.6875, which misses 4, 3 and 1.5; amax/4 = 1 keeps them exactly
    four = quantize_nvfp4(_block(4.0, 3.0, -1.5), scale_choice="4/6")
    assert float(four.scales.float()) == 1.0 and torch.equal(dequantize_nvfp4(four), _block(4.0, 3.0, -1.5))
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(_block(4.0, 3.0, -1.5))), _block(4.125, 2.75, -1.375))
    # max 6 with a small element: scale 1 is exact, scale 1.5 would round 1 to 0.75
    assert float(quantize_nvfp4(_block(6.0, 1.0), scale_choice="4/6").scales.float()) == 1.0
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(_block(6.0, 1.0), scale_choice="4/6")), _block(6.0, 1.0))
    # a tie (both exact) keeps the standard scale amax / 6
    assert torch.equal(quantize_nvfp4(_block(6.0), scale_choice="4/6").scales, quantize_nvfp4(_block(6.0)).scales)


def test_each_block_keeps_the_candidate_with_the_smaller_float64_error(gen: torch.Generator) -> None:
    x = torch.randn(512, 64, generator=gen) * torch.rand(512, 1, generator=gen) * 8
    blocks = x.unflatten(-1, (-1, 16)).flatten(0, 1)
    chosen = dequantize_nvfp4(quantize_nvfp4(x, scale_choice="4/6")).unflatten(-1, (-1, 16)).flatten(0, 1)
    errors = [(c.double() - blocks.double()).square().sum(-1) for c in (_candidate(blocks, 6.0),
                                                                          _candidate(blocks, 4.0))]
    use4 = errors[1] < errors[0]
    assert torch.equal(chosen, torch.where(use4[:, None], _candidate(blocks, 4.0), _candidate(blocks, 6.0)))
    assert 0.1 < float(use4.float().mean()) < 0.9  # both choices occur on Gaussian blocks
    assert float((chosen.double() - blocks.double()).square().sum()) < 0.9 * float(errors[0].sum())


def test_standard_choice_is_the_default_bit_for_bit(gen: torch.Generator) -> None:
    x = torch.randn(8, 128, generator=gen) * 3
    a, b = quantize_nvfp4(x), quantize_nvfp4(x, scale_choice="6")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))


def test_a_block_whose_amax_over_4_overflows_e4m3_keeps_the_standard_scale() -> None:
    # amax / 6 = 316.7 fits e4m3, amax / 4 = 475 does not; clamped to 448 it would err less (108**2 against
    # 20**2 + 3 * 64**2 + 32**2 with the scale 320), but the encoder never uses a scale it cannot represent
    x = _block(1900.0, 1344.0, 1344.0, 1344.0, 672.0)
    assert float(quantize_nvfp4(x).scales.float()) == 320.0
    assert torch.equal(quantize_nvfp4(x, scale_choice="4/6").scales.view(torch.uint8),
                       quantize_nvfp4(x).scales.view(torch.uint8))


def test_rejects_an_unknown_choice() -> None:
    with pytest.raises(FormatError, match="scale choice"):
        quantize_nvfp4(torch.zeros(16), scale_choice="4")
