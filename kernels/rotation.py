"""Block Hadamard rotation of Q and K before 4-bit rounding (incoherent processing).

``H_b`` is the b x b Sylvester Hadamard matrix (entries +-1) scaled by ``1 / sqrt(b)``: symmetric and orthonormal, so
it is its own inverse. `block_hadamard` applies it to each block of ``b`` consecutive elements of the last dimension
(head_dim), i.e. multiplies by the block-diagonal ``diag(H_b, ..., H_b)``, which is orthonormal too. Rotating both Q
and K leaves every score ``q . k`` unchanged in exact arithmetic, while spreading a channel's outlier over the block
so that the NVFP4 block scale of the rotated vector is set by its norm rather than by one large channel.

The +-1 butterfly (fast Walsh-Hadamard transform, ``log2 b`` add/subtract stages) runs in the input's dtype and the
``1 / sqrt(b)`` scaling comes last; in float64 on BF16 inputs every stage is exact, so only the final scaling rounds.

`GemmRotation` is the form a server runs on its BF16 activations (``MPFA_NUMERICS=had128-k46``, `served_numerics`):
one FP32 GEMM with the +-1 Sylvester matrix (products exact, also under TF32: BF16 values and +-1 fit its 10-bit
mantissa) and the same ``1 / sqrt(b)`` scaling, kept in FP32 (rounding the rotated values back to BF16 would add
2**-9 of the whole vector to every channel, which on keys with a large constant bias is of the size of the NVFP4
error of the centered key). It equals ``block_hadamard`` of the widened input up to the order of its FP32 sums.
"""

from __future__ import annotations

import math

import torch

HADAMARD_BLOCKS = (16, 128)


def sylvester_signs(block: int, dtype: torch.dtype = torch.float64,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The Sylvester Hadamard matrix ``H_block`` [block, block], entries +-1 (block a power of two)."""
    _check_block(block)
    h = torch.ones((1, 1), dtype=dtype, device=device)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_matrix(block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``H_block / sqrt(block)`` [block, block] (block a power of two)."""
    return sylvester_signs(block, dtype) / math.sqrt(block)


def block_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` [..., n] with each block of ``block`` consecutive elements of the last dimension multiplied by the
    orthonormal ``H_block`` (n a multiple of ``block``); its own inverse. Computed in x's dtype."""
    _check_block(block)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"the last dimension ({n}) must be a multiple of the Hadamard block {block}")
    y = x.reshape(*x.shape[:-1], n // block, block)
    half = 1
    while half < block:  # butterfly stage: pairs (i, i + half) within each 2 * half span -> (a + b, a - b)
        pairs = y.unflatten(-1, (block // (2 * half), 2, half))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), -2).flatten(-3)
        half *= 2
    return (y / torch.tensor(math.sqrt(block), dtype=y.dtype, device=y.device)).reshape(x.shape)


class GemmRotation:
    """``x`` [..., n] (n a multiple of ``block``) -> FP32 ``x diag(H_block, ...)``: ``x`` widened to FP32, one GEMM
    with the +-1 matrix, divided by ``sqrt(block)`` (correctly rounded, as `block_hadamard`). Its constants live on
    ``device``, built once: a call copies nothing from the host (CUDA-graph capturable)."""

    def __init__(self, block: int, device: torch.device | str | None = None) -> None:
        self.block = block
        self.signs = sylvester_signs(block, torch.float32, device)
        self.root = torch.tensor(math.sqrt(block), dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if n % self.block:
            raise ValueError(f"the last dimension ({n}) must be a multiple of the Hadamard block {self.block}")
        y = x.float().unflatten(-1, (n // self.block, self.block)) @ self.signs
        return y.div_(self.root).flatten(-2)


def _check_block(block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"a Hadamard block must be a power of two, got {block}")
