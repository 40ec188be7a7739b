"""The order in which a prefill launch's CTAs run: which (batch, head block, row block) each grid index is.

The hardware hands out CTAs in linear block order (x fastest, then y, then z), so the grid axis a coordinate sits
on decides which CTAs are resident together. A prefill CTA stages each K / V tile once for all its rows, so the row
blocks of one (batch, head block) run together: the row block is on grid x, the head block on y, the batch on z,
and the head block, with it the KV head, changes only every ``row_blocks`` CTAs. At 64K causal (GQA 32:8) CTAs in
heads-fastest order would spread over all 8 KV heads and, as CTAs of different lengths retire, over all 64K
positions: 8 x 64K x 208 B = 109 MB, twice the H200's 50 MB L2; in this order the resident CTAs share one KV head
(64K x 208 B = 13.6 MB; two around a change). The row blocks of a (batch, head block) run last to first: the
heaviest causal row blocks start first.

The functions work on Python ints and CuTe DSL integers alike (the kernels trace `cta`; the CPU test
tests/kernels/sm90/test_prefill_grid.py runs it over every block of a grid).
"""

from __future__ import annotations


def grid(head_blocks, row_blocks, batch) -> tuple:
    """The launch grid (x, y, z) for ``head_blocks`` x ``row_blocks`` x ``batch`` CTAs."""
    return row_blocks, head_blocks, batch


def cta(block: tuple, grid_dim: tuple) -> tuple:
    """(head block, row block, batch) of the CTA at grid index ``block`` (x, y, z) in a grid ``grid_dim``: row
    blocks in reverse, the last (heaviest causal) row block first."""
    row, head_block, batch = block
    return head_block, grid_dim[0] - 1 - row, batch
