"""FlashInfer's paged-KV attention as SGLang drives it, and FlashInfer 0.6.12's other Hopper FP8 paths.

`FlashInferPaged` (``flashinfer-fp8``, ``flashinfer-bf16``): SGLang's `flashinfer` backend.
`BatchPrefillWithPagedKVCacheWrapper` (causal) for prefill and `BatchDecodeWithPagedKVCacheWrapper` for decode,
backend "fa2", NHD layout, page size 1, BF16 queries and output, K/V cache in FP8 e4m3 (scale 1) or BF16.
Decode uses the tensor-core path when SGLang would (FP8 cache, or a GQA group of at least 4).

The FP8 baselines below use FP8 tensor-core MMAs on sm_90a, where fa2 converts FP8 K/V tiles to BF16:

- ``flashinfer-fp8-xqa`` (decode): `flashinfer.decode.trtllm_batch_decode_with_kv_cache`, which runs TRT-LLM's XQA
  kernel on sm_90 (its "auto" backend; trtllm-gen cubins are Blackwell-only), called as SGLang 0.5.15's
  `trtllm_mha` backend calls it (`--decode-attention-backend trtllm_mha --kv-cache-dtype fp8_e4m3`, the only
  trtllm_mha phase SGLang allows on Hopper): page size 64 (SGLang's default for trtllm_mha), BF16 queries and
  output, the FP8 cache stored NHD and passed as an HND-shaped view, bmm1_scale 1/sqrt(d), bmm2_scale 1. XQA
  converts Q to e4m3 in the kernel, so both matmuls run in FP8.
- ``flashinfer-fp8-fa3`` (prefill): `BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`, FlashInfer's own
  FlashAttention-3 template for sm_90a with its FP8 variant (`DefaultFP8Attention`): e4m3 Q and K/V cache (FA3's
  FP8 path needs an FP8 query), BF16 output, page size 1 as `flashinfer-fp8`. SGLang does not run it (its
  paged prefill wrapper is fixed to fa2).
- ``flashinfer-fp8-fmha-v2`` (prefill): `flashinfer.prefill.trtllm_fmha_v2_prefill`, TRT-LLM's FMHAv2
  warp-specialized sm_90 kernels (JIT-built), e4m3 Q and K/V, BF16 output, layout "Q_PAGED_KV_HND" (K and V pages
  interleaved in one pool, TRT-LLM's cache layout) at page size 64. FlashInfer 0.6.12 logs "The FP8 (e4m3)
  kernels are currently known to hang on SM90" on every call; the hang was fixed before 0.6.12 (flashinfer
  #3276) and the warning removed in 0.6.15 (#3299), so the adapter filters that one message out. SGLang does not
  run it.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from ..mpfa_cli.errors import ProfileError
from .attention_workload import BF16, BF16_Q_FP8_KV, FP8_Q_FP8_KV, AttentionWorkload
from .inputs import random_tensor
from .kernel_adapter import PreparedKernel, paged_slots, sequential_page_table, unpaged

if TYPE_CHECKING:
    import torch

PAGE_SIZE = 1
WORKSPACE_BYTES = 256 * 1024 * 1024
XQA_PAGE_SIZE = 64  # SGLang's page size for trtllm_mha (it accepts 16, 32 or 64 and changes others to 64)
XQA_WORKSPACE_BYTES = 512 * 1024 * 1024  # SGLang's trtllm_mha workspace (DEFAULT_WORKSPACE_SIZE_MB)
FMHA_V2_PAGE_SIZE = 64  # the page size of FlashInfer's published FMHAv2 FP8 paged-prefill measurement (#3299)
FMHA_V2_STALE_WARNING = "The FP8 (e4m3) kernels are currently known to hang on SM90."


def decode_uses_tensor_cores(kv_fp8: bool, q_heads: int, kv_heads: int) -> bool:
    """SGLang's rule for FlashInfer decode: tensor cores for an FP8 cache or a GQA group >= 4."""
    return kv_fp8 or q_heads // kv_heads >= 4


class FlashInferPaged:
    math_dtype = "bf16"  # fa2 converts FP8 K/V tiles to the query dtype and runs BF16 MMAs
    kernel_regex = "BatchPrefillWithPagedKVCacheKernel|BatchDecodeWithPagedKVCacheKernel"
    page_size = PAGE_SIZE

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
        kv_indptr, kv_indices, last_page_len = _page1_table(w, device)
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


def _page1_table(workload: AttentionWorkload, device: "torch.device"
                 ) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """FlashInfer's page table of pages of one key, each sequence's keys in order: (indptr, page indices, last page
    lengths); the indptr also serves as the query indptr of a prefill whose every key is a query."""
    import torch

    w = workload
    indptr = torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device)
    return (indptr, torch.arange(w.batch * w.seq, dtype=torch.int32, device=device),
            torch.ones(w.batch, dtype=torch.int32, device=device))


def _paged_bytes(workload: AttentionWorkload, q_bytes: int, page_size: int) -> int:
    """Q (``q_bytes`` per element) and BF16 O, plus an FP8 K and V cache of whole ``page_size`` pages."""
    w = workload
    return int(w.q_elements() * (q_bytes + 2) + 2 * paged_slots(w, page_size) * w.kv_heads * w.head_dim)


def _fp8_sets(workload: AttentionWorkload, kv_shapes: list[tuple[int, ...]], num_sets: int, device: "torch.device",
              seed: int) -> tuple[list[tuple["torch.Tensor", ...]], list["torch.Tensor"]]:
    """``num_sets`` input sets of the FP8 prefill baselines, each an e4m3 Q [tokens, Hq, d] and an e4m3 tensor of
    each of ``kv_shapes``, and a BF16 output per set."""
    import torch

    w = workload
    fp8 = torch.float8_e4m3fn
    generator = torch.Generator(device=device).manual_seed(seed)
    q_shape = (w.batch * w.seq, w.q_heads, w.head_dim)
    sets = [(random_tensor(q_shape, fp8, device, generator),
             *(random_tensor(shape, fp8, device, generator) for shape in kv_shapes)) for _ in range(num_sets)]
    return sets, [torch.empty(q_shape, dtype=torch.bfloat16, device=device) for _ in range(num_sets)]


def _check_kind(name: str, workload: AttentionWorkload, kind: str, why: str) -> None:
    if workload.kind != kind:
        raise ProfileError(f"{name} is a {kind} baseline: {why}")


class FlashInferXqaFp8:
    """XQA decode over an FP8 cache, as SGLang's trtllm_mha backend runs it on Hopper (see the module docstring)."""

    name = "flashinfer-fp8-xqa"
    tensor_format = BF16_Q_FP8_KV
    math_dtype = "fp8"  # XQA's sm90 kernel converts Q to e4m3: FP8 GMMAs for QK^T and PV
    kernel_regex = "kernel_mha"
    page_size = XQA_PAGE_SIZE

    def set_bytes(self, workload: AttentionWorkload) -> int:
        return _paged_bytes(workload, 2, self.page_size)

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        w = workload
        _check_kind(self.name, w, "decode", "SGLang runs trtllm_mha prefill only on Blackwell (use flashinfer-fp8-fa3 "
                    "or flashinfer-fp8-fmha-v2)")
        import flashinfer
        import torch

        generator = torch.Generator(device=device).manual_seed(seed)
        slots = paged_slots(w, self.page_size)
        kv_shape = (slots // self.page_size, self.page_size, w.kv_heads, w.head_dim)  # SGLang's pool, NHD pages
        sets = [(random_tensor((w.batch, w.q_heads, w.head_dim), torch.bfloat16, device, generator),
                 random_tensor(kv_shape, torch.float8_e4m3fn, device, generator),
                 random_tensor(kv_shape, torch.float8_e4m3fn, device, generator)) for _ in range(num_sets)]
        outputs = [torch.empty_like(q) for q, _, _ in sets]
        workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        page_table = sequential_page_table(w.batch, slots // self.page_size // w.batch, device)
        seq_lens = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)
        scale = 1.0 / math.sqrt(w.head_dim)

        def run(i: int) -> torch.Tensor:
            q, k, v = sets[i]
            # SGLang: [pages, page, heads, dim] -> [pages, heads, page, dim] views, kv_layout "HND" (the default)
            return flashinfer.decode.trtllm_batch_decode_with_kv_cache(
                query=q, kv_cache=(k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)), workspace_buffer=workspace,
                block_tables=page_table, seq_lens=seq_lens, max_seq_len=w.seq, bmm1_scale=scale, bmm2_scale=1.0,
                window_left=-1, out=outputs[i], out_dtype=torch.bfloat16)

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = sets[i]
            # XQA's sm90 kernel loads Q as its math type, the cache's e4m3 (unscaled, round to nearest): the
            # attention it computes is that of e4m3(Q). (Checked against the BF16 Q, it missed the float64 bounds.)
            return q.to(torch.float8_e4m3fn).to(q.dtype), unpaged(k, w), unpaged(v, w)

        return PreparedKernel(run, dense_inputs, num_sets,
                              f"trtllm_batch_decode_with_kv_cache (XQA), page {self.page_size}, BF16 Q, "
                              "FP8 e4m3 KV cache")


class _Fp8Prefill:
    """What the FP8 prefill baselines share: e4m3 Q and K/V, FP8 MMAs, whole pages of ``page_size`` keys."""

    tensor_format = FP8_Q_FP8_KV
    math_dtype = "fp8"
    page_size: int

    def set_bytes(self, workload: AttentionWorkload) -> int:
        return _paged_bytes(workload, 1, self.page_size)


class FlashInferFa3Fp8(_Fp8Prefill):
    """FlashInfer's FA3 template for sm_90a with FP8 Q and K/V (see the module docstring)."""

    name = "flashinfer-fp8-fa3"
    kernel_regex = "FP8PrefillWithKVCacheKernel"
    page_size = PAGE_SIZE

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        w = workload
        _check_kind(self.name, w, "prefill", "FlashInfer's fa3 template has no decode wrapper (use flashinfer-fp8-xqa)")
        import flashinfer
        import torch

        fp8 = torch.float8_e4m3fn
        tokens = w.batch * w.seq
        kv_shape = (tokens, self.page_size, w.kv_heads, w.head_dim)
        sets, outputs = _fp8_sets(w, [kv_shape, kv_shape], num_sets, device, seed)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        indptr, kv_indices, last_page_len = _page1_table(w, device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(indptr, indptr, kv_indices, last_page_len, w.q_heads, w.kv_heads, w.head_dim, self.page_size,
                     causal=True, q_data_type=fp8, kv_data_type=fp8, o_data_type=torch.bfloat16)

        def run(i: int) -> torch.Tensor:
            q, k, v = sets[i]
            return wrapper.run(q, (k, v), out=outputs[i])

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v = sets[i]
            return q, k.squeeze(1), v.squeeze(1)

        return PreparedKernel(run, dense_inputs, num_sets,
                              "BatchPrefillWithPagedKVCacheWrapper fa3, page 1, causal, FP8 e4m3 Q and KV cache")


class _DropStaleFmhaV2Warning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != FMHA_V2_STALE_WARNING


_STALE_WARNING_FILTER = _DropStaleFmhaV2Warning()


class FlashInferFmhaV2Fp8(_Fp8Prefill):
    """TRT-LLM's FMHAv2 paged prefill with FP8 Q and K/V (see the module docstring)."""

    name = "flashinfer-fp8-fmha-v2"
    kernel_regex = "fmha_v2_flash_attention_e4m3"
    page_size = FMHA_V2_PAGE_SIZE

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        w = workload
        _check_kind(self.name, w, "prefill", "FMHAv2 is TRT-LLM's context kernel (use flashinfer-fp8-xqa for decode)")
        import flashinfer
        import torch

        logging.getLogger().addFilter(_STALE_WARNING_FILTER)  # flashinfer.prefill warns through the root logger
        pages = paged_slots(w, self.page_size) // self.page_size
        kv_shape = (pages, 2, w.kv_heads, self.page_size, w.head_dim)  # [page, K|V, head, token, dim]
        sets, outputs = _fp8_sets(w, [kv_shape], num_sets, device, seed)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        page_table = sequential_page_table(w.batch, pages // w.batch, device)
        cu_seqlens = torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device)
        seq_lens = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)
        scale = 1.0 / math.sqrt(w.head_dim)

        def run(i: int) -> torch.Tensor:
            q, kv = sets[i]
            return flashinfer.prefill.trtllm_fmha_v2_prefill(
                (q, kv), "Q_PAGED_KV_HND", workspace, seq_lens=seq_lens, max_q_len=w.seq, max_kv_len=w.seq,
                bmm1_scale=scale, bmm2_scale=1.0, batch_size=w.batch, cum_seq_lens_q=cu_seqlens,
                cum_seq_lens_kv=cu_seqlens, block_tables=page_table, out=outputs[i], mask_mode="causal")

        def dense_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, kv = sets[i]
            k, v = (kv[:, part].transpose(1, 2) for part in (0, 1))  # -> [page, token, head, dim] pages
            return q, unpaged(k, w), unpaged(v, w)

        return PreparedKernel(run, dense_inputs, num_sets,
                              f"trtllm_fmha_v2_prefill Q_PAGED_KV_HND, page {self.page_size}, causal, "
                              "FP8 e4m3 Q and KV cache")
