"""The paged-cache helpers the kernel adapters share: slots, the sequential page table and unpaging."""
from __future__ import annotations

import torch

from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.kernel_adapter import paged_slots, sequential_page_table, unpaged


def test_whole_pages_per_sequence_and_their_table():
    w = AttentionWorkload("decode", seq=1000, batch=3, q_heads=32, kv_heads=8, head_dim=128)
    assert paged_slots(w, 128) == 3 * 1024 and paged_slots(w, 1) == 3000
    table = sequential_page_table(3, 8, torch.device("cpu"))
    assert table.dtype == torch.int32 and table.tolist()[2] == list(range(16, 24))


def test_unpaged_drops_each_sequences_padding_slots():
    w = AttentionWorkload("decode", seq=5, batch=2, q_heads=4, kv_heads=2, head_dim=16)
    page = 4  # 5 tokens take 2 pages: slots 5..7 of each sequence are padding
    cache = torch.arange(paged_slots(w, page) * 2 * 16, dtype=torch.float32).view(-1, page, 2, 16)
    flat = cache.reshape(2, 8, 2, 16)
    expected = torch.cat([flat[0, :5], flat[1, :5]])
    assert torch.equal(unpaged(cache, w), expected)
