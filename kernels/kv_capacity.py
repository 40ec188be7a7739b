"""KV-cache storage per token per KV head (K + V) for each cache format.

* ``bf16``: 2 bytes per element for K and V -> 4d.
* ``fp8``: e4m3 K and V -> 2d (per-tensor scales are per layer, not per token).
* ``mpfa``: NVFP4 K codes d/2 + e4m3 scales d/16, FP8 V d, and the Delta_S side cache: Delta_S[j] = Q_bar . K_c[j]
  is per *query* head, so with GQA a KV head's token carries ``group`` = Hq/Hkv BF16 values, stored in a row of
  `cache_layout.delta_s_row` (group rounded up to a multiple of 4) BF16 entries: the bytes the cache occupies and
  decode reads. The frozen means are per request (d * (Hq + Hkv) FP32 per layer), not per token, and are not
  counted.

``format_capacity_table()`` renders the table, including how close MpFA comes to "1/2.56 of BF16".
"""

from __future__ import annotations

from .cache_layout import delta_s_row
from .formats import NVFP4_BLOCK

CACHE_FORMATS = ("bf16", "fp8", "mpfa")
_BF16_BYTES = 2


def kv_bytes_per_token(cache_format: str, head_dim: int, group_size: int = 1) -> float:
    """Bytes of K + V (+ Delta_S for MpFA) per token per KV head; ``group_size`` = Hq / Hkv."""
    if head_dim <= 0 or head_dim % NVFP4_BLOCK:
        raise ValueError(f"head_dim must be a positive multiple of {NVFP4_BLOCK}, got {head_dim}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if cache_format == "bf16":
        return 2 * head_dim * _BF16_BYTES
    if cache_format == "fp8":
        return 2 * head_dim
    if cache_format == "mpfa":
        return head_dim / 2 + head_dim / NVFP4_BLOCK + head_dim + _BF16_BYTES * delta_s_row(group_size)
    raise ValueError(f"unknown cache format {cache_format!r}; choose one of {', '.join(CACHE_FORMATS)}")


def compression_vs_bf16(cache_format: str, head_dim: int, group_size: int = 1) -> float:
    """How many times smaller than the BF16 cache (BF16 bytes / format bytes)."""
    return kv_bytes_per_token("bf16", head_dim) / kv_bytes_per_token(cache_format, head_dim, group_size)


def capacity_table(head_dims: tuple[int, ...] = (64, 128), group_sizes: tuple[int, ...] = (1, 4, 5, 8)) -> list[dict]:
    """Rows {format, head_dim, group_size, bytes, x_smaller_than_bf16} for each combination."""
    return [
        {
            "format": fmt,
            "head_dim": d,
            "group_size": g,
            "bytes": kv_bytes_per_token(fmt, d, g),
            "x_smaller_than_bf16": compression_vs_bf16(fmt, d, g),
        }
        for d in head_dims
        for g in group_sizes
        for fmt in CACHE_FORMATS
    ]


def format_capacity_table() -> str:
    """The capacity table as text, ending with MpFA's K + V alone (the "1/2.56 of BF16" figure) at d = 128."""
    lines = [f"{'format':<6} {'d':>4} {'Hq/Hkv':>6} {'bytes/token/KV head':>20} {'x smaller than BF16':>20}"]
    lines += [
        f"{row['format']:<6} {row['head_dim']:>4} {row['group_size']:>6} {row['bytes']:>20g} "
        f"{row['x_smaller_than_bf16']:>20.3f}"
        for row in capacity_table()
    ]
    k_and_v_only = kv_bytes_per_token("bf16", 128) / (128 / 2 + 128 / NVFP4_BLOCK + 128)
    lines.append(f"MpFA K + V without the Delta_S side cache, d=128: {k_and_v_only:.3f}x smaller than BF16")
    return "\n".join(lines)
