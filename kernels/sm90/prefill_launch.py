"""Host side of the sm90 MpFA prefill: input checks, the compiled-kernel cache and the launch.

`mpfa_prefill` attends the packed queries of a batch of sequences (flash-attn varlen: ``cu_seqlens_q``) to each
sequence's cache, read through a page table. Query i of a sequence with ``q_len`` queries and ``seq_lens_k``
keys is the sequence's token ``seq_lens_k - q_len + i`` (the new tokens of a chunked prefill are the last ones
of the sequence and are already in the cache). `dispatch.prefill_kernel` chooses the kernel (``fp8``, ``exact`` or
``mma-sync``; ``kernel=`` or ``MPFA_PREFILL_KERNEL`` pins one); kernels are compiled once per (KV heads, group, page
size, causal, output dtype, kernel, compensation) from fake tensors with symbolic sizes (`compile_prefill_kernel`
also runs on a CPU-only machine). The grid needs the longest query length: pass ``max_seqlen_q`` to avoid a
device-to-host copy. The fp8 kernel runs in two launches: its operand pass expands the cache into operand images
(`image_layout`), then the attention reads them.

``compensate=False`` builds the direct build of any kernel: no Delta_S read or copied, the scores start at 0 (-inf
where masked), so the output is the compensated kernel's on an all-zero Delta_S (not MpFA's). It exists to time
what the compensation costs (the paper: ~2%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from ..cache_layout import CenteredQuery, MpfaKVCache, check_head_dim, delta_s_row
from . import dispatch
from .compile import compile_kernel, fake_tensor, target_sm90a
from .decode_layout import SCORE_SCALE_LOG2
from .prefill_staged_layout import WARP_ROWS, cta_shape, warpgroup_rows

HEAD_DIM = 128
TILE_KEYS = 32  # keys per ring-stage tile: a page holds whole tiles
IMAGE_TILE_KEYS = 64  # keys per operand image of the fp8 kernel (`prefill_wgmma.TILE_KEYS`)
_OUT_DTYPES = {torch.bfloat16: "BFloat16", torch.float32: "Float32"}


def kernel_block_m(group: int, kernel: str) -> int:
    """Query rows per CTA of prefill ``kernel`` (a `dispatch.PREFILL_KERNELS` name) for GQA ``group``: the grid's
    row blocks are ``ceil(max_seqlen_q / block_m)``."""
    if dispatch.prefill_kernel_spec(kernel).wgmma:
        return 2 * warpgroup_rows(group)  # two warpgroups of rows
    return WARP_ROWS * cta_shape(group)[1]


def compile_prefill_kernel(num_kv_heads: int, group: int, page_size: int, causal: bool,
                           out_dtype: str = "BFloat16", ablation=None, kernel: str | None = None,
                           compensate: bool = True):
    """The prefill kernel compiled for sm_90a; callable with torch tensors through TVM-FFI (the fp8 kernel: its
    operand pass and its attention). ``ablation``: an `ablation.Ablation` for timing only (None: the real kernel;
    an ablated kernel's output is meaningless; the fp8 kernel only). ``kernel``: "fp8", "exact", "mma-sync" or
    None (`dispatch.prefill_kernel`: ``MPFA_PREFILL_KERNEL``, else the default for the shape). ``compensate``
    False: the direct build (no Delta_S, for timing the compensation)."""
    name = dispatch.prefill_kernel(num_kv_heads * group, num_kv_heads, page_size, kernel)
    if ablation is not None:
        check_ablation(ablation, name)
    return _compile_prefill_kernel(num_kv_heads, group, page_size, causal, out_dtype, ablation, name,
                                   bool(compensate))


@lru_cache(maxsize=None)
def _compile_prefill_kernel(num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str, ablation,
                            kernel: str, compensate: bool):
    target_sm90a()
    import cutlass
    from cutlass import Float32, Int32

    hq, hkv, d = num_kv_heads * group, num_kv_heads, HEAD_DIM
    u8 = cutlass.Uint8
    query = fake_tensor(u8, (None, hq, d // 2)), fake_tensor(u8, (None, hq, d // 16), align=8)
    cache = (fake_tensor(u8, (None, hkv, d // 2)), fake_tensor(u8, (hkv, None, d // 16), align=8),
             fake_tensor(u8, (None, hkv, d)), fake_tensor(cutlass.BFloat16, (hkv, None, delta_s_row(group)), align=8),
             fake_tensor(Int32, (None, None), align=4))  # (+ the page table)
    lengths = fake_tensor(Int32, (None,), align=4), fake_tensor(Int32, (None,), align=4)  # cu_seqlens_q, seq_lens_k
    out = fake_tensor(getattr(cutlass, out_dtype), (None, hq, d))
    spec = dispatch.PREFILL_KERNELS[kernel]
    kernel_class = spec.load_class()
    options = {}
    if spec.ablations:
        from .ablation import FULL

        options["ablation"] = FULL if ablation is None else ablation
    if spec.operand_pass_class is not None:
        from .prefill_fp8_layout import image_bytes
        from .prefill_wgmma import TILE_KEYS as WGMMA_TILE_KEYS

        assert WGMMA_TILE_KEYS == IMAGE_TILE_KEYS
        images = fake_tensor(u8, (None, image_bytes(group))), fake_tensor(Int32, (None,), align=4)  # (+ starts)
        operand_pass = spec.load_operand_pass_class()(num_kv_heads, group, page_size, compensate)
        attention = kernel_class(num_kv_heads, group, page_size, causal, out_dtype, compensate, **options)
        assert attention.block_m == kernel_block_m(group, kernel)
        return (compile_kernel(operand_pass, *cache, lengths[1], images[1], images[0], Int32(1), Int32(1)),
                compile_kernel(attention, *query, *images, Int32(1), *lengths, out, Float32(1.0), Int32(1)))
    launcher = kernel_class(num_kv_heads, group, page_size, causal, out_dtype, compensate, **options)
    assert launcher.block_m == kernel_block_m(group, kernel)
    return compile_kernel(launcher, *query, *cache, *lengths, out, Float32(1.0), Int32(1))


def ablation_ladder(kernel: str) -> tuple:
    """The cumulative ablation ladder of prefill ``kernel`` (`ablation.LADDER`: the fp8 kernel's, the one whose
    declaration says ``ablations``); a clear error for the others."""
    from .ablation import LADDER

    ablated = next(k.name for k in dispatch.PREFILL_KERNELS.values() if k.ablations)
    _require(dispatch.prefill_kernel_spec(kernel).ablations,
             f"the compile-time ablations exist for the {ablated} prefill kernel only, got {kernel} "
             f"(pin it with {dispatch.PREFILL_KERNEL_ENV}={ablated})")
    return LADDER


def check_ablation(ablation, kernel: str) -> None:
    """``ablation`` is an `ablation.Ablation` and ``kernel`` has ablations."""
    from .ablation import Ablation

    _require(isinstance(ablation, Ablation), f"ablation must be an Ablation, got {ablation!r}")
    ablation_ladder(kernel)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_prefill_inputs(query: CenteredQuery, cache: MpfaKVCache, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, out: torch.Tensor) -> None:
    """Shapes, dtypes, devices and alignment (nothing that needs the device's values)."""
    total_q, num_q_heads = query.codes.shape[:2]
    check_head_dim(cache.head_dim)
    _require(num_q_heads == cache.num_q_heads, f"query has {num_q_heads} heads, the cache {cache.num_q_heads}")
    _require(cache.page_size >= TILE_KEYS and not cache.page_size & (cache.page_size - 1),
             f"the sm90 prefill kernel needs a power-of-two page_size >= {TILE_KEYS}, got {cache.page_size}")
    _require(tuple(query.codes.shape) == (total_q, num_q_heads, HEAD_DIM // 2)
             and tuple(query.scales.shape) == (total_q, num_q_heads, HEAD_DIM // 16),
             "query must be centered NVFP4 codes [total_q, Hq, 64] and scales [total_q, Hq, 8]")
    batch = seq_lens_k.shape[0] if seq_lens_k.dim() == 1 else -1
    _require(seq_lens_k.dtype == torch.int32 and seq_lens_k.dim() == 1 and batch > 0,
             f"seq_lens_k must be int32 [batch], got {seq_lens_k.dtype} {tuple(seq_lens_k.shape)}")
    _require(cu_seqlens_q.dtype == torch.int32 and tuple(cu_seqlens_q.shape) == (batch + 1,),
             f"cu_seqlens_q must be int32 [{batch + 1}], got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    _require(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == batch
             and page_table.stride(1) == 1, f"page_table must be int32 [{batch}, max_pages] with unit column stride")
    _require(out.dtype in _OUT_DTYPES and tuple(out.shape) == (total_q, num_q_heads, HEAD_DIM) and out.is_contiguous(),
             f"out must be contiguous BF16 or FP32 [{total_q}, {num_q_heads}, {HEAD_DIM}]")
    device = query.codes.device
    for name, tensor, align in (("k_codes", cache.k_codes, 16), ("k_scales", cache.k_scales, 8), ("v", cache.v, 16),
                                ("delta_s", cache.delta_s, 8), ("query codes", query.codes, 16),
                                ("query scales", query.scales, 8), ("cu_seqlens_q", cu_seqlens_q, 4),
                                ("seq_lens_k", seq_lens_k, 4), ("out", out, 16)):
        _require(tensor.device == device, f"{name} is on {tensor.device}, the query on {device}")
        _require(tensor.is_contiguous() and tensor.data_ptr() % align == 0,
                 f"{name} must be contiguous and {align}-byte aligned")
    _require(page_table.device == device, f"page_table is on {page_table.device}, the query on {device}")


def mpfa_prefill(
    query: CenteredQuery,
    cache: MpfaKVCache,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
    compensate: bool = True,
    seq_lens_k_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Prefill attention: ``query`` [total_q, Hq] centered NVFP4 (from `quantize_to_cache`, the tokens of each
    sequence in order), ``cu_seqlens_q`` int32 [B + 1], each sequence's key count ``seq_lens_k`` int32 [B]
    (>= its query count; the queries are its last tokens) through ``page_table`` [B, max_pages] -> attention
    output [total_q, Hq, 128] (``out`` or new BF16). ``max_seqlen_q``: the longest query count (read from
    ``cu_seqlens_q`` with a host synchronisation when omitted; a smaller value leaves rows unwritten).
    ``kernel``: "fp8", "exact", "mma-sync" or None (`dispatch.prefill_kernel`'s choice); their numerics:
    `dispatch.PREFILL_KERNELS`. ``compensate=False``: the direct build, for timing only (no Delta_S: the output of
    an all-zero Delta_S). ``seq_lens_k_host``: the host's copy of ``seq_lens_k``, where the caller has one (the fp8
    kernel then sizes its operand images from the lengths instead of batch x the page table's width; it must equal
    ``seq_lens_k``)."""
    return _prefill(None, query, cache, page_table, cu_seqlens_q, seq_lens_k, max_seqlen_q=max_seqlen_q,
                    causal=causal, sm_scale=sm_scale, out=out, kernel=kernel, compensate=compensate,
                    seq_lens_k_host=seq_lens_k_host)


def mpfa_prefill_ablated(ablation, query: CenteredQuery, cache: MpfaKVCache, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, **kwargs) -> torch.Tensor:
    """`mpfa_prefill` on a kernel with the pieces ``ablation`` (`ablation.Ablation`) removes: for timing the pieces
    only (`mpfa profile characterize`); its output is meaningless unless ``ablation`` is `ablation.FULL`. The kernel
    is ``kernel=`` or `mpfa_prefill`'s (``MPFA_PREFILL_KERNEL``, else the shape's default), the fp8 kernel."""
    from .ablation import Ablation

    _require(isinstance(ablation, Ablation), f"ablation must be an Ablation, got {ablation!r}")
    return _prefill(None if ablation.is_full else ablation, query, cache, page_table, cu_seqlens_q, seq_lens_k,
                    **kwargs)


def _prefill(ablation, query, cache, page_table, cu_seqlens_q, seq_lens_k, *, max_seqlen_q=None, causal=True,
             sm_scale=None, out=None, kernel=None, compensate=True, seq_lens_k_host=None):
    total_q, num_q_heads = query.codes.shape[:2]
    out = out if out is not None else torch.empty((total_q, num_q_heads, HEAD_DIM), dtype=torch.bfloat16,
                                                  device=query.codes.device)
    check_prefill_inputs(query, cache, page_table, cu_seqlens_q, seq_lens_k, out)
    if max_seqlen_q is None:
        max_seqlen_q = int(torch.diff(cu_seqlens_q).max()) if total_q else 0
    _require(max_seqlen_q >= 0, f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    scale = 1.0 / math.sqrt(HEAD_DIM) if sm_scale is None else float(sm_scale)
    _require(math.isfinite(scale) and scale > 0, f"sm_scale must be positive and finite, got {sm_scale!r}")
    if total_q == 0 or max_seqlen_q == 0:
        return out
    group = num_q_heads // cache.num_kv_heads
    config = (cache.num_kv_heads, group, cache.page_size, bool(causal), _OUT_DTYPES[out.dtype])
    name = dispatch.prefill_kernel(num_q_heads, cache.num_kv_heads, cache.page_size, kernel)
    compiled = compile_prefill_kernel(*config, ablation, name, compensate)
    lam = float(torch.tensor(math.log2(math.e) * scale, dtype=torch.float32))
    u8 = torch.uint8
    num_m_blocks = -(-max_seqlen_q // kernel_block_m(group, name))
    if dispatch.PREFILL_KERNELS[name].operand_pass_class is not None:
        _prefill_on_images(compiled, query, cache, page_table, cu_seqlens_q, seq_lens_k, out,
                           lam * 2.0**SCORE_SCALE_LOG2, num_m_blocks, seq_lens_k_host)
        return out
    compiled(query.codes, query.scales.view(u8), cache.k_codes, cache.k_scales.view(u8), cache.v.view(u8),
             cache.delta_s, page_table, cu_seqlens_q, seq_lens_k, out, lam * 2.0**SCORE_SCALE_LOG2, num_m_blocks)
    return out


def image_layout(seq_lens_k: torch.Tensor, page_tiles: int,
                 seq_lens_k_host: Sequence[int] | None = None) -> tuple:
    """The fp8 kernel's operand images (`prefill_fp8_pass`) -> (``image_starts`` int32 [B] on ``seq_lens_k``'s
    device: each sequence's first row in a KV head's block, the 64-key tiles of the sequences before it; rows per KV
    head; the operand pass's grid width in tiles). Without the host's lengths (``seq_lens_k_host``) the rows and
    the width come from the page table's ``page_tiles`` (batch x ``page_tiles`` rows), so nothing is read back from
    the device; with them, the exact sum and maximum."""
    batch = seq_lens_k.shape[0]
    _require(seq_lens_k_host is None or len(seq_lens_k_host) == batch,
             f"seq_lens_k_host must give the {batch} sequences' lengths, got {seq_lens_k_host!r}")
    starts = torch.zeros(batch, dtype=torch.int32, device=seq_lens_k.device)
    if batch > 1:  # (one sequence starts at 0: no device work beyond the zeros)
        tiles_k = torch.div(seq_lens_k[:-1] + (IMAGE_TILE_KEYS - 1), IMAGE_TILE_KEYS, rounding_mode="floor")
        starts[1:] = torch.cumsum(tiles_k, 0)
    if seq_lens_k_host is None:
        return starts, batch * page_tiles, page_tiles
    tiles = [-(-int(n) // IMAGE_TILE_KEYS) for n in seq_lens_k_host]
    return starts, sum(tiles), max(1, *tiles)  # (a grid of at least one tile: its CTAs exit on empty sequences)


def _prefill_on_images(compiled, query, cache, page_table, cu_seqlens_q, seq_lens_k, out, lam_scaled: float,
                       num_m_blocks: int, seq_lens_k_host: Sequence[int] | None) -> None:
    """The fp8 kernel: the operand pass into a fresh images buffer (KV heads x `image_layout`'s rows per head,
    `prefill_fp8_layout.image_bytes` of the group each), then the attention on it."""
    from .prefill_fp8_layout import image_bytes

    operand_pass, attention = compiled
    image_starts, rows_per_head, grid_tiles = image_layout(
        seq_lens_k, page_table.shape[1] * cache.page_size // IMAGE_TILE_KEYS, seq_lens_k_host)
    images = torch.empty((max(1, cache.num_kv_heads * rows_per_head), image_bytes(cache.group)), dtype=torch.uint8,
                         device=out.device)
    u8 = torch.uint8
    operand_pass(cache.k_codes, cache.k_scales.view(u8), cache.v.view(u8), cache.delta_s, page_table, seq_lens_k,
                 image_starts, images, rows_per_head, grid_tiles)
    attention(query.codes, query.scales.view(u8), images, image_starts, rows_per_head, cu_seqlens_q, seq_lens_k, out,
              lam_scaled, num_m_blocks)
