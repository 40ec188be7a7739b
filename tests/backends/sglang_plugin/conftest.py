"""Shared setup for the MpFA SGLang-plugin tests.

Without CUDA the Triton kernels (KV write, sequence means) run in Triton's CPU interpreter (set here, before any
kernel module is imported), so the pool, means-freezing and slow-prefill logic is checked on every machine; the
decode kernel needs the GPU (tests marked ``gpu``). `paged` builds SGLang-shaped inputs: a ``req_to_token`` table
whose rows (request pool indices, row 0 = padding) map token positions to slots on shuffled pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

HEAD_DIM = 128


@dataclass
class Paged:
    """Requests laid out like SGLang's pools: ``rows[b]`` is request b's row of ``req_to_token``; q [L, Hq, d],
    k / v [L, Hkv, d] BF16 per request (all of its tokens, prefill and decode)."""

    req_to_token: torch.Tensor
    rows: list[int]
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_slots: int
    page_size: int

    def step(self, spans: list[tuple[int, int]], device: str) -> dict:
        """Inputs of one forward over token span [a, b) of each request: packed q/k/v, out slots, request rows,
        host prefix and extend lengths."""
        cat = lambda xs: torch.cat([x[a:b] for x, (a, b) in zip(xs, spans)]).to(device)  # noqa: E731
        slots = torch.cat([self.req_to_token[r, a:b] for r, (a, b) in zip(self.rows, spans)]).long()
        return dict(q=cat(self.q), k=cat(self.k), v=cat(self.v), slots=slots.to(device),
                    rows=torch.tensor(self.rows, device=device), prefix=[a for a, _ in spans],
                    extend=[b - a for a, b in spans])

    def only(self, index: int) -> Paged:
        """The same layout restricted to request ``index`` (its row and tokens)."""
        return Paged(self.req_to_token, [self.rows[index]], [self.q[index]], [self.k[index]], [self.v[index]],
                     self.num_slots, self.page_size)


@pytest.fixture
def paged(gen: torch.Generator) -> Callable[..., Paged]:
    def make(lengths: list[int], num_q_heads: int, num_kv_heads: int, page_size: int, device: str,
             max_context: int = 2048) -> Paged:
        pages_per_request = [-(-n // page_size) for n in lengths]
        num_pages = sum(pages_per_request) + 3  # page 0 is SGLang's padding page; spares stay unwritten
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        rows = torch.randperm(2 * len(lengths), generator=gen)[: len(lengths)] + 1
        req_to_token = torch.zeros((2 * len(lengths) + 1, max_context), dtype=torch.int32)
        for row, n, count in zip(rows.tolist(), lengths, pages_per_request):
            pages = torch.tensor([order.pop() for _ in range(count)])
            req_to_token[row, :n] = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n].int()

        def rows_of(n: int, heads: int, scale: float, offset_std: float) -> torch.Tensor:
            offsets = torch.zeros(HEAD_DIM)
            offsets[torch.randperm(HEAD_DIM, generator=gen)[:8]] = torch.randn(8, generator=gen) * offset_std
            return (torch.randn(n, heads, HEAD_DIM, generator=gen) * scale + offsets).bfloat16()

        return Paged(req_to_token.to(device), rows.tolist(),
                     [rows_of(n, num_q_heads, 1.0, 4.0) for n in lengths],
                     [rows_of(n, num_kv_heads, 1.5, 8.0) for n in lengths],
                     [rows_of(n, num_kv_heads, 1.0, 0.0) for n in lengths], num_pages * page_size, page_size)

    return make
