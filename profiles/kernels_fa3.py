"""FlashAttention-3 (`sgl_kernel.flash_attn`) as SGLang's `fa3` backend drives it, BF16 or FP8 e4m3 KV cache.

Extend (prefill) and decode both call `flash_attn_with_kvcache` with a page table over a paged cache (page 1,
SGLang's default page size, unless told otherwise), `cache_seqlens`, `cu_seqlens_q`, causal, as
`FlashAttentionBackend.forward_extend` / `forward_decode` do. With an FP8 cache SGLang casts Q to e4m3 too and
passes no descales for a checkpoint without KV scales (scale 1), so the QKᵀ and PV MMAs both run in FP8.
``contiguous=True`` calls `flash_attn_varlen_func` on contiguous K/V instead (prefill only): FA3's best case, not
what a server runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..mpfa_cli.errors import ProfileError
from .inputs import random_tensor
from .kernel_adapter import PreparedKernel, paged_slots, sequential_page_table, unpaged
from .attention_workload import BF16, FP8_Q_FP8_KV, AttentionWorkload

if TYPE_CHECKING:
    import torch


class Fa3:
    kernel_regex = "FlashAttnFwdSm90"

    def __init__(self, kv_fp8: bool, page_size: int = 1, contiguous: bool = False) -> None:
        self.kv_fp8 = kv_fp8
        self.page_size = page_size
        self.contiguous = contiguous
        self.name = "fa3-fp8" if kv_fp8 else "fa3-bf16"
        if contiguous:
            self.name += "-contiguous"
        elif page_size != 1:
            self.name += f"-page{page_size}"
        self.tensor_format = FP8_Q_FP8_KV if kv_fp8 else BF16
        self.math_dtype = "fp8" if kv_fp8 else "bf16"

    def set_bytes(self, workload: AttentionWorkload) -> int:
        w = workload
        element = 1 if self.kv_fp8 else 2
        slots = paged_slots(w, self.page_size)
        return int(w.q_elements() * (element + 2) + 2 * slots * w.kv_heads * w.head_dim * element)

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        w = workload
        if self.contiguous and w.kind != "prefill":
            raise ProfileError(f"{self.name} is a prefill baseline: decode runs on a paged cache (use fa3-fp8)")
        import torch
        from sgl_kernel.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        dtype = torch.float8_e4m3fn if self.kv_fp8 else torch.bfloat16
        generator = torch.Generator(device=device).manual_seed(seed)
        slots = paged_slots(w, self.page_size)
        kv_shape = (slots // self.page_size, self.page_size, w.kv_heads, w.head_dim)

        def make_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q = random_tensor((w.batch * w.q_len, w.q_heads, w.head_dim), dtype, device, generator)
            return q, random_tensor(kv_shape, dtype, device, generator), random_tensor(kv_shape, dtype, device,
                                                                                      generator)

        sets = [make_set() for _ in range(num_sets)]

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = sets[i]
            return q, unpaged(k, w), unpaged(v, w)

        cu_seqlens_q = torch.arange(0, (w.batch + 1) * w.q_len, w.q_len, dtype=torch.int32, device=device)
        dtype_note = "FP8 e4m3 Q and KV cache" if self.kv_fp8 else "BF16"
        if self.contiguous:
            dense = [dense_inputs(i) for i in range(num_sets)]
            cu_seqlens_k = torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device)

            def run_contiguous(i: int) -> torch.Tensor:
                q, k, v = dense[i]
                out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=w.q_len,
                                             max_seqlen_k=w.seq, causal=True)
                return out[0] if isinstance(out, tuple) else out

            return PreparedKernel(run_contiguous, dense_inputs, num_sets,
                                  f"sgl_kernel flash_attn_varlen_func, contiguous {dtype_note} K/V, causal")

        page_table = sequential_page_table(w.batch, slots // self.page_size // w.batch, device)
        cache_seqlens = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)

        def run(i: int) -> torch.Tensor:
            q, k, v = sets[i]
            out = flash_attn_with_kvcache(q=q, k_cache=k, v_cache=v, page_table=page_table,
                                          cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
                                          max_seqlen_q=w.q_len, causal=True)
            return out[0] if isinstance(out, tuple) else out

        return PreparedKernel(run, dense_inputs, num_sets,
                              f"sgl_kernel flash_attn_with_kvcache, page {self.page_size}, {dtype_note}, causal")
