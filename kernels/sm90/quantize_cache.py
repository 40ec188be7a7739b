"""Fused quantize + paged-cache write for MpFA (SGLang's KV-write path), a Triton element-wise pass.

For every new token and KV head: center K with the request's frozen K mean and write NVFP4 codes + e4m3 block
scales, FP8 V (scale 1), and Delta_S[j, h] = Q_bar[h] . K_c[j] for the group's query heads into the token's slot
(`cache_layout`: K codes and V token-major, K scales and Delta_S head-major, Delta_S padding left unwritten);
center the group's query heads with Q_bar and return them in NVFP4 (this step's attention operand). Formats are
bit-exact with `mpfa.kernels.formats` applied to ``x - mean`` in FP32 (x BF16, or FP32 as the rotated Q and K of
``MPFA_NUMERICS=had128-k46``; a BF16 mean widened exactly); Delta_S is an FP32 dot product
rounded to BF16, so it can differ from the reference's summation order by one BF16 ulp where the FP32 sums
straddle a rounding boundary. K blocks whose scale would overflow e4m3 saturate at 448 (the reference raises).
``k_scale_choice`` picks K's block scales as `formats.quantize_nvfp4`'s ``scale_choice`` ("6", the paper's, or
"4/6", a compile-time option of the kernel); Q's are always "6". Readers are unchanged: they decode codes x scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cache_layout import CenteredQuery, MpfaKVCache, check_head_dim
from ..formats import NVFP4_SCALE_CHOICES
from ..smoothing import SmoothingMeans
from .triton_formats import bf16_bits, e4m3_code, nvfp4_block

_WIDENED_DTYPES = (torch.bfloat16, torch.float32)  # Q, K and the means: read as either, widened to FP32
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "FP32"}


@triton.jit
def _load_centered(x_ptr, mean_ptr, rows, row_mask, NUM_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows [R] of x (BF16 or FP32) minus their means (BF16 or FP32, widened), in FP32, split into even and odd
    elements [R, NUM_BLOCKS, 8]."""
    blk = tl.arange(0, NUM_BLOCKS)[None, :, None]
    pair = tl.arange(0, 8)[None, None, :]
    even = rows[:, None, None] * HEAD_DIM + blk * 16 + 2 * pair
    mask = row_mask[:, None, None] & (blk >= 0) & (pair >= 0)
    x_even = tl.load(x_ptr + even, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    mean_even = tl.load(mean_ptr + even, mask=mask, other=0.0).to(tl.float32)
    mean_odd = tl.load(mean_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    return x_even - mean_even, x_odd - mean_odd


@triton.jit
def _quantize_cache_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, req_ptr, q_mean_ptr, k_mean_ptr,
    k_codes_ptr, k_scales_ptr, v_cache_ptr, delta_s_ptr, q_codes_ptr, q_scales_ptr,
    q_stride, k_stride, v_stride, num_slots,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, DS_ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr, K_SCALE_46: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_blocks: tl.constexpr = HEAD_DIM // 16
    num_q_heads: tl.constexpr = NUM_KV_HEADS * GROUP
    slot = tl.load(slot_ptr + token).to(tl.int64)
    req = tl.load(req_ptr + token).to(tl.int64)
    one = tl.full((1,), 0, tl.int32) == 0

    # K: centered NVFP4 codes and scales.
    k_even, k_odd = _load_centered(
        k_ptr + token * k_stride + kv_head * HEAD_DIM, k_mean_ptr + (req * NUM_KV_HEADS + kv_head) * HEAD_DIM,
        tl.full((1,), 0, tl.int32), one, num_blocks, HEAD_DIM)
    k_bytes, k_scale = nvfp4_block(k_even, k_odd, K_SCALE_46)
    cache_row = slot * NUM_KV_HEADS + kv_head  # token-major K codes and V: [slot, kv_head]
    head_row = kv_head.to(tl.int64) * num_slots + slot  # head-major K scales and Delta_S: [kv_head, slot]
    byte_idx = tl.arange(0, num_blocks)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    tl.store(k_codes_ptr + cache_row * (HEAD_DIM // 2) + byte_idx, k_bytes.to(tl.uint8))
    tl.store(k_scales_ptr + head_row * num_blocks + tl.arange(0, num_blocks)[None, :], k_scale.to(tl.uint8))

    # V: FP8 e4m3 with scale 1, saturating.
    d = tl.arange(0, HEAD_DIM)
    v = tl.load(v_ptr + token * v_stride + kv_head * HEAD_DIM + d).to(tl.float32)
    tl.store(v_cache_ptr + cache_row * HEAD_DIM + d, e4m3_code(tl.minimum(tl.maximum(v, -448.0), 448.0)).to(tl.uint8))

    # The group's query heads: Delta_S from Q_bar and the centered (unquantized) K, and centered NVFP4 Q.
    g = tl.arange(0, GROUP_POW2)
    heads = kv_head * GROUP + g
    valid = g < GROUP
    blk = tl.arange(0, num_blocks)[None, :, None]
    pair = tl.arange(0, 8)[None, None, :]
    mean_idx = (req * num_q_heads + heads)[:, None, None] * HEAD_DIM + blk * 16 + 2 * pair
    head_mask = valid[:, None, None] & (blk >= 0) & (pair >= 0)
    qm_even = tl.load(q_mean_ptr + mean_idx, mask=head_mask, other=0.0).to(tl.float32)
    qm_odd = tl.load(q_mean_ptr + mean_idx + 1, mask=head_mask, other=0.0).to(tl.float32)
    ds = tl.sum(tl.sum(qm_even * k_even + qm_odd * k_odd, axis=2), axis=1)
    tl.store(delta_s_ptr + head_row * DS_ROW + g, bf16_bits(ds).to(tl.int16), mask=valid)

    q_even, q_odd = _load_centered(
        q_ptr + token * q_stride + kv_head * GROUP * HEAD_DIM, q_mean_ptr + (req * num_q_heads + kv_head * GROUP) * HEAD_DIM,
        g, valid, num_blocks, HEAD_DIM)
    q_bytes, q_scale = nvfp4_block(q_even, q_odd, False)
    q_row = token * num_q_heads + heads
    tl.store(q_codes_ptr + q_row[:, None, None] * (HEAD_DIM // 2) + byte_idx, q_bytes.to(tl.uint8), mask=head_mask)
    tl.store(q_scales_ptr + q_row[:, None] * num_blocks + tl.arange(0, num_blocks)[None, :], q_scale.to(tl.uint8),
             mask=valid[:, None])


def _check_rows(name: str, x: torch.Tensor, tokens: int, heads: int, head_dim: int,
                dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> None:
    if x.shape != (tokens, heads, head_dim) or x.dtype not in dtypes or x.stride()[1:] != (head_dim, 1):
        allowed = " or ".join(_DTYPE_NAMES[d] for d in dtypes)
        raise ValueError(f"{name} must be {allowed} [{tokens}, {heads}, {head_dim}] with contiguous heads, got "
                         f"{x.dtype} {tuple(x.shape)}")


def quantize_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    request_index: torch.Tensor,
    means: SmoothingMeans,
    cache: MpfaKVCache,
    out: CenteredQuery | None = None,
    *,
    k_scale_choice: str = "6",
) -> CenteredQuery:
    """Write the new tokens into ``cache`` and return their centered NVFP4 Q.

    q [T, Hq, d], k [T, Hkv, d] BF16 or FP32, v [T, Hkv, d] BF16 (token stride free); ``slots`` [T] the cache slot
    of each token (SGLang's ``out_cache_loc``); ``request_index`` [T] int32, the request each token belongs to (row
    of the means); ``means`` the requests' frozen means (q_mean [B, Hq, d], k_mean [B, Hkv, d], contiguous, BF16 as the
    SGLang plugin stores them or FP32, widened to FP32 either way); ``k_scale_choice``: K's NVFP4 block-scale
    choice, "6" (the paper's) or "4/6" (`formats.quantize_nvfp4`).
    ``out`` may be preallocated (CUDA-graph capture); no host synchronisation happens here."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = cache.num_kv_heads
    check_head_dim(head_dim)
    if num_q_heads != cache.num_q_heads or head_dim != cache.head_dim:
        raise ValueError(f"q [{tokens}, {num_q_heads}, {head_dim}] does not match the cache "
                         f"(Hq={cache.num_q_heads}, d={cache.head_dim})")
    _check_rows("q", q, tokens, num_q_heads, head_dim, _WIDENED_DTYPES)
    _check_rows("k", k, tokens, num_kv_heads, head_dim, _WIDENED_DTYPES)
    _check_rows("v", v, tokens, num_kv_heads, head_dim)
    if k_scale_choice not in NVFP4_SCALE_CHOICES:
        raise ValueError(f"k_scale_choice must be one of {', '.join(NVFP4_SCALE_CHOICES)}, got {k_scale_choice!r}")
    if slots.shape != (tokens,) or request_index.shape != (tokens,):
        raise ValueError(f"slots and request_index must both be [{tokens}], got {tuple(slots.shape)} and "
                         f"{tuple(request_index.shape)}")
    for name, mean, heads in (("q_mean", means.q_mean, num_q_heads), ("k_mean", means.k_mean, num_kv_heads)):
        if (mean.dim() != 3 or mean.shape[1:] != (heads, head_dim) or mean.dtype not in _WIDENED_DTYPES
                or not mean.is_contiguous()):
            raise ValueError(f"{name} must be contiguous BF16 or FP32 [batch, {heads}, {head_dim}], got {mean.dtype} "
                             f"{tuple(mean.shape)}")
    out = out if out is not None else CenteredQuery.allocate(tokens, num_q_heads, head_dim, q.device)
    if tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    _quantize_cache_kernel[(tokens, num_kv_heads)](
        q, k, v, slots, request_index, means.q_mean, means.k_mean,
        cache.k_codes, cache.k_scales.view(torch.uint8), cache.v.view(torch.uint8), cache.delta_s.view(torch.int16),
        out.codes, out.scales.view(torch.uint8),
        q.stride(0), k.stride(0), v.stride(0), cache.num_slots,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_POW2=triton.next_power_of_2(group),
        DS_ROW=cache.delta_s.shape[2], HEAD_DIM=head_dim, K_SCALE_46=k_scale_choice == "4/6",
    )
    return out
