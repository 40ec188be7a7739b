"""Host side of the sm90 MpFA decode: the split-KV workspace, compiled-kernel cache and the two launches.

`mpfa_decode` never synchronises with the device: the grid comes from the workspace, which is sized for the
largest context on the host (as SGLang sizes its CUDA graphs), and each CTA reads its request's length on the
device. Kernels are compiled once per (KV heads, group, page size) and output dtype, from fake tensors with
symbolic sizes (`compile_decode_kernels` is also what CI runs on a CPU-only machine).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache, check_head_dim, delta_s_row
from mpfa.kernels.sm90.compile import compile_kernel, fake_tensor, kernel_version, target_sm90a
from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90.decode_layout import SCORE_SCALE_LOG2, TILE_KEYS

HEAD_DIM = 128
MIN_PARTITION = 128
MAX_PARTITION = 8192
# Decode warps an SM holds, all of which the partitions aim at by default: the split kernels take <= 168 registers,
# so 12 one-warp CTAs fit an SM (65,536 / (168 x 32)); v2's 15 KB of shared memory per warp keeps 12 too (180 of
# 227 KB); v3's 22.5 KB (3 stages) leave room for 9; v4 (`decode_lean`) keeps v2's ring and takes 128-154
# registers. Every warp is a serial chain, so the grid should fill all slots in one wave (profiles/NOTES.md).
WARPS_PER_SM_TARGET = 12
WARPS_PER_SM = {"v1": WARPS_PER_SM_TARGET, "v2": WARPS_PER_SM_TARGET, "v3": 9, "v4": WARPS_PER_SM_TARGET,
                "v4w14": 14}  # v4 sized for 14 warps per SM: pages of >= 32 keys only (128 registers there)
# Warps per SM the partitions aim at, below a kernel's WARPS_PER_SM: fewer, longer partitions (a warp's fixed costs,
# prologue, peeled tile and partial store, over more tiles; less merge work; fewer loads in flight). None: the
# kernel's WARPS_PER_SM. Bench backends mpfa-dw<n> pin n (`profiles.registry`); this one applies to every decode,
# the plugin's CUDA-graph buffers included. 6 since session 24 (H100, v4: 1.60-1.69x FlashInfer-FP8 at 32K / 128K,
# batch 1 and 8, GQA 32:8 and 40:8, against 1.46-1.61x at 12; profiles/NOTES.md "Session 24 sitting").
PARTITION_WARPS_PER_SM: int | None = 6
LEAN_KERNELS = ("v4", "v4w14")  # `decode_lean`
LEAN_MIN_PAGE_W14 = 32
STAGES = {"v2": 2, "v3": 3}  # cp.async stages of the pipelined split kernel (`decode_pipelined`)
_OUT_DTYPES = {torch.bfloat16: "BFloat16", torch.float32: "Float32"}
KERNEL_ENV = "MPFA_DECODE_KERNEL"  # "v2" (cp.async double buffer), "v3" (3 stages), "v4" (v2 with fewer
# instructions per tile, `decode_lean`), "v4w14" (v4 with partitions for 14 warps per SM) or "v1" (no ring)
DEFAULT_KERNEL = "v4"  # since session 24 (v2 before; v4 1-3% faster on the H100, the same partials up to rounding)


def decode_kernel(kernel: str | None = None) -> str:
    """The decode version `mpfa_decode` runs: ``kernel`` ("v1", "v2", "v3", "v4" or "v4w14"), else
    ``MPFA_DECODE_KERNEL``, else `DEFAULT_KERNEL`."""
    if kernel is None and not os.environ.get(KERNEL_ENV):
        kernel = DEFAULT_KERNEL
    return kernel_version(KERNEL_ENV, kernel, variants=("v3", "v4", "v4w14"))


def partition_warps(kernel: str | None = None, warps_per_sm: int | None = None) -> int:
    """Warps per SM the partitions aim at: ``warps_per_sm`` (1 to the split kernel's ``WARPS_PER_SM``), else
    `PARTITION_WARPS_PER_SM` capped at it (so that an adopted target fits every kernel, v3's 9 slots too), else every
    slot of ``kernel`` (see `decode_kernel`); v4w14, whose name is its target, always 14."""
    kernel = decode_kernel(kernel)
    slots = WARPS_PER_SM[kernel]
    if warps_per_sm is None:
        named = kernel == "v4w14" or PARTITION_WARPS_PER_SM is None
        return slots if named else min(PARTITION_WARPS_PER_SM, slots)
    if not 1 <= warps_per_sm <= slots:
        raise ValueError(f"decode {kernel} partitions aim at 1 to {slots} warps per SM, got {warps_per_sm}")
    return warps_per_sm


def choose_partition_size(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                          kernel: str | None = None, warps_per_sm: int | None = None) -> int:
    """Partition (keys per warp, a multiple of the 32-key tile) giving at most `partition_warps` warps per SM at
    the longest context (one wave), within [MIN_PARTITION, MAX_PARTITION]: shorter partitions cost more
    partial-state traffic and merge work, longer ones leave warp slots empty."""
    warps = partition_warps(kernel, warps_per_sm)
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
        kernel: str | None = None,
        warps_per_sm: int | None = None,
    ) -> DecodeWorkspace:
        """``partition_size`` None: `choose_partition_size` for the split kernel ``kernel`` will run, aimed at
        ``warps_per_sm`` (`partition_warps`)."""
        if batch <= 0 or max_seq_len <= 0:
            raise ValueError(f"need batch > 0 and max_seq_len > 0, got {batch} and {max_seq_len}")
        if partition_size is not None and warps_per_sm is not None:
            raise ValueError("give partition_size or warps_per_sm, not both")
        if partition_size is None:
            device = torch.device(device)
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
            partition_size = choose_partition_size(batch, num_kv_heads, max_seq_len, sms, kernel, warps_per_sm)
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
                           kernel: str | None = None, compensate: bool = True) -> tuple:
    """(split kernel, merge kernel) compiled for sm_90a; callable with torch tensors through TVM-FFI.
    ``kernel``: the split kernel, "v1", "v2" (cp.async double buffer, `decode_pipelined`), "v3" (3 stages), "v4"
    (v2 with fewer instructions per tile, `decode_lean`), "v4w14" (the same kernel, its workspace partitioned for
    14 warps per SM: pages of >= 32 keys only, where it takes 128 registers); None: `decode_kernel`. The merge
    (`decode_merge`) is the same for all. ``compensate`` False: the direct build (no Delta_S read,
    `SplitKVDecodeSm90`)."""
    return _compiled_decode_kernels(num_kv_heads, group, page_size, out_dtype, decode_kernel(kernel), compensate)


@lru_cache(maxsize=None)
def _compiled_decode_kernels(num_kv_heads: int, group: int, page_size: int, out_dtype: str, kernel: str,
                             compensate: bool) -> tuple:
    """`compile_decode_kernels` once per resolved kernel (None and the default's name share one build)."""
    if kernel == "v4w14" and page_size < LEAN_MIN_PAGE_W14:
        raise ValueError(f"decode v4w14 needs pages of >= {LEAN_MIN_PAGE_W14} keys (with pages of {page_size} v4 takes "
                         "148-154 registers: 12 warps per SM, not 14); use v4")
    target_sm90a()
    import cutlass
    from cutlass import Float32, Int32

    from mpfa.kernels.sm90.decode import SplitKVDecodeSm90
    from mpfa.kernels.sm90.decode_merge import DecodeMergeSm90
    from mpfa.kernels.sm90.decode_lean import SplitKVDecodeSm90Lean
    from mpfa.kernels.sm90.decode_pipelined import SplitKVDecodeSm90Pipelined

    hq, hkv, d = num_kv_heads * group, num_kv_heads, HEAD_DIM
    u8, f32 = cutlass.Uint8, Float32
    partials = (fake_tensor(f32, (None, hq, None)), fake_tensor(f32, (None, hq, None)),
                fake_tensor(f32, (None, hq, None, d)))
    seq_lens = fake_tensor(Int32, (None,), align=4)
    split = compile_kernel(
        (SplitKVDecodeSm90Lean(num_kv_heads, group, page_size, compensate) if kernel in LEAN_KERNELS
         else SplitKVDecodeSm90Pipelined(num_kv_heads, group, page_size, STAGES[kernel], compensate) if kernel in STAGES
         else SplitKVDecodeSm90(num_kv_heads, group, page_size, compensate)),
        fake_tensor(u8, (None, hq, d // 2)), fake_tensor(u8, (None, hq, d // 16), align=8),
        fake_tensor(u8, (None, hkv, d // 2)), fake_tensor(u8, (hkv, None, d // 16)),
        fake_tensor(u8, (None, hkv, d)), fake_tensor(cutlass.BFloat16, (hkv, None, delta_s_row(group))),
        fake_tensor(Int32, (None, None), align=4), seq_lens, *partials, Float32(1.0), Int32(TILE_KEYS),
    )
    merge = compile_kernel(
        DecodeMergeSm90(getattr(cutlass, out_dtype)), *partials, seq_lens,
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
    kernel: str | None = None,
    compensate: bool = True,
) -> torch.Tensor:
    """One decode step: ``query`` [B, Hq] centered NVFP4 (from `quantize_to_cache`), each request's keys
    ``seq_lens[b]`` (int32, on the device; the current token included) through ``page_table`` [B, max_pages]
    (int32, pages of ``cache.page_size`` slots) -> attention output [B, Hq, 128] (``out`` or new BF16).
    Sequences must fit the workspace (``seq_lens <= partition_size * num_partitions``; not checked on the host);
    each request's partitions are ``workspace.partition_keys(seq_len)`` keys long. ``kernel``: see
    `decode_kernel` (any version computes the same; size the workspace for it). ``compensate`` False: the direct
    build, which ignores ``cache.delta_s`` (the same output as with a zero side cache)."""
    batch, num_q_heads = query.codes.shape[:2]
    out = out if out is not None else torch.empty((batch, num_q_heads, HEAD_DIM), dtype=torch.bfloat16,
                                                  device=query.codes.device)
    _check_inputs(query, cache, page_table, seq_lens, workspace, out)
    split, merge = compile_decode_kernels(cache.num_kv_heads, num_q_heads // cache.num_kv_heads, cache.page_size,
                                          _OUT_DTYPES[out.dtype], decode_kernel(kernel), compensate)
    lam = float(torch.tensor(math.log2(math.e) * (sm_scale or 1.0 / math.sqrt(HEAD_DIM)), dtype=torch.float32))
    u8 = torch.uint8
    split(query.codes, query.scales.view(u8), cache.k_codes, cache.k_scales.view(u8), cache.v.view(u8),
          cache.delta_s, page_table, seq_lens, workspace.m, workspace.l, workspace.o,
          lam * 2.0**SCORE_SCALE_LOG2, workspace.min_partition)
    merge(workspace.m, workspace.l, workspace.o, seq_lens, out, lam, workspace.min_partition)
    return out
