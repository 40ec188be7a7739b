"""FlashInfer's paged-KV attention wrappers as SGLang's `flashinfer` backend drives them.

`BatchPrefillWithPagedKVCacheWrapper` (causal) for prefill and `BatchDecodeWithPagedKVCacheWrapper` for decode,
backend "fa2", NHD layout, page size 1, BF16 queries and output, K/V cache in FP8 e4m3 (scale 1) or BF16.
Decode uses the tensor-core path when SGLang would (FP8 cache, or a GQA group of at least 4).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpfa.profiles.attention_workload import BF16, BF16_Q_FP8_KV, AttentionWorkload
from mpfa.profiles.inputs import random_tensor
from mpfa.profiles.kernel_adapter import PreparedKernel

if TYPE_CHECKING:
    import torch

PAGE_SIZE = 1
WORKSPACE_BYTES = 256 * 1024 * 1024


def decode_uses_tensor_cores(kv_fp8: bool, q_heads: int, kv_heads: int) -> bool:
    """SGLang's rule for FlashInfer decode: tensor cores for an FP8 cache or a GQA group >= 4."""
    return kv_fp8 or q_heads // kv_heads >= 4


class FlashInferPaged:
    math_dtype = "bf16"  # fa2 converts FP8 K/V tiles to the query dtype and runs BF16 MMAs
    kernel_regex = "BatchPrefillWithPagedKVCacheKernel|BatchDecodeWithPagedKVCacheKernel"

    def __init__(self, kv_fp8: bool) -> None:
        self.kv_fp8 = kv_fp8
        self.name = "flashinfer-fp8" if kv_fp8 else "flashinfer-bf16"
        self.tensor_format = BF16_Q_FP8_KV if kv_fp8 else BF16

    def set_bytes(self, workload: AttentionWorkload) -> int:
        return int(workload.bytes_needed(self.tensor_format))  # page size 1: no paging slack

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        import flashinfer
        import torch

        w = workload
        kv_dtype = torch.float8_e4m3fn if self.kv_fp8 else torch.bfloat16
        generator = torch.Generator(device=device).manual_seed(seed)
        tokens = w.batch * w.seq
        kv_shape = (tokens, PAGE_SIZE, w.kv_heads, w.head_dim)
        sets = [(random_tensor((w.batch * w.q_len, w.q_heads, w.head_dim), torch.bfloat16, device, generator),
                 random_tensor(kv_shape, kv_dtype, device, generator),
                 random_tensor(kv_shape, kv_dtype, device, generator)) for _ in range(num_sets)]
        outputs = [torch.empty_like(q) for q, _, _ in sets]

        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        kv_indptr = torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device)
        kv_indices = torch.arange(tokens, dtype=torch.int32, device=device)
        last_page_len = torch.ones(w.batch, dtype=torch.int32, device=device)
        if w.kind == "prefill":
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            wrapper.plan(kv_indptr, kv_indptr, kv_indices, last_page_len, w.q_heads, w.kv_heads, w.head_dim,
                         PAGE_SIZE, causal=True, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
            description = "BatchPrefillWithPagedKVCacheWrapper fa2, page 1, causal"
        else:
            tensor_cores = decode_uses_tensor_cores(self.kv_fp8, w.q_heads, w.kv_heads)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2",
                                                                    use_tensor_cores=tensor_cores)
            wrapper.plan(kv_indptr, kv_indices, last_page_len, w.q_heads, w.kv_heads, w.head_dim, PAGE_SIZE,
                         q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
            description = ("BatchDecodeWithPagedKVCacheWrapper fa2, page 1, "
                           f"tensor cores {'on' if tensor_cores else 'off'}")
        dtype_note = "FP8 e4m3" if self.kv_fp8 else "BF16"

        def run(i: int) -> torch.Tensor:
            q, k, v = sets[i]
            return wrapper.run(q, (k, v), out=outputs[i])

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = sets[i]
            return q, k.squeeze(1), v.squeeze(1)

        return PreparedKernel(run, dense_inputs, num_sets, f"{description}, {dtype_note} KV cache")
