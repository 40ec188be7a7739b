"""Shared inputs for the numerics tests: varlen and paged attention inputs (the seeded `gen` is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Batch:
    """Varlen attention inputs (BF16, never zeros): q [total_q, Hq, d], k/v [total_k, Hkv, d]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @property
    def varlen(self) -> dict:
        return {"cu_seqlens_q": self.cu_q, "cu_seqlens_k": self.cu_k}


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


@pytest.fixture
def make_batch(gen: torch.Generator) -> Callable[..., Batch]:
    """Random BF16 batch; ``q_offset`` / ``k_offset`` add per-channel offsets of that std on 8 random channels
    (the channel outliers real Q/K have, which plain Gaussians lack)."""

    def make(
        q_lens: list[int],
        k_lens: list[int],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_offset: float = 0.0,
        k_offset: float = 0.0,
    ) -> Batch:
        channels = torch.randperm(head_dim, generator=gen)[:8]

        def offsets(std: float) -> torch.Tensor:
            out = torch.zeros(head_dim)
            out[channels] = torch.randn(8, generator=gen) * std
            return out

        q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen) + offsets(q_offset)
        k = torch.randn(sum(k_lens), num_kv_heads, head_dim, generator=gen) + offsets(k_offset)
        v = torch.randn(sum(k_lens), num_kv_heads, head_dim, generator=gen)
        return Batch(q.bfloat16(), k.bfloat16(), v.bfloat16(), _cumulative(q_lens), _cumulative(k_lens))

    return make


@pytest.fixture
def to_paged(gen: torch.Generator) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Scatter packed k/v into a NaN-poisoned paged cache with shuffled pages -> (k_cache, v_cache, page_table)."""

    def scatter(
        k: torch.Tensor, v: torch.Tensor, cu_k: torch.Tensor, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lengths = (cu_k[1:] - cu_k[:-1]).tolist()
        pages_per_seq = [-(-n // page_size) for n in lengths]
        max_pages = max(1, *pages_per_seq)
        num_pages = sum(pages_per_seq) + 3  # spare pages stay poisoned
        order = torch.randperm(num_pages, generator=gen)
        table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
        k_cache = torch.full((num_pages, page_size, *k.shape[1:]), float("nan"), dtype=k.dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        next_page = 0
        for b, (start, n) in enumerate(zip(cu_k.tolist(), lengths)):
            for p in range(pages_per_seq[b]):
                page = int(order[next_page])
                next_page += 1
                table[b, p] = page
                rows = slice(start + p * page_size, start + min((p + 1) * page_size, n))
                count = rows.stop - rows.start
                k_cache[page, :count], v_cache[page, :count] = k[rows], v[rows]
        return k_cache, v_cache, table

    return scatter
