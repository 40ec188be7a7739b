"""MpFA: NVFP4 QK^T and FP8 PV over an NVFP4-K / FP8-V cache, with sequence-centred Q and K.

Decode runs the sm90 kernels (the Triton KV write fills the cache; the CuTe split-KV decode + merge is what is
timed), page size 1 like FlashInfer's; their correctness lives in tests/kernels_sm90. The prefill kernel does
not exist yet: `prepare` raises `KernelNotBuilt` and the profile shows a "not built" row, never a number.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpfa.profiles.errors import KernelNotBuilt, ProfileError
from mpfa.profiles.inputs import random_tensor
from mpfa.profiles.kernel_adapter import PreparedKernel
from mpfa.profiles.workload import MPFA, AttentionWorkload

if TYPE_CHECKING:
    import torch

_FILL_TOKENS = 1 << 16  # tokens quantized into the cache per write-kernel launch (bounds the BF16 staging)


class MpfaAdapter:
    name = "mpfa"
    tensor_format = MPFA
    math_dtype = "bf16"  # FP16 tensor-core MMAs on exactly dequantized operands (sm_90 has no FP4 MMA)
    kernel_regex = "SplitKVDecode|DecodeMerge"

    def set_bytes(self, workload: AttentionWorkload) -> int:
        return int(workload.bytes_needed(self.tensor_format))

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device", seed: int) -> PreparedKernel:
        import torch

        from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache
        from mpfa.kernels.smoothing import SmoothingMeans
        from mpfa.kernels.sm90.decode_launch import DecodeWorkspace, mpfa_decode
        from mpfa.kernels.sm90.quantize_cache import quantize_to_cache

        w = workload
        if w.kind != "decode":
            raise KernelNotBuilt("the sm90 MpFA prefill kernel is not built yet")
        generator = torch.Generator(device=device).manual_seed(seed)
        tokens = w.batch * w.seq
        means = SmoothingMeans(torch.randn(w.batch, w.q_heads, w.head_dim, device=device, generator=generator),
                               torch.randn(w.batch, w.kv_heads, w.head_dim, device=device, generator=generator))

        def make_set() -> tuple[CenteredQuery, MpfaKVCache]:
            cache = MpfaKVCache.allocate(tokens, 1, w.q_heads, w.kv_heads, w.head_dim, device)
            query = CenteredQuery.allocate(w.batch, w.q_heads, w.head_dim, device)
            for first in range(0, tokens, _FILL_TOKENS):
                count = min(_FILL_TOKENS, tokens - first)
                slots = torch.arange(first, first + count, device=device)
                q, k, v = (random_tensor((count, heads, w.head_dim), torch.bfloat16, device, generator)
                           for heads in (w.q_heads, w.kv_heads, w.kv_heads))
                chunk_query = quantize_to_cache(q, k, v, slots, (slots // w.seq).int(), means, cache)
                ends = slots[(slots + 1) % w.seq == 0]  # each request's last token is its decode query
                query.codes[ends // w.seq] = chunk_query.codes[ends - first]
                query.scales[ends // w.seq] = chunk_query.scales[ends - first]
            return query, cache

        sets = [make_set() for _ in range(num_sets)]
        page_table = torch.arange(tokens, dtype=torch.int32, device=device).view(w.batch, w.seq)
        seq_lens = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)
        workspace = DecodeWorkspace.allocate(w.batch, w.q_heads, w.kv_heads, w.seq, device)
        outputs = [torch.empty((w.batch, w.q_heads, w.head_dim), dtype=torch.bfloat16, device=device)
                   for _ in range(num_sets)]

        def run(i: int) -> torch.Tensor:
            query, cache = sets[i]
            return mpfa_decode(query, cache, page_table, seq_lens, workspace, out=outputs[i])

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            raise ProfileError("the MpFA benchmark quantizes its inputs in place; tests/kernels_sm90 checks outputs")

        return PreparedKernel(run, dense_inputs, num_sets,
                              f"Triton KV write + CuTe split-KV decode ({workspace.num_partitions} partitions of "
                              f"{workspace.partition_size} keys) + merge, page 1")
