"""The interface every backend's kernel adapter implements, so a new kernel plugs in with one module.

An adapter declares how its backend stores Q/K/V/O (for the byte count), which precision its matmuls run in
(for the % of peak), and the kernel-name regex that picks its main attention kernel out of a profiler trace.
`prepare` builds `num_sets` independent input sets on the device and returns a `PreparedKernel`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mpfa.profiles.attention_workload import AttentionWorkload, TensorFormat

if TYPE_CHECKING:
    import torch


@dataclass
class PreparedKernel:
    """Inputs built on the device and the call that runs the kernel on one of them.

    `run(i)` launches on input set i and returns the output, shaped (batch * q_len, q_heads, head_dim).
    `dense_inputs(i)` returns that set's (q, k, v) in their stored dtypes, packed flash-attn varlen style:
    q (batch * q_len, q_heads, head_dim), k and v (batch * seq, kv_heads, head_dim), paging undone. That is
    what a reference implementation needs to check the output.
    """

    run: Callable[[int], "torch.Tensor"]
    dense_inputs: Callable[[int], tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]]
    num_sets: int
    description: str


class KernelAdapter(Protocol):
    name: str
    tensor_format: TensorFormat
    math_dtype: str  # "bf16" or "fp8": which measured GEMM peak its matmuls are compared with
    kernel_regex: str  # matches the main attention kernel's name (ncu --kernel-name, trace filtering)

    def set_bytes(self, workload: AttentionWorkload) -> int:
        """Device bytes one input set occupies (including paging slack and the output)."""
        ...

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        """Build the inputs; raises KernelNotBuilt when the backend has no kernel yet."""
        ...
