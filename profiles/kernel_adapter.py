"""The interface every backend's kernel adapter implements, so a new kernel plugs in with one module.

An adapter declares how its backend stores Q/K/V/O (for the byte count), which precision its matmuls run in
(for the % of peak), and the kernel-name regex that picks its main attention kernel out of a profiler trace.
`prepare` builds `num_sets` independent input sets on the device and returns a `PreparedKernel`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .attention_workload import AttentionWorkload, TensorFormat

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
        """Build ``num_sets`` input sets on ``device`` and the kernel call that runs one of them."""
        ...


def paged_slots(workload: AttentionWorkload, page_size: int) -> int:
    """Token slots of K (and V) when every sequence takes whole pages of ``page_size`` tokens."""
    return workload.batch * -(-workload.seq // page_size) * page_size


def sequential_page_table(batch: int, pages_per_seq: int, device: "torch.device") -> "torch.Tensor":
    """Page table [batch, pages_per_seq]: each sequence's pages in order, sequence after sequence."""
    import torch

    return torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device).view(batch, -1)


def unpaged(cache: "torch.Tensor", workload: AttentionWorkload) -> "torch.Tensor":
    """A K or V cache laid out by `sequential_page_table` (whole pages per sequence, any page size) -> the packed
    [batch * seq, kv_heads, head_dim] tokens, padding slots dropped."""
    w = workload
    by_seq = cache.reshape(w.batch, -1, w.kv_heads, w.head_dim)[:, :w.seq]
    return by_seq.reshape(w.batch * w.seq, w.kv_heads, w.head_dim)
