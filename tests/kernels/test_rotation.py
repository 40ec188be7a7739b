"""Block Hadamard rotation (`mpfa.kernels.rotation`): orthonormal, self-inverse, exact in float64."""

from __future__ import annotations

import math

import pytest
import torch

from mpfa.kernels.rotation import GemmRotation, block_hadamard, hadamard_matrix, sylvester_signs


@pytest.mark.parametrize("block", [1, 2, 16, 128])
def test_matrix_is_symmetric_orthonormal_and_its_own_inverse(block: int) -> None:
    h = hadamard_matrix(block)
    assert torch.equal(h, h.T)
    assert bool((h.abs() == 1 / math.sqrt(block)).all())
    assert float((h @ h - torch.eye(block, dtype=torch.float64)).abs().max()) < 1e-15


@pytest.mark.parametrize("block", [16, 128])
def test_transform_is_the_block_diagonal_matrix_product(gen: torch.Generator, block: int) -> None:
    x = torch.randn(5, 3, 256, generator=gen, dtype=torch.float64)
    dense = torch.block_diag(*[hadamard_matrix(block)] * (256 // block))
    assert float((block_hadamard(x, block) - x @ dense).abs().max()) < 1e-14


def test_block_16_is_exact_and_self_inverse_on_bf16_values_in_float64(gen: torch.Generator) -> None:
    """On BF16 inputs the +-1 butterfly sums are exact in float64 and the scaling by 1/4 is a power of two."""
    x = torch.randn(64, 128, generator=gen).bfloat16().double()
    assert torch.equal(block_hadamard(block_hadamard(x, 16), 16), x)


@pytest.mark.parametrize("block", [16, 128])
def test_scores_are_unchanged_when_q_and_k_both_rotate(gen: torch.Generator, block: int) -> None:
    q = torch.randn(40, 128, generator=gen, dtype=torch.float64)
    k = torch.randn(50, 128, generator=gen, dtype=torch.float64) + 30 * (torch.arange(128) == 7)
    rotated = block_hadamard(q, block) @ block_hadamard(k, block).T
    assert float((rotated - q @ k.T).abs().max()) < 1e-12 * float((q @ k.T).abs().max())
    assert torch.allclose(block_hadamard(block_hadamard(k, block), block), k, rtol=0, atol=1e-13)


def test_an_outlier_channel_spreads_over_its_block() -> None:
    x = torch.zeros(2, 32, dtype=torch.float64)
    x[0, 3] = 8.0
    y = block_hadamard(x, 16)
    assert bool((y[0, :16].abs() == 2.0).all()) and bool((y[0, 16:] == 0).all()) and bool((y[1] == 0).all())


def test_rejects_bad_blocks() -> None:
    with pytest.raises(ValueError, match="power of two"):
        block_hadamard(torch.zeros(4, 48), 12)
    with pytest.raises(ValueError, match="multiple of the Hadamard block"):
        block_hadamard(torch.zeros(4, 48), 32)


def test_gemm_rotation_is_the_butterfly_up_to_fp32_sum_order(gen: torch.Generator) -> None:
    """The served form (one FP32 GEMM with the +-1 matrix, then / sqrt(block)) on BF16 activations with a large
    channel (a K bias): FP32, within FP32 rounding of the butterfly and equal to it on most values."""
    x = (torch.randn(64, 3, 256, generator=gen) * 2 + 40 * (torch.arange(256) == 9)).bfloat16()
    rotate = GemmRotation(128)
    y = rotate(x)
    butterfly = block_hadamard(x.float(), 128)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, butterfly, rtol=2e-6, atol=2e-6 * float(x.float().abs().max()))
    assert float((y == butterfly).float().mean()) > 0.5
    dense = torch.block_diag(*[hadamard_matrix(128)] * 2)
    assert float((y.double() - x.double() @ dense).abs().max()) < 1e-5 * float(x.float().abs().max())
    assert torch.equal(rotate.signs, sylvester_signs(128, torch.float32))
    with pytest.raises(ValueError, match="multiple of the Hadamard block 128"):
        rotate(torch.zeros(2, 64))
