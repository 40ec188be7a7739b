"""Input tensors for the kernel microbenchmarks: random fills and how many input sets to rotate through.

Rotating through several independent input sets keeps one launch from finding the previous launch's data in
L2 (50 MB on H100/H200), which would flatter a small problem.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..mpfa_cli.errors import ProfileError

if TYPE_CHECKING:
    import torch

_FILL_CHUNK = 1 << 26  # elements drawn per randn call, bounds the BF16 staging buffer to 128 MiB
DEFAULT_L2_BYTES = 50 * 1024 * 1024
DEFAULT_SEED = 0


def rotation_sets(set_bytes: float, l2_bytes: int, budget_bytes: float, *, min_sets: int = 2,
                  max_sets: int = 16, l2_multiple: int = 4) -> int:
    """Input sets to rotate: enough to span `l2_multiple` x L2, at least `min_sets`, within `budget_bytes`."""
    if set_bytes <= 0:
        raise ValueError("an input set must have a positive size")
    wanted = max(min_sets, math.ceil(l2_multiple * l2_bytes / set_bytes))
    affordable = int(budget_bytes // set_bytes)
    if affordable < 1:
        raise ProfileError(f"one input set needs {set_bytes / 1e9:.2f} GB but only {budget_bytes / 1e9:.2f} GB "
                          f"of device memory is budgeted")
    return max(1, min(wanted, max_sets, affordable))


def random_tensor(shape: tuple[int, ...], dtype: "torch.dtype", device: "torch.device",
                  generator: "torch.Generator") -> "torch.Tensor":
    """Standard-normal values rounded to `dtype` (FP8 included), filled in chunks to bound temporary memory."""
    import torch

    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _FILL_CHUNK):
        chunk = flat[start:start + _FILL_CHUNK]
        chunk.copy_(torch.randn(chunk.numel(), dtype=torch.bfloat16, device=device, generator=generator))
    return out
