"""SLOW REFERENCE PATH for prefill (extend): MpFA has no prefill kernel yet.

Runs `mpfa.kernels.reference`'s tiled algorithm (its ``_kv_tiles`` / ``_normalize``, i.e. ``attention(...)``
after operand preparation) in PyTorch on the *cache contents*: the centered NVFP4 Q the KV-write kernel returned,
the NVFP4 K codes and scales, FP8 V and BF16 Delta_S read back through each request's slots. The KV-write kernel
is bit-exact with the reference formats given the means, so this equals ``reference.attention(q, k, v,
variant=..., causal=True, means=frozen means)`` on the raw inputs (Delta_S up to one BF16 ulp), including a chunk
whose prefix was written by an earlier chunk. Under ``MPFA_NUMERICS=had128-k46`` the cache and Q hold the rotated
operands, and ``variant`` is the served one (``mpfa-had128-k46``: the reference rotates the raw inputs itself, and
the frozen means are the rotated inputs'). Rows are processed in blocks of ``BLOCK_M`` queries (per-row results
do not depend on the block; only the 128-key tiles do). It synchronises with the host and is orders of magnitude
slower than a kernel: its timings must never be reported as MpFA's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...kernels.cache_layout import CenteredQuery, MpfaKVCache
from ...kernels.formats import NVFP4Tensor, dequantize_nvfp4
from ...kernels.reference import VARIANTS, VariantSpec, _kv_tiles, _normalize

logger = logging.getLogger(__name__)

BLOCK_M = 1024
BLOCK_N = 128  # the reference's default key tile
_warned = False


def warn_slow_path_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("MpFA prefill runs the SLOW REFERENCE PATH (PyTorch reference on the quantized cache, "
                       "no prefill kernel yet): prefill/TTFT timings of this server are NOT MpFA's")


@contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """TF32 off for the reference's FP32 matmuls (its FP8 P / 448 is not TF32-exact); restored afterwards."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def reference_extend(query: CenteredQuery, cache: MpfaKVCache, kv_slots: torch.Tensor, cu_q: list[int],
                     cu_k: list[int], *, variant: str, sm_scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole sequence -> FP32 [total_q, Hq, d].

    ``query``: centered NVFP4 Q of the new tokens [total_q, Hq] (from `quantize_to_cache`); ``kv_slots``: the cache
    slots of every request's tokens in order, prefix then new tokens [total_k]; ``cu_q`` / ``cu_k``: host
    cumulative lengths [B + 1]. Bottom-right-aligned causal mask: query i of a request sees keys
    ``j <= i + kv_len - q_len``."""
    spec = VARIANTS[variant]
    warn_slow_path_once()
    slots = kv_slots.to(cache.k_codes.device, torch.long)
    q_op = dequantize_nvfp4(NVFP4Tensor(query.codes, query.scales))
    k_op = dequantize_nvfp4(NVFP4Tensor(cache.k_codes[slots], cache.token_scales(slots)))
    v_op = cache.v[slots].float()
    ds = cache.token_delta_s(slots).float() if spec.smoothing else None
    lam = math.log2(math.e) * sm_scale
    out = torch.full(q_op.shape, math.nan, dtype=torch.float32, device=q_op.device)
    with exact_fp32_matmul():
        _tiles(out, q_op, k_op, v_op, ds, cu_q, cu_k, spec, lam)
    return out


def _tiles(out: torch.Tensor, q_op: torch.Tensor, k_op: torch.Tensor, v_op: torch.Tensor, ds: torch.Tensor | None,
           cu_q: list[int], cu_k: list[int], spec: VariantSpec, lam: float) -> None:
    """The reference's per-request, per-row-block online softmax, written into ``out``."""
    for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        if qb == qa:
            continue
        k_s, v_s = k_op[ka:kb].transpose(0, 1), v_op[ka:kb].transpose(0, 1)
        ds_s = None if ds is None else ds[ka:kb].transpose(0, 1)
        for row in range(qa, qb, BLOCK_M):
            rows = torch.arange(row - qa, min(row + BLOCK_M, qb) - qa, device=q_op.device)
            q_pos = rows + (kb - ka) - (qb - qa)
            q_tile = q_op[qa + rows].transpose(0, 1).contiguous()
            _, l, acc = _kv_tiles(q_tile, k_s, v_s, ds_s, q_pos, (0, kb - ka), spec=spec, lam=lam, block_n=BLOCK_N,
                                  reverse=True)
            out[qa + rows] = _normalize(acc, l).transpose(0, 1)
