"""Which part of a transformer step a GPU kernel belongs to, from its name: attention, GEMM, communication,
or other (norms, RoPE, activations, KV-cache writes, sampling, copies).

The patterns are tried in that order and the first match wins: attention first, because some attention
kernels are CUTLASS templates (FA3's `cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>`) and every CuTe-DSL
kernel (FA4, MpFA) is named `kernel_cutlass_...`, so "cutlass" alone never means GEMM here.
"""
from __future__ import annotations

import re

ATTENTION, GEMM, COMMUNICATION, OTHER = "attention", "GEMM", "communication", "other"
CATEGORIES = (ATTENTION, GEMM, COMMUNICATION, OTHER)

_PATTERNS = (
    (ATTENTION, re.compile(
        r"FlashAttention|FlashAttn|flash_fwd|flash::|fmha"  # FA4 (CuTe DSL), FA3 (sgl-kernel), FA2, FMHA
        r"|Batch(Prefill|Decode)\w*Kernel|Single(Prefill|Decode)\w*Kernel|MergeStates|merge_state"  # FlashInfer
        r"|PrefillWithKVCacheKernel|\bkernel_mha\b"  # FlashInfer's sm90 templates (FP8 too), its XQA decode
        r"|^_fwd(_grouped)?_kernel"  # SGLang Triton extend (_fwd_kernel) and decode (_fwd_kernel_stage1/2)
        r"|paged_attention|flash_mla|SplitKVDecodeSm90|DecodeMergeSm90|mpfa",  # vLLM, FlashMLA, MpFA
        re.IGNORECASE)),
    (GEMM, re.compile(
        r"gemm|nvjet|xmma|cublas|splitKreduce|matmul|_scaled_mm|fused_moe",  # cuBLAS(Lt), CUTLASS, Triton, MoE
        re.IGNORECASE)),
    (COMMUNICATION, re.compile(
        r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device_reduce|quick_?reduce|mscclpp"
        r"|multimem|nvshmem",
        re.IGNORECASE)),
)


def classify(kernel_name: str) -> str:
    """The category of a kernel, OTHER when no pattern matches."""
    return next((category for category, pattern in _PATTERNS if pattern.search(kernel_name)), OTHER)
