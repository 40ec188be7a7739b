"""Host side of the sm90 MpFA prefill: input checks, the compiled-kernel cache and the launch.

`mpfa_prefill` attends the packed queries of a batch of sequences (flash-attn varlen: ``cu_seqlens_q``) to each
sequence's cache, read through a page table. Query i of a sequence with ``q_len`` queries and ``seq_lens_k``
keys is the sequence's token ``seq_lens_k - q_len + i`` (the new tokens of a chunked prefill are the last ones
of the sequence and are already in the cache). Kernels are compiled once per (KV heads, group, page size,
causal, output dtype, kernel, compensation) from fake tensors with symbolic sizes (`compile_prefill_kernel` also
runs on a CPU-only machine). The grid needs the longest query length: pass ``max_seqlen_q`` to avoid a
device-to-host copy.

Two kernels with the same numerics and launch signature: v1 (`prefill.PrefillSm90`, per-warp global loads) and v2
(`prefill_staged.PrefillSm90Staged`, a CTA-wide cp.async ring in shared memory; bit-identical outputs), v2 in two CTA
sizes: 4 warps (``v2``) and 8 warps (``v2w8``: twice the rows per staged tile, 1 CTA per SM instead of 2). v3
(`prefill_wgmma.PrefillSm90Wgmma`, wgmma for both GEMMs, GQA groups 4 and 5, pages of >= 64 keys) matches v1 up to FP32
summation order (its 64-key tiles), not bit for bit; on the H200 it passed the GPU tests and ran 1.62x faster than v2 at
64K (profiles/NOTES.md). v3 also comes in two CTA sizes: one warpgroup (``v3``, 16 query rows per head) and two
(``v3w8``, 32 rows: the warpgroups share each tile's copies and K / V expansion; bit-identical to v3). The default is
v7i (below) where it applies (GQA groups 4 and 5, pages of >= 64 keys; session 26 on the H200: 1.26-1.31x FA4-BF16 at
16K-128K, 1.06-1.09x v7c, the default before it, whose output it matches bit for bit; v7c's FP8-QK numerics
"mpfa-qk8tile-psum" had the model-level error its CPU prediction gave; profiles/NOTES.md "Session 26 sitting"),
else v2 (v1 for an odd number of query heads: v2 copies Delta_S as aligned 4-byte words).
``MPFA_PREFILL_KERNEL=v1|v2|v2w8|v3|v3w8|v3c|v3w8c|v4|v4w8|v5|v5w8|v6|v6a..v6n|v7|v7b .. v7i`` or the ``kernel=``
argument of `mpfa_prefill` pins one (the wgmma kernels then refuse other shapes with a clear error). v3c / v3w8c
(`prefill_wgmma_dscol`; v3w8c the default until session 22, the paper's numerics) are v3 / v3w8 with Delta_S as an
extra K column of QK on the tensor cores instead of the accumulator's initial value: v3's numerics up to the FP32
summation order. v4 / v4w8 (`prefill_wgmma_fp8qk`, opt-in only) are v3 / v3w8 with QK^T on FP8 wgmma from Q and K
requantized to e4m3 with power-of-two scales (per query row, per 64-key tile): other numerics, the reference's
``mpfa-qk8tile``. v5 / v5w8
(`prefill_wgmma_fp8pv`, opt-in only) are v4 / v4w8 with PV on FP8 wgmma too (V transposed to e4m3 V^T in shared memory,
P e4m3 in registers, each tile's P V added to O in FP32): the same reference variant. v6 (`prefill_wgmma_ws`, opt-in
only) is v5w8 warp-specialized (a producer warpgroup copies, expands K and transposes V into double-buffered operand
stages; two consumer warpgroups run v5w8's tile body): v5w8's output bit for bit. v6a .. v6n (opt-in, `WS_KERNELS`) are
v6 variants that cut instructions per tile (one PV wgmma, O's rescale folded into FFMA, a table look-up K expansion,
unscaled scores, PV folded every second tile (v6j), P's 448 in the exponent (v6k), 128-key consumer steps (v6l), the row
sums on the PV wgmma (v6n)), add producers or stages (v6g, v6h, v6m) or schedule the consumers (v6f's ping-pong, v6i's
intra-warpgroup overlap); profiles/NOTES.md "Prefill v6 variants": v6a / v6c give v6's output, v6b / v6d / v6e / v6f /
v6g / v6h / v6i differ from it by O's rescale rounding once instead of twice, v6j / v6k / v6l / v6m by the FP8 wgmma's
sums over a pair of tiles (v6l / v6m: and P's e4m3 rounding against the pair's maximum); v6n computes
"mpfa-qk8tile-psum" (l sums the e4m3 P). v6l .. v6n (`WIDE_KERNELS`) take GQA groups 4 and 5, the other FP8 kernels
group 4 only. v7 .. v7i (`prefill_wgmma_pre`, groups 4 and 5; v7i the default) run v6n's consumers on operand
images an operand pass expands once per prefill (v6n's producer work, byte for byte): v6n's output; v7b defers each
step's PV fold under the next step's QK, v7c also copies each image with one bulk copy, v7d also runs each step's PV
under the next step's softmax, v7f also has the consumers take turns issuing their wgmmas (FA3's ping-pong; all
four: v7's output), v7e is v7d computing every 4th P on the FMA pipe (v7's output up to the e4m3 roundings its
polynomial moves), v7g v7e with v7f's turns (v7e's output), v7h v7c with turns around each step's QKs only and v7i
v7c with each step's Delta_S loaded ahead of its QK waits (both v7's output).

``compensate=False`` builds any of them ``direct``: no Delta_S read or copied, the scores start at 0 (-inf where
masked), so the output is the compensated kernel's on an all-zero Delta_S (not MpFA's). It exists to time what the
compensation costs (the paper: ~2%).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import lru_cache

import torch

from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache, check_head_dim, delta_s_row
from mpfa.kernels.sm90.compile import compile_kernel, fake_tensor, kernel_version, target_sm90a
from mpfa.kernels.sm90.decode_layout import SCORE_SCALE_LOG2
from mpfa.kernels.sm90.prefill_staged_layout import WARP_ROWS, cta_shape, warpgroup_rows

HEAD_DIM = 128
BLOCK_M = 64  # query rows per CTA (`prefill.BLOCK_M`; kept here so the host side imports no CuTe DSL)
TILE_KEYS = 32  # keys per KV tile (`prefill.TILE_KEYS`)
_OUT_DTYPES = {torch.bfloat16: "BFloat16", torch.float32: "Float32"}
KERNEL_ENV = "MPFA_PREFILL_KERNEL"  # pins "v1", "v2" (the staged kernel, `prefill_staged`), "v2w8", "v3", "v3w8",
# "v3c", "v3w8c", "v4", "v4w8", "v5", "v5w8", "v6", a v6 variant ("v6a" .. "v6n", `WS_KERNELS`) or "v7" .. "v7i"
STAGED_WARPS = {"v2": 4, "v2w8": 8}  # the staged kernel's variants: warps per CTA
WGMMA_KERNEL = "v7i"  # `prefill_wgmma_pre`: the default where its shape limits allow (v7c before session 25)
WS_KERNELS = {  # opt-in: v5w8 warp-specialized (`prefill_wgmma_ws`: a producer warpgroup, 2 consumers) -> its class
    "v6": "PrefillSm90WgmmaWs",
    "v6a": "PrefillSm90WgmmaWsPv",  # PV in one m64n128k32 fresh accumulator, O rescaled under it (v6's output)
    "v6b": "PrefillSm90WgmmaWsPvFold",  # v6a with O's rescale folded into the add (FFMA; not v6's bits)
    "v6c": "PrefillSm90WgmmaWsLut",  # v6 with the K expansion's e2m1 decoded by table look-up (v6's output)
    "v6d": "PrefillSm90WgmmaWsPvFoldLut",  # v6b + v6c (v6b's output)
    "v6e": "PrefillSm90WgmmaWsUnscaled",  # v6d with Delta_S and the scores unscaled (v6d's output)
    "v6f": "PrefillSm90WgmmaWsPingPong",  # v6e with the consumers taking turns at QK (FA3's ping-pong; v6e's output)
    "v6g": "PrefillSm90WgmmaWsTwoProducers",  # v6e with two producer warpgroups (512 threads; v6e's output)
    "v6h": "PrefillSm90WgmmaWsThreeStages",  # v6g with 3 operand stages (v6e's output)
    "v6i": "PrefillSm90WgmmaWsOverlap",  # v6e with FA3's intra-warpgroup overlap, 3 operand stages (v6e's output)
    "v6j": "PrefillSm90WgmmaWsPairFold",  # v6e with PV folded into O every second tile (not v6e's bits)
    "v6k": "PrefillSm90WgmmaWsPairFoldExp",  # v6j with P's 448 folded into the exponent (v6j's up to rare e4m3 ties)
    "v6l": "PrefillSm90WgmmaWsWideTile",  # v6k's numerics on 128-key consumer steps (one softmax per 128 keys)
    "v6m": "PrefillSm90WgmmaWsWideTileTwoProducers",  # v6l with two producer warpgroups (v6l's output)
    "v6n": "PrefillSm90WgmmaWsWideTileMmaSum",  # v6l with the row sums on the tensor cores ("mpfa-qk8tile-psum")
}
PRE_KERNELS = {  # v6n's consumers on operand images expanded once per prefill (`prefill_wgmma_pre`) -> its class
    "v7": "PrefillSm90WgmmaPre",
    "v7b": "PrefillSm90WgmmaPreDeferredFold",  # v7 with each step's fold under the next step's QK (v7's output)
    "v7c": "PrefillSm90WgmmaPreBulk",  # v7b with each image one bulk copy, up to 8 in flight (v7b's output)
    "v7d": "PrefillSm90WgmmaPreOverlap",  # v7c with each step's PV under the next step's softmax (v7's output)
    "v7e": "PrefillSm90WgmmaPreOverlapPolyExp",  # v7d with every 4th P on the FMA pipe (~4e-4 of those P move)
    "v7f": "PrefillSm90WgmmaPreOverlapPingPong",  # v7d with the consumers' wgmma issues taking turns (v7's output)
    "v7g": "PrefillSm90WgmmaPreOverlapPolyExpPingPong",  # v7e with v7f's turns (v7e's output)
    "v7h": "PrefillSm90WgmmaPreBulkPingPong",  # v7c with turns around each step's QKs (v7's output)
    "v7i": "PrefillSm90WgmmaPreBulkDsAhead",  # v7c with each pair's Delta_S loaded before its QK waits (v7's output)
}
ABLATION_KERNELS = ("v1", *PRE_KERNELS)  # the kernels with compile-time timing ablations (`ablation`)
DS_COLUMN_KERNELS = ("v3c", "v3w8c")  # v3 / v3w8 with Delta_S as an extra K column (`prefill_wgmma_dscol`)
# the wgmma kernel's variants: warpgroups per CTA computing rows (v6*, v7: its consumers; the CTA has one producer
# warpgroup more, v6g / v6h / v6m two)
WGMMA_WARPGROUPS = {"v3": 1, "v3w8": 2, "v3c": 1, "v3w8c": 2, "v4": 1, "v4w8": 2, "v5": 1, "v5w8": 2,
                    **{name: 2 for name in (*WS_KERNELS, *PRE_KERNELS)}}
FP8_QK_KERNELS = ("v4", "v4w8")  # opt-in: v3 with QK on FP8 wgmma (`prefill_wgmma_fp8qk`, "mpfa-qk8tile" numerics)
FP8_PV_KERNELS = ("v5", "v5w8")  # opt-in: v4 with PV on FP8 wgmma too (`prefill_wgmma_fp8pv`, "mpfa-qk8tile")
WGMMA_GROUPS = (4, 5)  # GQA groups of the v3 family (v3, v3w8, v3c, v3w8c; 32:8, 40:8) and of v6l .. v6n: a
# warpgroup's 64 rows are 4 heads x 16 rows or 1 head x 64 rows (`prefill_staged_layout.warpgroup_rows`)
WIDE_KERNELS = ("v6l", "v6m", "v6n")  # v6's 128-key consumer steps (`PrefillSm90WgmmaWsWideTile`), groups 4 and 5
ANY_GROUP_KERNELS = ("v3", "v3w8", *DS_COLUMN_KERNELS, *WIDE_KERNELS, *PRE_KERNELS)  # the others (v4 .. v6k): group 4
TILE_KEYS_WGMMA = 64  # keys per wgmma tile (v3 .. v7)
WGMMA_MIN_PAGE = TILE_KEYS_WGMMA  # v3's 64-key tiles never straddle pages


def prefill_kernel(num_q_heads: int, num_kv_heads: int, page_size: int, kernel: str | None = None) -> str:
    """The prefill kernel that runs: ``kernel`` ("v1", "v2", "v2w8", "v3" or "v3w8"), else ``MPFA_PREFILL_KERNEL``,
    else `WGMMA_KERNEL` (v7i) for the GQA groups `WGMMA_GROUPS` with pages of >= 64 keys and v2 otherwise; v1 with
    an odd number of query heads unless a wgmma kernel is named (v2 copies Delta_S as aligned 4-byte words)."""
    fits_v3 = (num_q_heads % 2 == 0 and num_q_heads % num_kv_heads == 0
               and num_q_heads // num_kv_heads in WGMMA_GROUPS and page_size >= WGMMA_MIN_PAGE)
    if kernel is None and not os.environ.get(KERNEL_ENV) and fits_v3:
        return WGMMA_KERNEL
    name = kernel_version(KERNEL_ENV, kernel, variants=("v2w8", *WGMMA_WARPGROUPS))
    return name if name in WGMMA_WARPGROUPS or num_q_heads % 2 == 0 else "v1"


ROW_SUM_MMA_KERNELS = ("v6n", *PRE_KERNELS)  # row sums on the PV wgmma: l sums the e4m3 P ("mpfa-qk8tile-psum")


def softmax_keys(kernel: str) -> int:
    """Keys per online-softmax update of a wgmma prefill kernel (the reference's ``block_n`` that rounds P as the
    kernel does): 128 for v6l .. v7 (128-key consumer steps aligned to the sequence's 128-key tiles), else 64."""
    return 2 * TILE_KEYS_WGMMA if kernel in (*WIDE_KERNELS, *PRE_KERNELS) else TILE_KEYS_WGMMA


def prefill_numerics(kernel: str) -> str:
    """The reference variant (`mpfa.kernels.attention`) a prefill kernel computes: "mpfa-qk8tile" for the kernels
    with QK on FP8 (v4 .. v6m: Q and K requantized to e4m3), "mpfa-qk8tile-psum" for v6n and v7 (l sums the e4m3
    P), else "mpfa" (the paper's NVFP4 QK, v1 .. v3w8c)."""
    if kernel in ROW_SUM_MMA_KERNELS:
        return "mpfa-qk8tile-psum"
    return "mpfa-qk8tile" if kernel in (*FP8_QK_KERNELS, *FP8_PV_KERNELS, *WS_KERNELS) else "mpfa"


def kernel_block_m(group: int, kernel: str) -> int:
    """Query rows per CTA of ``kernel`` (a `prefill_kernel` name; the grid's row blocks: ``ceil(max_seqlen_q /
    block_m)``)."""
    if kernel in WGMMA_WARPGROUPS:
        return warpgroup_rows(group) * WGMMA_WARPGROUPS[kernel]
    return WARP_ROWS * cta_shape(group, STAGED_WARPS[kernel])[1] if kernel in STAGED_WARPS else BLOCK_M


def wgmma_groups(kernel: str) -> tuple:
    """The GQA groups the wgmma kernel ``kernel`` runs: `WGMMA_GROUPS` for the v3 family and v6l .. v7
    (`ANY_GROUP_KERNELS`), (4,) for the others."""
    return WGMMA_GROUPS if kernel in ANY_GROUP_KERNELS else (4,)


def check_wgmma_shape(group: int, page_size: int, kernel: str) -> None:
    """The wgmma kernels' limits, as a clear error before compiling."""
    groups = wgmma_groups(kernel)
    _require(group in groups, f"the {kernel} (wgmma) prefill supports GQA group {' or '.join(map(str, groups))} only "
                              f"(e.g. 32:8{', 40:8' if 5 in groups else ''}), got group {group}: use kernel v1 or v2")
    _require(page_size >= WGMMA_MIN_PAGE,
             f"the v3 (wgmma) prefill needs page_size >= {WGMMA_MIN_PAGE}, got {page_size}")


def compile_prefill_kernel(num_kv_heads: int, group: int, page_size: int, causal: bool,
                           out_dtype: str = "BFloat16", ablation=None, kernel: str | None = None,
                           compensate: bool = True):
    """The prefill kernel compiled for sm_90a; callable with torch tensors through TVM-FFI. ``ablation``: an
    `ablation.Ablation` for timing only (None: the real kernel; an ablated kernel's output is meaningless;
    `ABLATION_KERNELS` only). ``kernel``: see `prefill_kernel` (None: ``MPFA_PREFILL_KERNEL``, else the default for
    the shape); the wgmma kernels ("v3" .. "v7i") only for pages of >= 64 keys and the GQA groups `wgmma_groups`
    gives. ``compensate`` False: the direct build (no Delta_S, for timing the compensation)."""
    name = prefill_kernel(num_kv_heads * group, num_kv_heads, page_size, kernel)
    if ablation is not None:
        check_ablation(ablation, name)
    if name in WGMMA_WARPGROUPS:
        check_wgmma_shape(group, page_size, name)
    return _compile_prefill_kernel(num_kv_heads, group, page_size, causal, out_dtype, ablation, name,
                                   bool(compensate))


@lru_cache(maxsize=None)
def _compile_prefill_kernel(num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str, ablation,
                            kernel: str, compensate: bool):
    target_sm90a()
    import cutlass
    from cutlass import Float32, Int32

    from mpfa.kernels.sm90 import (prefill, prefill_staged, prefill_wgmma, prefill_wgmma_dscol, prefill_wgmma_fp8pv,
                                   prefill_wgmma_fp8qk, prefill_wgmma_ws)
    from mpfa.kernels.sm90.ablation import FULL

    assert (prefill.BLOCK_M, prefill.TILE_KEYS, prefill_staged.TILE_KEYS) == (BLOCK_M, TILE_KEYS, TILE_KEYS)
    hq, hkv, d = num_kv_heads * group, num_kv_heads, HEAD_DIM
    u8 = cutlass.Uint8
    query = fake_tensor(u8, (None, hq, d // 2)), fake_tensor(u8, (None, hq, d // 16), align=8)
    cache = (fake_tensor(u8, (None, hkv, d // 2)), fake_tensor(u8, (hkv, None, d // 16), align=8),
             fake_tensor(u8, (None, hkv, d)), fake_tensor(cutlass.BFloat16, (hkv, None, delta_s_row(group)), align=8),
             fake_tensor(Int32, (None, None), align=4))  # (+ the page table)
    lengths = fake_tensor(Int32, (None,), align=4), fake_tensor(Int32, (None,), align=4)  # cu_seqlens_q, seq_lens_k
    out = fake_tensor(getattr(cutlass, out_dtype), (None, hq, d))
    if kernel in PRE_KERNELS:
        from mpfa.kernels.sm90 import prefill_wgmma_pre as pre

        images = fake_tensor(u8, (None, pre.IMAGE_BYTES)), fake_tensor(Int32, (None,), align=4)  # (+ image_starts)
        operand_pass = pre.OperandPass(num_kv_heads, group, page_size, causal, out_dtype, compensate)
        attention = getattr(pre, PRE_KERNELS[kernel])(num_kv_heads, group, page_size, causal, out_dtype, compensate,
                                                      ablation=FULL if ablation is None else ablation)
        assert attention.block_m == kernel_block_m(group, kernel)
        return (compile_kernel(operand_pass, *cache, lengths[1], images[1], images[0], Int32(1), Int32(1)),
                compile_kernel(attention, *query, *images, Int32(1), *lengths, out, Float32(1.0), Int32(1)))
    if kernel in WGMMA_WARPGROUPS:
        cls = (getattr(prefill_wgmma_ws, WS_KERNELS[kernel]) if kernel in WS_KERNELS
               else prefill_wgmma_fp8pv.PrefillSm90WgmmaFp8Pv if kernel in FP8_PV_KERNELS
               else prefill_wgmma_fp8qk.PrefillSm90WgmmaFp8Qk if kernel in FP8_QK_KERNELS
               else prefill_wgmma_dscol.PrefillSm90WgmmaDsColumn if kernel in DS_COLUMN_KERNELS
               else prefill_wgmma.PrefillSm90Wgmma)
        launcher = cls(num_kv_heads, group, page_size, causal, out_dtype, compensate,
                       warpgroups=WGMMA_WARPGROUPS[kernel])
        assert launcher.block_m == kernel_block_m(group, kernel)
    elif kernel in STAGED_WARPS:
        launcher = prefill_staged.PrefillSm90Staged(num_kv_heads, group, page_size, causal, out_dtype,
                                                    warps=STAGED_WARPS[kernel], compensate=compensate)
        assert launcher.block_m == kernel_block_m(group, kernel)
    else:
        launcher = prefill.PrefillSm90(num_kv_heads, group, page_size, causal, out_dtype,
                                       FULL if ablation is None else ablation, compensate)
    return compile_kernel(launcher, *query, *cache, *lengths, out, Float32(1.0), Int32(1))


def ablation_ladder(kernel: str) -> tuple:
    """The cumulative ablation ladder of prefill ``kernel`` (`ablation.LADDER` for v1, `ablation.PRE_LADDER` for the
    v7 kernels); a clear error for the others."""
    from mpfa.kernels.sm90.ablation import LADDER, PRE_LADDER

    _require(kernel in ABLATION_KERNELS, f"the compile-time ablations exist for the {', '.join(ABLATION_KERNELS)} "
                                         f"prefill kernels, got {kernel} (pin one with {KERNEL_ENV})")
    return LADDER if kernel == "v1" else PRE_LADDER


def check_ablation(ablation, kernel: str) -> None:
    """``ablation`` removes only pieces that ``kernel`` has (the v7 kernels' K expansion is the operand pass's)."""
    ablation_ladder(kernel)
    _require(kernel == "v1" or ablation.dequant,
             f"the {kernel} prefill has no dequantization to ablate: its K is expanded in the operand pass")


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
    ``kernel``: a `prefill_kernel` name, "v1" .. "v6n" (None: `prefill_kernel`'s choice); v1 .. v3w8c give the
    same output (the wgmma ones up to FP32 summation order); v4 / v4w8 (opt-in) compute QK^T on FP8 from Q and K
    requantized to e4m3 (the reference's "mpfa-qk8tile"), v5 / v5w8 (opt-in) PV on FP8 too (the same variant; v6
    and its variants (opt-in) v5w8's output up to O's rescale rounding). ``compensate=False``: the direct build, for
    timing only (no Delta_S: the output of an all-zero Delta_S). ``seq_lens_k_host``: the host's copy of
    ``seq_lens_k``, where the caller has one (the v7 kernels then size their operand images from the lengths instead
    of batch x the page table's width; it must equal ``seq_lens_k``)."""
    return _prefill(None, query, cache, page_table, cu_seqlens_q, seq_lens_k, max_seqlen_q=max_seqlen_q,
                    causal=causal, sm_scale=sm_scale, out=out, kernel=kernel, compensate=compensate,
                    seq_lens_k_host=seq_lens_k_host)


def mpfa_prefill_ablated(ablation, query: CenteredQuery, cache: MpfaKVCache, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, **kwargs) -> torch.Tensor:
    """`mpfa_prefill` on a kernel with the pieces ``ablation`` (`ablation.Ablation`) removes: for timing the pieces
    only (`mpfa profile characterize`); its output is meaningless unless ``ablation`` is `ablation.FULL`. The kernel
    is ``kernel=`` or `mpfa_prefill`'s (``MPFA_PREFILL_KERNEL``, else the shape's default), one of
    `ABLATION_KERNELS`."""
    from mpfa.kernels.sm90.ablation import Ablation

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
    name = prefill_kernel(num_q_heads, cache.num_kv_heads, cache.page_size, kernel)
    compiled = compile_prefill_kernel(*config, ablation, name, compensate)
    lam = float(torch.tensor(math.log2(math.e) * scale, dtype=torch.float32))
    u8 = torch.uint8
    num_m_blocks = -(-max_seqlen_q // kernel_block_m(group, name))
    if name in PRE_KERNELS:
        _prefill_on_images(compiled, query, cache, page_table, cu_seqlens_q, seq_lens_k, out,
                           lam * 2.0**SCORE_SCALE_LOG2, num_m_blocks, seq_lens_k_host)
        return out
    compiled(query.codes, query.scales.view(u8), cache.k_codes, cache.k_scales.view(u8), cache.v.view(u8),
             cache.delta_s, page_table, cu_seqlens_q, seq_lens_k, out, lam * 2.0**SCORE_SCALE_LOG2, num_m_blocks)
    return out


def image_layout(seq_lens_k: torch.Tensor, page_tiles: int,
                 seq_lens_k_host: Sequence[int] | None = None) -> tuple:
    """The v7 kernels' operand images (`prefill_wgmma_pre`) -> (``image_starts`` int32 [B] on ``seq_lens_k``'s
    device: each sequence's first row in a KV head's block, the 64-key tiles of the sequences before it; rows per KV
    head; the operand pass's grid width in tiles). Without the host's lengths (``seq_lens_k_host``) the rows and
    the width come from the page table's ``page_tiles`` (batch x ``page_tiles`` rows), so nothing is read back from
    the device; with them, the exact sum and maximum."""
    batch = seq_lens_k.shape[0]
    _require(seq_lens_k_host is None or len(seq_lens_k_host) == batch,
             f"seq_lens_k_host must give the {batch} sequences' lengths, got {seq_lens_k_host!r}")
    starts = torch.zeros(batch, dtype=torch.int32, device=seq_lens_k.device)
    if batch > 1:  # (one sequence starts at 0: no device work beyond the zeros)
        tiles_k = torch.div(seq_lens_k[:-1] + (TILE_KEYS_WGMMA - 1), TILE_KEYS_WGMMA, rounding_mode="floor")
        starts[1:] = torch.cumsum(tiles_k, 0)
    if seq_lens_k_host is None:
        return starts, batch * page_tiles, page_tiles
    tiles = [-(-int(n) // TILE_KEYS_WGMMA) for n in seq_lens_k_host]
    return starts, sum(tiles), max(1, *tiles)  # (a grid of at least one tile: its CTAs exit on empty sequences)


def _prefill_on_images(compiled, query, cache, page_table, cu_seqlens_q, seq_lens_k, out, lam_scaled: float,
                       num_m_blocks: int, seq_lens_k_host: Sequence[int] | None) -> None:
    """v7: the operand pass into a fresh images buffer (`prefill_wgmma_pre`: KV heads x `image_layout`'s rows per
    head, 18 KB each), then the attention on it."""
    from mpfa.kernels.sm90.prefill_wgmma_pre import IMAGE_BYTES

    operand_pass, attention = compiled
    image_starts, rows_per_head, grid_tiles = image_layout(
        seq_lens_k, page_table.shape[1] * cache.page_size // TILE_KEYS_WGMMA, seq_lens_k_host)
    images = torch.empty((max(1, cache.num_kv_heads * rows_per_head), IMAGE_BYTES), dtype=torch.uint8,
                         device=out.device)
    u8 = torch.uint8
    operand_pass(cache.k_codes, cache.k_scales.view(u8), cache.v.view(u8), cache.delta_s, page_table, seq_lens_k,
                 image_starts, images, rows_per_head, grid_tiles)
    attention(query.codes, query.scales.view(u8), images, image_starts, rows_per_head, cu_seqlens_q, seq_lens_k, out,
              lam_scaled, num_m_blocks)
