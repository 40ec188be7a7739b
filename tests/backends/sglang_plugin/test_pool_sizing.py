"""Byte accounting: what the pool reports per token equals what it allocates, matches the numerics' capacity
table, and SGLang's capacity formula gives ~2.3-2.5x the BF16 token count with the per-page means."""

from __future__ import annotations

import pytest
import torch

from mpfa.backends.sglang_plugin.pool_sizing import (PoolGeometry, bf16_bytes_per_token_layer, capacity_log_line,
                                                     cell_size, compression_vs_bf16, means_bytes_per_page,
                                                     mpfa_bytes_per_token_layer)
from mpfa.backends.sglang_plugin.kv_store import MpfaKVStore
from mpfa.kernels.cache_layout import MpfaKVCache
from mpfa.kernels.kv_capacity import kv_bytes_per_token

LLAMA_8B = PoolGeometry(num_q_heads=32, num_kv_heads=8, head_dim=128, num_layers=32)
QWEN3_14B = PoolGeometry(num_q_heads=40, num_kv_heads=8, head_dim=128, num_layers=40)


def _token_capacity(available_bytes: int, g: PoolGeometry, page_size: int, smoothing: bool) -> int:
    """SGLang's formula on the MpFA cell size (the means' share included): tokens the pool holds, page-aligned."""
    return available_bytes // cell_size(g, page_size, smoothing) // page_size * page_size


@pytest.mark.parametrize("g", [LLAMA_8B, QWEN3_14B, PoolGeometry(8, 2, 128, 3), PoolGeometry(5, 1, 128, 2),
                               PoolGeometry(8, 8, 128, 1), PoolGeometry(24, 3, 128, 1)],
                         ids=["llama8b", "qwen14b", "small", "qwen14b-tp8", "mha", "group8"])
def test_bytes_per_token_match_the_cache_layout(g):
    per_layer = mpfa_bytes_per_token_layer(g)
    cache = MpfaKVCache.allocate(1, 1, g.num_q_heads, g.num_kv_heads, g.head_dim, "cpu")
    assert per_layer == cache.bytes_per_token()
    assert per_layer == kv_bytes_per_token("mpfa", g.head_dim, g.num_q_heads // g.num_kv_heads) * g.num_kv_heads
    assert cell_size(g) == per_layer * g.num_layers


def test_store_allocates_exactly_what_is_reported():
    g = PoolGeometry(8, 2, 128, 3)
    store = MpfaKVStore.allocate(10 * 16, 16, g, smoothing=True, device="cpu")
    assert store.num_slots == 160
    assert store.k_bytes() + store.v_bytes() == 160 * cell_size(g)
    assert store.means_bytes() == 10 * means_bytes_per_page(g, smoothing=True)  # a means row per page
    assert store.k_bytes() + store.v_bytes() + store.means_bytes() == 160 * cell_size(g, 16, smoothing=True)
    direct = MpfaKVStore.allocate(10 * 16, 16, g, smoothing=False, device="cpu")
    assert direct.means_bytes() == 0 and tuple(direct.q_mean.shape) == (3, 1, 8, 128)


def test_llama_capacity_is_about_two_and_a_half_times_bf16():
    assert mpfa_bytes_per_token_layer(LLAMA_8B) == 8 * (64 + 8 + 128) + 32 * 2 == 1664
    assert mpfa_bytes_per_token_layer(QWEN3_14B) == 8 * (64 + 8 + 128 + 8 * 2) == 1728  # group 5: rows of 8
    assert bf16_bytes_per_token_layer(LLAMA_8B) == 4096
    assert compression_vs_bf16(LLAMA_8B) == pytest.approx(2.4615, abs=1e-4)
    assert means_bytes_per_page(LLAMA_8B, True) == 40 * 128 * 2 * 32  # BF16 means of 32 + 8 heads, 32 layers
    available = 100 << 30
    tokens = _token_capacity(available, LLAMA_8B, page_size=128, smoothing=True)
    bf16_tokens = available // (bf16_bytes_per_token_layer(LLAMA_8B) * 32)
    assert tokens % 128 == 0
    assert tokens * cell_size(LLAMA_8B, 128, True) <= available  # never more than the real bytes
    assert 2.3 < tokens / bf16_tokens < 2.4  # the means, 2,560 B per token at pages of 128, cost 4.6%
    direct_tokens = _token_capacity(available, LLAMA_8B, page_size=128, smoothing=False)
    assert direct_tokens / bf16_tokens == pytest.approx(compression_vs_bf16(LLAMA_8B), rel=1e-3)


def test_geometry_and_log_line():
    with pytest.raises(ValueError):
        PoolGeometry(30, 8, 128, 1)
    line = capacity_log_line("mpfa", LLAMA_8B, 1_000_000, 128, True)
    assert line.startswith("MpFA KV pool (mpfa): 1000000 tokens x 55808 B/token") and "2.46x" in line
    assert "\n" not in line
