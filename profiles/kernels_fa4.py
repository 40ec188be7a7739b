"""FA4 (`flash_attn.cute`) with BF16 Q/K/V: contiguous varlen for prefill, a page-128 KV cache for decode.

Decode calls it the way SGLang's `fa4` backend does (`flash_attn_with_kvcache` -> varlen with `page_table`
and `seqused_k`, one query per sequence, causal).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .attention_workload import BF16, AttentionWorkload
from .inputs import random_tensor
from .kernel_adapter import PreparedKernel, paged_slots, sequential_page_table, unpaged

if TYPE_CHECKING:
    import torch

PAGE_SIZE = 128  # FA4 loads K/V pages with TMA only when page size == its n-tile (128)


class Fa4Bf16:
    name = "fa4-bf16"
    tensor_format = BF16
    math_dtype = "bf16"
    kernel_regex = "FlashAttentionForward"

    def set_bytes(self, workload: AttentionWorkload) -> int:
        return 2 * (2 * workload.q_elements() + 2 * _kv_slots(workload) * workload.kv_heads * workload.head_dim)

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        import torch
        from flash_attn.cute import flash_attn_varlen_func

        w = workload
        generator = torch.Generator(device=device).manual_seed(seed)
        slots = _kv_slots(w)

        def make_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q = random_tensor((w.batch * w.q_len, w.q_heads, w.head_dim), torch.bfloat16, device, generator)
            kv_shape = (slots, w.kv_heads, w.head_dim) if w.kind == "prefill" else (
                slots // PAGE_SIZE, PAGE_SIZE, w.kv_heads, w.head_dim)
            return (q, random_tensor(kv_shape, torch.bfloat16, device, generator),
                    random_tensor(kv_shape, torch.bfloat16, device, generator))

        sets = [make_set() for _ in range(num_sets)]

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = sets[i]
            return q, unpaged(k, w), unpaged(v, w)

        if w.kind == "prefill":
            cu_seqlens = torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device)

            def run(i: int) -> torch.Tensor:
                q, k, v = sets[i]
                out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                max_seqlen_q=w.seq, max_seqlen_k=w.seq, causal=True)
                return out

            return PreparedKernel(run, dense_inputs, num_sets, "flash_attn.cute varlen, contiguous BF16 K/V, causal")

        page_table = sequential_page_table(w.batch, slots // PAGE_SIZE // w.batch, device)
        cu_seqlens_q = torch.arange(w.batch + 1, dtype=torch.int32, device=device)
        seqused_k = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)

        def run_decode(i: int) -> torch.Tensor:
            q, k, v = sets[i]
            out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1,
                                            seqused_k=seqused_k, page_table=page_table, causal=True)
            return out

        return PreparedKernel(run_decode, dense_inputs, num_sets,
                              f"flash_attn.cute paged BF16 KV cache (page {PAGE_SIZE}), seqused_k")


def _kv_slots(workload: AttentionWorkload) -> int:
    """Token slots of K (and V) allocated: exact for prefill, whole pages per sequence for decode."""
    return paged_slots(workload, 1 if workload.kind == "prefill" else PAGE_SIZE)
