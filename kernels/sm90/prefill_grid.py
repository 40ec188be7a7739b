"""The order in which a prefill launch's CTAs run: which (batch, head block, row block) each grid index is.

The hardware hands out CTAs in linear block order (x fastest, then y, then z), so the grid axis a coordinate sits
on decides which CTAs are resident together. An order names the coordinate on grid x, y and z:

* `HEADS_FASTEST` (v1, `prefill.PrefillSm90`): a CTA is one query head, so the heads of a GQA group are
  neighbouring CTAs that read the same K / V tiles at about the same time.
* `ROWS_FASTEST` (v2, `prefill_staged.PrefillSm90Staged`): a CTA stages each K / V tile once for all its warps,
  so the row blocks of one (batch, head block) run together: the head block, and with it the KV head, changes
  only every ``row_blocks`` CTAs. At 64K causal (GQA 32:8) v2's CTAs in v1's order spread over all 8 KV heads
  and, as CTAs of different lengths retire, over all 64K positions: 8 x 64K x 208 B = 109 MB, twice the H200's
  50 MB L2. In this order the resident CTAs share one KV head (64K x 208 B = 13.6 MB; two around a change).

In both, the row blocks of a (batch, head block) run last to first: the heaviest causal row blocks start first.
The functions work on Python ints and CuTe DSL integers alike (the kernel traces `cta`; the CPU test
tests/kernels_sm90/test_prefill_grid.py runs it over every block of a grid).
"""

from __future__ import annotations

HEADS = "heads"  # head block: query heads ``heads * index ..`` of the CTA's shape
ROWS = "rows"  # row block, counted from the last
BATCH = "batch"

HEADS_FASTEST = (HEADS, ROWS, BATCH)  # grid (x, y, z)
ROWS_FASTEST = (ROWS, HEADS, BATCH)


def grid(order: tuple, head_blocks, row_blocks, batch) -> tuple:
    """The launch grid (x, y, z) of ``order`` for ``head_blocks`` x ``row_blocks`` x ``batch`` CTAs."""
    sizes = {HEADS: head_blocks, ROWS: row_blocks, BATCH: batch}
    return tuple(sizes[axis] for axis in order)


def cta(order: tuple, block: tuple, grid_dim: tuple) -> tuple:
    """(head block, row block, batch) of the CTA at grid index ``block`` (x, y, z) in a grid ``grid_dim`` of
    ``order``: row blocks in reverse, the last (heaviest causal) row block first."""
    index = dict(zip(order, block))
    row_blocks = grid_dim[order.index(ROWS)]
    return index[HEADS], row_blocks - 1 - index[ROWS], index[BATCH]
