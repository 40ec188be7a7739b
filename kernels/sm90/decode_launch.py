"""Host side of the sm90 MpFA decode: the split-KV workspace, compiled-kernel cache and the two launches.

`mpfa_decode` never synchronises with the device: the grid comes from the workspace, which is sized for the
largest context on the host (as SGLang sizes its CUDA graphs), and each CTA reads its request's length on the
device. Kernels are compiled once per (KV heads, group, page size) and output dtype, from fake tensors with
symbolic sizes (`compile_decode_kernels` is also what CI runs on a CPU-only machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..cache_layout import CenteredQuery, MpfaKVCache, check_head_dim, delta_s_row
from . import decode_layout as lay
from . import dispatch
from .compile import compile_kernel, fake_tensor, target_sm90a
from .decode_layout import SCORE_SCALE_LOG2, TILE_KEYS

HEAD_DIM = 128
MIN_PARTITION = 128
MAX_PARTITION = 8192
# Decode warps an SM holds: the split kernel takes <= 168 registers (12 one-warp CTAs: 65,536 / (168 x 32)) and 15 KB
# of shared memory per warp (12 x 16 KB with the CTA reserve, of 227 KB).
WARPS_PER_SM = 12
# Warps per SM the partitions aim at by default, below `WARPS_PER_SM`: fewer, longer partitions (a warp's fixed
# costs, prologue, peeled tile and partial store, over more tiles; less merge work; fewer loads in flight). Every
# decode follows it, the plugin's CUDA-graph buffers included; measured on the H100 (docs/kernels.md): 1.60-1.69x
# FlashInfer-FP8 at 32K / 128K, batch 1 and 8, GQA 32:8 and 40:8, against 1.46-1.61x on every slot.
PARTITION_WARPS_PER_SM = 6
_OUT_DTYPES = {torch.bfloat16: "BFloat16", torch.float32: "Float32"}


def partition_warps(warps_per_sm: int | None = None) -> int:
    """Warps per SM the partitions aim at: ``warps_per_sm`` (1 to `WARPS_PER_SM`), else
    `PARTITION_WARPS_PER_SM`."""
    if warps_per_sm is None:
        return PARTITION_WARPS_PER_SM
    if not 1 <= warps_per_sm <= WARPS_PER_SM:
        raise ValueError(f"decode partitions aim at 1 to {WARPS_PER_SM} warps per SM, got {warps_per_sm}")
    return warps_per_sm


def choose_partition_size(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                          warps_per_sm: int | None = None) -> int:
    """Partition (keys per warp, a multiple of the 32-key tile) giving at most `partition_warps` warps per SM at
    the longest context (one wave), within [MIN_PARTITION, MAX_PARTITION]: shorter partitions cost more
    partial-state traffic and merge work, longer ones leave warp slots empty."""
    warps = partition_warps(warps_per_sm)
    parts = max(1, warps * num_sms // max(1, batch * num_kv_heads))  # per request
    size = TILE_KEYS * math.ceil(max_seq_len / parts / TILE_KEYS)  # -> at most `parts` partitions
    return min(MAX_PARTITION, max(MIN_PARTITION, size))


@dataclass(frozen=True)
class DecodeWorkspace:
    """Preallocated split-KV state: m, l [B, Hq, P] and O [B, Hq, P, d] FP32 for P partitions of at most
    ``partition_size`` keys (contents are scratch; sized for ``max_seq_len``). A request of n keys uses
    partitions of ``partition_keys(n)`` keys: ``partition_size`` for every request when ``min_partition`` equals
    it (`allocate`'s default), its keys spread over all P partitions otherwise (CUDA-graph buffers, whose P is
    fixed by the longest context)."""

    partition_size: int
    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor
    min_partition: int

    def partition_keys(self, seq_len: int) -> int:
        return lay.partition_keys(seq_len, self.num_partitions, self.min_partition)

    @classmethod
    def allocate(
        cls,
        batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        max_seq_len: int,
        device: torch.device | str,
        partition_size: int | None = None,
        min_partition: int | None = None,
        warps_per_sm: int | None = None,
    ) -> DecodeWorkspace:
        """``partition_size`` None: `choose_partition_size`, aimed at ``warps_per_sm`` (`partition_warps`)."""
        if batch <= 0 or max_seq_len <= 0:
            raise ValueError(f"need batch > 0 and max_seq_len > 0, got {batch} and {max_seq_len}")
        if partition_size is not None and warps_per_sm is not None:
            raise ValueError("give partition_size or warps_per_sm, not both")
        if partition_size is None:
            device = torch.device(device)
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
            partition_size = choose_partition_size(batch, num_kv_heads, max_seq_len, sms, warps_per_sm=warps_per_sm)
        if partition_size <= 0 or partition_size % TILE_KEYS:
            raise ValueError(f"partition_size must be a positive multiple of {TILE_KEYS}, got {partition_size}")
        parts = -(-max_seq_len // partition_size)
        m = torch.empty((batch, num_q_heads, parts), dtype=torch.float32, device=device)
        min_partition = partition_size if min_partition is None else min_partition
        if min_partition <= 0 or min_partition % TILE_KEYS or min_partition > partition_size:
            raise ValueError(f"min_partition must be a positive multiple of {TILE_KEYS} <= partition_size "
                             f"({partition_size}), got {min_partition}")
        return cls(partition_size, m, torch.empty_like(m),
                   torch.empty((batch, num_q_heads, parts, HEAD_DIM), dtype=torch.float32, device=device),
                   min_partition)

    @property
    def num_partitions(self) -> int:
        return self.m.shape[2]


def compile_decode_kernels(num_kv_heads: int, group: int, page_size: int, out_dtype: str = "BFloat16",
                           compensate: bool = True) -> tuple:
    """(split kernel, merge kernel) compiled for sm_90a; callable with torch tensors through TVM-FFI. The split
    kernel and the merge are `dispatch.DECODE_KERNEL`'s (`decode.SplitKVDecodeSm90`, `decode_merge.DecodeMergeSm90`).
    ``compensate`` False: the direct build (no Delta_S read)."""
    return _compiled_decode_kernels(num_kv_heads, group, page_size, out_dtype, compensate)


@lru_cache(maxsize=None)
def _compiled_decode_kernels(num_kv_heads: int, group: int, page_size: int, out_dtype: str,
                             compensate: bool) -> tuple:
    """`compile_decode_kernels` once per configuration, however its arguments were passed."""
    target_sm90a()
    import cutlass
    from cutlass import Float32, Int32

    split_class, merge_class = dispatch.DECODE_KERNEL.load_classes()
    hq, hkv, d = num_kv_heads * group, num_kv_heads, HEAD_DIM
    u8, f32 = cutlass.Uint8, Float32
    partials = (fake_tensor(f32, (None, hq, None)), fake_tensor(f32, (None, hq, None)),
                fake_tensor(f32, (None, hq, None, d)))
    seq_lens = fake_tensor(Int32, (None,), align=4)
    split = compile_kernel(
        split_class(num_kv_heads, group, page_size, compensate),
        fake_tensor(u8, (None, hq, d // 2)), fake_tensor(u8, (None, hq, d // 16), align=8),
        fake_tensor(u8, (None, hkv, d // 2)), fake_tensor(u8, (hkv, None, d // 16)),
        fake_tensor(u8, (None, hkv, d)), fake_tensor(cutlass.BFloat16, (hkv, None, delta_s_row(group))),
        fake_tensor(Int32, (None, None), align=4), seq_lens, *partials, Float32(1.0), Int32(TILE_KEYS),
    )
    merge = compile_kernel(
        merge_class(getattr(cutlass, out_dtype)), *partials, seq_lens,
        fake_tensor(getattr(cutlass, out_dtype), (None, hq, d)), Float32(1.0), Int32(TILE_KEYS),
    )
    return split, merge


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_inputs(query: CenteredQuery, cache: MpfaKVCache, page_table: torch.Tensor, seq_lens: torch.Tensor,
                  workspace: DecodeWorkspace, out: torch.Tensor) -> None:
    batch, num_q_heads = query.codes.shape[:2]
    check_head_dim(cache.head_dim)
    _require(num_q_heads == cache.num_q_heads, f"query has {num_q_heads} heads, the cache {cache.num_q_heads}")
    _require(tuple(query.codes.shape) == (batch, num_q_heads, HEAD_DIM // 2) and query.codes.is_contiguous()
             and query.scales.is_contiguous(), "query must be one contiguous centered NVFP4 row per request")
    _require(seq_lens.dtype == torch.int32 and tuple(seq_lens.shape) == (batch,),
             f"seq_lens must be int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    _require(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == batch
             and page_table.stride(1) == 1, f"page_table must be int32 [{batch}, max_pages] with unit column stride")
    _require(tuple(workspace.m.shape[:2]) == (batch, num_q_heads),
             f"workspace is for [{tuple(workspace.m.shape[:2])}] (batch, heads), not [{batch}, {num_q_heads}]")
    _require(out.dtype in _OUT_DTYPES and tuple(out.shape) == (batch, num_q_heads, HEAD_DIM) and out.is_contiguous(),
             f"out must be contiguous BF16 or FP32 [{batch}, {num_q_heads}, {HEAD_DIM}]")
    for name, tensor in (("k_codes", cache.k_codes), ("k_scales", cache.k_scales), ("v", cache.v),
                         ("delta_s", cache.delta_s), ("query codes", query.codes), ("query scales", query.scales)):
        _require(tensor.is_contiguous() and tensor.data_ptr() % 16 == 0, f"{name} must be contiguous and 16-byte aligned")


def mpfa_decode(
    query: CenteredQuery,
    cache: MpfaKVCache,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    workspace: DecodeWorkspace,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    compensate: bool = True,
) -> torch.Tensor:
    """One decode step: ``query`` [B, Hq] centered NVFP4 (from `quantize_to_cache`), each request's keys
    ``seq_lens[b]`` (int32, on the device; the current token included) through ``page_table`` [B, max_pages]
    (int32, pages of ``cache.page_size`` slots) -> attention output [B, Hq, 128] (``out`` or new BF16).
    Sequences must fit the workspace (``seq_lens <= partition_size * num_partitions``; not checked on the host);
    each request's partitions are ``workspace.partition_keys(seq_len)`` keys long. ``compensate`` False: the direct
    build, which ignores ``cache.delta_s`` (the same output as with a zero side cache)."""
    batch, num_q_heads = query.codes.shape[:2]
    out = out if out is not None else torch.empty((batch, num_q_heads, HEAD_DIM), dtype=torch.bfloat16,
                                                  device=query.codes.device)
    _check_inputs(query, cache, page_table, seq_lens, workspace, out)
    split, merge = compile_decode_kernels(cache.num_kv_heads, num_q_heads // cache.num_kv_heads, cache.page_size,
                                          _OUT_DTYPES[out.dtype], compensate)
    lam = float(torch.tensor(math.log2(math.e) * (sm_scale or 1.0 / math.sqrt(HEAD_DIM)), dtype=torch.float32))
    u8 = torch.uint8
    split(query.codes, query.scales.view(u8), cache.k_codes, cache.k_scales.view(u8), cache.v.view(u8),
          cache.delta_s, page_table, seq_lens, workspace.m, workspace.l, workspace.o,
          lam * 2.0**SCORE_SCALE_LOG2, workspace.min_partition)
    merge(workspace.m, workspace.l, workspace.o, seq_lens, out, lam, workspace.min_partition)
    return out
