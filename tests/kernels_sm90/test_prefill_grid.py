"""The prefill kernels' CTA order (`prefill_grid`), on the CPU: every grid index, in the order the hardware hands
CTAs out (x fastest, then y, then z), mapped through `prefill_grid.cta` exactly as the kernels trace it."""

from __future__ import annotations

import itertools

import pytest

from mpfa.kernels.sm90 import prefill_grid


def launch_order(order: tuple, head_blocks: int, row_blocks: int, batch: int) -> list[tuple[int, int, int]]:
    """(head block, row block, batch) of every CTA, in linear block order."""
    grid = prefill_grid.grid(order, head_blocks, row_blocks, batch)
    return [prefill_grid.cta(order, (x, y, z), grid)
            for z, y, x in itertools.product(range(grid[2]), range(grid[1]), range(grid[0]))]


SHAPES = [(8, 4096, 1), (8, 37, 3), (40, 5, 2), (1, 1, 1)]  # (head blocks, row blocks, batch)


@pytest.mark.parametrize("order", [prefill_grid.HEADS_FASTEST, prefill_grid.ROWS_FASTEST], ids=["v1", "v2"])
@pytest.mark.parametrize("head_blocks,row_blocks,batch", SHAPES)
def test_every_cta_once(order, head_blocks, row_blocks, batch):
    ctas = launch_order(order, head_blocks, row_blocks, batch)
    assert sorted(ctas) == list(itertools.product(range(head_blocks), range(row_blocks), range(batch)))


@pytest.mark.parametrize("head_blocks,row_blocks,batch", SHAPES)
def test_v2_runs_one_head_block_at_a_time_heaviest_rows_first(head_blocks, row_blocks, batch):
    """Batch slowest, then the head block (so the KV head, ``head block * heads // group``, only grows), then the
    row blocks from the last (heaviest causal) to the first: ``row_blocks`` neighbouring CTAs share a head block."""
    ctas = launch_order(prefill_grid.ROWS_FASTEST, head_blocks, row_blocks, batch)
    assert ctas == [(head, row, b) for b in range(batch) for head in range(head_blocks)
                    for row in reversed(range(row_blocks))]
    assert [(b, head) for head, _, b in ctas] == sorted((b, head) for head, _, b in ctas)  # never back


def test_v2_at_64k_keeps_at_most_two_kv_heads_in_flight():
    """64K causal, GQA 32:8 (a CTA = a KV head's 4 query heads x 16 rows): any 264 CTAs in a row (2 per SM on
    132 SMs) span at most 2 KV heads, in v1's order all 8. CTAs retire out of order, but the longest walks 2048
    tiles while a KV head's 4096 CTAs take ~16K tile steps on 264 slots: the resident CTAs span two KV heads at
    most too."""
    window = 2 * 132
    for order, most in ((prefill_grid.ROWS_FASTEST, 2), (prefill_grid.HEADS_FASTEST, 8)):
        ctas = launch_order(order, 8, 4096, 1)
        assert max(len({head for head, _, _ in ctas[start:start + window]})
                   for start in range(0, len(ctas) - window + 1, 61)) == most


def test_v1_keeps_a_row_blocks_heads_together():
    """v1 (one head per CTA): the heads of a row block are neighbours, the heaviest row block first."""
    ctas = launch_order(prefill_grid.HEADS_FASTEST, 32, 7, 2)
    assert ctas[:32] == [(head, 6, 0) for head in range(32)] and ctas[32] == (0, 5, 0)
    assert ctas == [(head, row, b) for b in range(2) for row in reversed(range(7)) for head in range(32)]


def test_the_kernels_orders():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
    from mpfa.kernels.sm90.prefill import PrefillSm90
    from mpfa.kernels.sm90.prefill_staged import PrefillSm90Staged

    assert PrefillSm90(8, 4, 128, True).cta_order == prefill_grid.HEADS_FASTEST
    assert PrefillSm90Staged(8, 4, 128, True).cta_order == prefill_grid.ROWS_FASTEST
    assert prefill_grid.grid(prefill_grid.ROWS_FASTEST, 8, 4096, 1) == (4096, 8, 1)  # row blocks on x: 2**31 - 1
