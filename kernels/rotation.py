"""Block Hadamard rotation of Q and K before 4-bit rounding (incoherent processing).

``H_b`` is the b x b Sylvester Hadamard matrix (entries +-1) scaled by ``1 / sqrt(b)``: symmetric and orthonormal, so
it is its own inverse. `block_hadamard` applies it to each block of ``b`` consecutive elements of the last dimension
(head_dim), i.e. multiplies by the block-diagonal ``diag(H_b, ..., H_b)``, which is orthonormal too. Rotating both Q
and K leaves every score ``q . k`` unchanged in exact arithmetic, while spreading a channel's outlier over the block
so that the NVFP4 block scale of the rotated vector is set by its norm rather than by one large channel.

The +-1 butterfly (fast Walsh-Hadamard transform, ``log2 b`` add/subtract stages) runs in the input's dtype and the
``1 / sqrt(b)`` scaling comes last; in float64 on BF16 inputs every stage is exact, so only the final scaling rounds.
"""

from __future__ import annotations

import math

import torch

HADAMARD_BLOCKS = (16, 128)


def hadamard_matrix(block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``H_block / sqrt(block)`` [block, block] (block a power of two)."""
    _check_block(block)
    h = torch.ones((1, 1), dtype=dtype)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(block)


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


def _check_block(block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"a Hadamard block must be a power of two, got {block}")
