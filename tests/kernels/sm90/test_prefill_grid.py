"""The prefill kernels' CTA order (`prefill_grid`), on the CPU: every grid index, in the order the hardware hands
CTAs out (x fastest, then y, then z), mapped through `prefill_grid.cta` exactly as the kernels trace it."""

from __future__ import annotations

import itertools

import pytest

from mpfa.kernels.sm90 import prefill_grid


def launch_order(head_blocks: int, row_blocks: int, batch: int) -> list[tuple[int, int, int]]:
    """(head block, row block, batch) of every CTA, in linear block order."""
    grid = prefill_grid.grid(head_blocks, row_blocks, batch)
    return [prefill_grid.cta((x, y, z), grid)
            for z, y, x in itertools.product(range(grid[2]), range(grid[1]), range(grid[0]))]


SHAPES = [(8, 4096, 1), (8, 37, 3), (40, 5, 2), (1, 1, 1)]  # (head blocks, row blocks, batch)


@pytest.mark.parametrize("head_blocks,row_blocks,batch", SHAPES)
def test_every_cta_once(head_blocks, row_blocks, batch):
    ctas = launch_order(head_blocks, row_blocks, batch)
    assert sorted(ctas) == list(itertools.product(range(head_blocks), range(row_blocks), range(batch)))


@pytest.mark.parametrize("head_blocks,row_blocks,batch", SHAPES)
def test_one_head_block_at_a_time_heaviest_rows_first(head_blocks, row_blocks, batch):
    """Batch slowest, then the head block (so the KV head, ``head block * heads // group``, only grows), then the
    row blocks from the last (heaviest causal) to the first: ``row_blocks`` neighbouring CTAs share a head block."""
    ctas = launch_order(head_blocks, row_blocks, batch)
    assert ctas == [(head, row, b) for b in range(batch) for head in range(head_blocks)
                    for row in reversed(range(row_blocks))]
    assert [(b, head) for head, _, b in ctas] == sorted((b, head) for head, _, b in ctas)  # never back


def test_at_64k_at_most_two_kv_heads_are_in_flight():
    """64K causal, GQA 32:8 (a CTA = a KV head's 4 query heads x 16 rows): any 264 CTAs in a row (2 per SM on 132
    SMs) span at most 2 KV heads; in heads-fastest order (the CTAs of a row block side by side) all 8. CTAs retire
    out of order, but the longest walks 2048 tiles while a KV head's 4096 CTAs take ~16K tile steps on 264 slots:
    the resident CTAs span two KV heads at most too."""
    window = 2 * 132
    ctas = launch_order(8, 4096, 1)
    heads_fastest = [(head, row, 0) for row in reversed(range(4096)) for head in range(8)]
    for order, most in ((ctas, 2), (heads_fastest, 8)):
        assert max(len({head for head, _, _ in order[start:start + window]})
                   for start in range(0, len(order) - window + 1, 61)) == most


def test_row_blocks_are_on_grid_x():
    """The row blocks go on x, whose limit (2**31 - 1) a long prefill's row blocks need; heads and batch on y, z."""
    assert prefill_grid.grid(8, 4096, 1) == (4096, 8, 1)
