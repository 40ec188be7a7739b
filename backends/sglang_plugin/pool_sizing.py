"""Byte accounting of the MpFA KV pool, as SGLang sizes its pools (pure arithmetic, no torch).

SGLang turns free GPU memory into a token capacity with ``tokens = available_bytes // cell_size`` (cell_size: bytes
one token costs over all layers). The MpFA pool reports its real cost per token and layer, the layout of
`mpfa.kernels.cache_layout.MpfaKVCache`:

    Hkv * (d/2 NVFP4 K codes + d/16 e4m3 K scales + d FP8 V + 2 * row (BF16 Delta_S))

where ``row`` is the GQA group Hq/Hkv rounded up to a multiple of 4 (`cache_layout.delta_s_row`: 8-byte Delta_S rows
per KV head; restated here to keep this module free of torch, and checked against the allocated cache by
tests/backends/sglang_plugin/test_pool_sizing.py).

Both backends store Delta_S: the decode kernel always reads it (``mpfa-direct`` writes zeros there). The frozen
means (``mpfa`` only; `kv_store`) are ``(Hq + Hkv) * d`` BF16 per layer for every page (a sequence's first page
holds them), so each token's cell carries its page's share: ``(Hq + Hkv) * d * 2 / page_size`` bytes per layer,
rounded up over all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

NVFP4_BLOCK = 16
DELTA_S_ROW_ALIGN = 4  # BF16 entries (`cache_layout.DELTA_S_ROW_ALIGN`)
BF16_BYTES = 2
MEANS_BYTES = BF16_BYTES  # one mean element (`kv_store.MEANS_DTYPE`)


@dataclass(frozen=True)
class PoolGeometry:
    """Per-rank attention shape of one model: heads after tensor parallelism, head_dim, KV layers."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int

    def __post_init__(self) -> None:
        if min(self.num_q_heads, self.num_kv_heads, self.head_dim, self.num_layers) <= 0:
            raise ValueError(f"every pool dimension must be positive, got {self}")
        if self.num_q_heads % self.num_kv_heads or self.head_dim % NVFP4_BLOCK:
            raise ValueError(f"need Hq % Hkv == 0 and head_dim % {NVFP4_BLOCK} == 0, got {self}")


def mpfa_bytes_per_token_layer(g: PoolGeometry) -> int:
    """Bytes one token occupies in one layer of the MpFA cache (K codes + K scales + V + padded Delta_S rows)."""
    d = g.head_dim
    row = -(-(g.num_q_heads // g.num_kv_heads) // DELTA_S_ROW_ALIGN) * DELTA_S_ROW_ALIGN
    return g.num_kv_heads * (d // 2 + d // NVFP4_BLOCK + d + row * BF16_BYTES)


def bf16_bytes_per_token_layer(g: PoolGeometry) -> int:
    """What SGLang's BF16 MHA pool spends per token and layer (K + V), for comparison."""
    return 2 * g.num_kv_heads * g.head_dim * BF16_BYTES


def means_bytes_per_page(g: PoolGeometry, smoothing: bool) -> int:
    """Frozen Q/K means of one page over all layers; 0 without smoothing."""
    return (g.num_q_heads + g.num_kv_heads) * g.head_dim * MEANS_BYTES * g.num_layers if smoothing else 0


def cell_size(g: PoolGeometry, page_size: int = 1, smoothing: bool = False) -> int:
    """SGLang's ``cell_size`` for the MpFA pool: bytes per token over all KV layers, its page's share of the means
    included."""
    return mpfa_bytes_per_token_layer(g) * g.num_layers + -(-means_bytes_per_page(g, smoothing) // page_size)




def compression_vs_bf16(g: PoolGeometry) -> float:
    """How many more tokens fit than in SGLang's BF16 pool for the same bytes (means reserve aside)."""
    return bf16_bytes_per_token_layer(g) / mpfa_bytes_per_token_layer(g)


def capacity_log_line(backend: str, g: PoolGeometry, num_tokens: int, page_size: int, smoothing: bool) -> str:
    """The one startup line that states the pool's real size (what the bench logs should be grepped for)."""
    per_token = cell_size(g, page_size, smoothing)
    means = means_bytes_per_page(g, smoothing) * -(-num_tokens // page_size)
    gib = 1 << 30
    return (
        f"MpFA KV pool ({backend}): {num_tokens} tokens x {per_token} B/token over {g.num_layers} layers = "
        f"{num_tokens * per_token / gib:.2f} GiB (BF16 would need {bf16_bytes_per_token_layer(g) * g.num_layers} "
        f"B/token: {compression_vs_bf16(g):.2f}x more tokens per byte); of it frozen means {means / gib:.2f} GiB, "
        f"one row per page of {page_size}"
    )
