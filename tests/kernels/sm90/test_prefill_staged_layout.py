"""The prefill kernels' ring stages (`prefill_staged_layout`, the functions the kernels trace), byte for byte on the
CPU: every thread of the 4 copying warps runs its cp.async units of one 32-key tile (the copy plan's warp slots)
into a poisoned model of the stage (zero fill past the sequence end), then every lane of every warp reads its
operands back exactly where the mma-sync kernel reads them, and must get exactly the bytes of the paged cache its
registers stand for: K chunk c and block scales 2c, 2c + 1 of key 8 n + g, Delta_S of the warp's head at key
8 n + 2c + half, V chunk g of key `pv_key(k_half, c, j)`; zeros for keys past the end. Also for an odd number of
query heads (5:1, Qwen3-14B at tensor parallelism 8: Delta_S rows are padded per KV head, so every 4-byte word is
aligned). The copies must cover the stage without overlap, the warp's shared-memory reads must be free of bank
conflicts, and the K expansion's fragment buffers must sit after the ring."""

from __future__ import annotations

import numpy as np
import pytest

from mpfa.kernels.cache_layout import delta_s_row
from mpfa.kernels.sm90 import decode_layout as lay
from mpfa.kernels.sm90 import prefill_staged_layout as sl

LANES = np.arange(32)
G, C = LANES // 4, LANES % 4
POISON = 0xA5


def _cache(rng: np.random.Generator, slots: int, hkv: int, group: int) -> dict:
    """Bytes of the cache (`cache_layout`): K codes and V [slot, KV head, row], K scales and Delta_S [KV head, slot,
    row] (head-major; Delta_S rows of `delta_s_row` BF16 entries)."""
    shapes = {"k": (slots, hkv, sl.K_ROW_BYTES), "v": (slots, hkv, sl.V_ROW_BYTES),
              "scales": (hkv, slots, sl.SCALE_ROW_BYTES), "delta_s": (hkv, slots, 2 * delta_s_row(group))}
    return {name: rng.integers(0, 256, shape, dtype=np.uint8) for name, shape in shapes.items()}


def _key_row(cache: dict, name: str, slot: int, kv_head: int) -> np.ndarray:
    """The bytes of (``slot``, ``kv_head``) in array ``name``."""
    return cache[name][kv_head, slot] if name in ("scales", "delta_s") else cache[name][slot, kv_head]


def _row(cache: dict, name: str, slot: int, kv_head: int, group_first: int) -> np.ndarray:
    """The bytes of key ``slot`` a stage row copies from (its byte offsets are the copy map's); ``group_first``:
    the CTA's first head within the GQA group."""
    row = _key_row(cache, name, slot, kv_head)
    return row[4 * sl.ds_first_word(group_first):] if name == "delta_s" else row


def _copy_tile(cache: dict, slot0: int, left: int, kv_head: int, group_first: int, heads: int,
               compensate: bool = True):
    """The stage after every warp's copies (cp.async with src-size 0 past the end writes zeros)."""
    stage = np.full(sl.stage_bytes(heads, compensate), POISON, dtype=np.uint8)
    written = np.zeros(stage.size, dtype=np.int64)
    for (name, units, size, copy_map), r, first_warp, end_warp in sl.copy_plan(heads, compensate):
        for tid in range(32 * first_warp, 32 * end_warp):
            unit = tid + r
            assert 0 <= unit < units
            key, offset, smem = copy_map(tid, r)
            assert (key, offset, smem) == copy_map(unit), "a constant offset must not change the unit"
            assert smem % size == 0, "cp.async needs a destination aligned to its size"
            source = _row(cache, name, slot0 + key, kv_head, group_first)
            stage[smem:smem + size] = source[offset:offset + size] if key < left else 0
            written[smem:smem + size] += 1
    return stage, written


def _banks_conflict_free(addresses: np.ndarray, width: int) -> bool:
    """One shared-memory access of a warp (byte addresses per lane, ``width`` bytes each): 16-byte accesses are
    served per quarter warp, narrower ones per warp; conflict-free when no bank holds two different words."""
    phases = addresses.reshape(4, 8) if width == 16 else addresses.reshape(1, 32)
    for phase in phases:
        words = {int(a) // 4 + i for a in phase for i in range(max(width // 4, 1))}
        banks = [w % 32 for w in words]
        if len(banks) != len(set(banks)):
            return False
    return True


CASES = [  # (KV heads, group, heads per CTA, KV head of the CTA, first head index within the group)
    (8, 4, 4, 3, 0),  # default for group 4: the whole group
    (8, 5, 1, 2, 3),  # default for group 5: one head (odd head: Delta_S 2 bytes into its word)
    (8, 5, 1, 5, 0),
    (8, 5, 5, 3, 0),  # a whole odd group (3 words per key, starting 2 bytes in)
    (4, 2, 2, 1, 0),
    (1, 5, 1, 0, 3),  # 5:1, an odd number of query heads (Qwen3-14B at tensor parallelism 8)
    (3, 1, 1, 2, 0),  # 3:3, odd, GQA group 1
]


@pytest.mark.parametrize("hkv,group,heads,kv_head,head_offset", CASES,
                         ids=["g4-h4", "g5-h1-odd", "g5-h1-even", "g5-h5", "g2-h2", "5:1-odd-heads", "3:3-odd-heads"])
@pytest.mark.parametrize("left", [32, 19, 1], ids=["whole-tile", "ragged", "one-key"])
@pytest.mark.parametrize("compensate", [True, False], ids=["compensated", "direct"])
def test_lanes_read_the_caches_bytes(hkv, group, heads, kv_head, head_offset, left, compensate):
    """Every lane reads exactly its registers' bytes of the paged cache (the module docstring); the direct build
    (``compensate`` false) copies the same stage less Delta_S and does not allocate its area."""
    rng = np.random.default_rng(hkv * 100 + group * 10 + heads + left)
    page_size, pages = 64, 6
    cache = _cache(rng, page_size * pages, hkv, group)
    slot0 = 3 * page_size + 32  # the second tile of page 3
    threads = 32 * sl.CTA_WARPS
    stage, written = _copy_tile(cache, slot0, left, kv_head, head_offset, heads, compensate)

    used = sl.DS_OFFSET + (4 * sl.ds_units(heads) if compensate else 0)
    size = sl.stage_bytes(heads, compensate)
    assert (written[:used] == 1).all(), "every byte of the stage is written exactly once"
    assert (written[used:] == 0).all() and used <= size and size % 128 == 0 and size - used < 128

    def expect(name, keys, start, size, head=None):
        rows = []
        for lane in LANES:
            key = int(keys[lane])
            if key >= left:
                rows.append(np.zeros(size, dtype=np.uint8))
            elif name == "delta_s":
                rows.append(cache["delta_s"][kv_head, slot0 + key, 2 * head:2 * head + size])
            else:
                rows.append(_key_row(cache, name, slot0 + key, kv_head)[int(start[lane]):int(start[lane]) + size])
        return np.stack(rows)

    def read(addresses, size):
        assert _banks_conflict_free(addresses, size), f"bank conflicts at {addresses}"
        return np.stack([stage[a:a + size] for a in addresses])

    for n_tile in range(lay.N_TILES):
        keys = lay.qk_key(n_tile, G)
        np.testing.assert_array_equal(read(sl.k_read(n_tile, LANES), 16), expect("k", keys, 16 * C, 16))
        np.testing.assert_array_equal(read(sl.scale_read(n_tile, LANES), 2), expect("scales", keys, 2 * C, 2))
    for warp in range(threads // 32 if compensate else 0):
        head_in_cta = warp % heads
        base = sl.ds_lane_base(heads, head_offset, head_in_cta, C)
        for n_tile in range(lay.N_TILES):
            for half in range(2):
                keys = lay.score_key(n_tile, C, half)
                np.testing.assert_array_equal(read(base + sl.ds_read(heads, n_tile, half), 2),
                                              expect("delta_s", keys, None, 2, head_offset + head_in_cta))
    for k_half in range(2):
        for j in range(4):
            keys = lay.pv_key(k_half, C, j)
            addresses = sl.v_lane_base(G, C) + sl.v_read(lay.pv_key(k_half, 0, j))
            np.testing.assert_array_equal(read(addresses, 16), expect("v", keys, 16 * G, 16))


def test_cta_shapes():
    assert sl.cta_shape(4) == (4, 1) and sl.cta_shape(5) == (1, 4) and sl.cta_shape(8) == (4, 1)
    assert sl.cta_shape(2) == (2, 2) and sl.cta_shape(1) == (1, 4)
    assert sl.stage_bytes(4) == 6656 and sl.stage_bytes(1) == 6528
    assert sl.stage_bytes(4, compensate=False) == sl.stage_bytes(1, compensate=False) == sl.DS_OFFSET == 6400
    assert all(heads * rows == sl.CTA_WARPS for heads, rows in map(sl.cta_shape, range(1, 9)))
    assert sl.warpgroup_rows(4) == 16 and sl.warpgroup_rows(5) == 64 and sl.warpgroup_rows(2) == 32


@pytest.mark.parametrize("heads", [1, 2, 4, 5])
@pytest.mark.parametrize("compensate", [True, False], ids=["compensated", "direct"])
def test_copy_plan_deals_whole_warp_slots_evenly(heads, compensate):
    """Every warp slot of every array once, round by round; a warp copies at most ceil(slots / 4) slots (4 of the 15
    slots of group 4's stage). The direct build copies no Delta_S."""
    warps = sl.CTA_WARPS
    arrays = sl.copy_arrays(heads, compensate)
    assert [name for name, _, _, _ in arrays] == ["k", "v", "scales"] + ["delta_s"] * compensate
    slots = sum(units for _, units, _, _ in arrays) // 32
    per_warp = np.zeros(warps, dtype=int)
    seen = []
    for (name, units, _, _), r, first_warp, end_warp in sl.copy_plan(heads, compensate):
        assert 0 <= first_warp < end_warp <= warps
        per_warp[first_warp:end_warp] += 1
        seen += [(name, (32 * warp + r) // 32) for warp in range(first_warp, end_warp)]
        assert all(0 <= 32 * warp + r < units for warp in range(first_warp, end_warp))
    assert sorted(seen) == sorted((name, s) for name, units, _, _ in arrays for s in range(units // 32))
    assert per_warp.max() == -(-slots // warps)


@pytest.mark.parametrize("row_blocks", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_cta_walk_covers_every_warps_tiles(monkeypatch: pytest.MonkeyPatch, row_blocks, causal):
    """A CTA of several 16-row blocks (group 2: 2; group 5: 4) walks the tiles of its last row
    (`prefill_base.PrefillSm90Base._walk`: `prefill_tile.warp_plan` over the CTA's rows) and masks the tiles its first
    row does not see whole: every warp's own tiles (the plan for its rows) are among the CTA's, the CTA walks no tile
    that no warp needs, and a tile the CTA takes as whole is whole for every row of every warp (so the whole-tile
    loop is bit-identical to a per-warp walk's masked or whole one). Ragged, chunked and short sequences."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
    from mpfa.kernels.sm90 import prefill_tile as tile_math

    for name, value in {"imin": min, "imax": max, "select_": lambda c, a, b: a if c else b}.items():
        monkeypatch.setattr(tile_math, name, value)
    block_m = sl.WARP_ROWS * row_blocks

    def plan(row0, q_len, kv_len, g, rows):
        return tile_math.warp_plan(row0, q_len, kv_len, g, causal=causal, tile_keys=sl.TILE_KEYS, warp_rows=rows)

    for q_len in [1, 15, 16, 17, 31, 33, 48, 63, 64, 95, 130]:
        for kv_len in (q_len, q_len + 7, q_len + 20, q_len + 100):
            for cta_row0 in range(0, q_len, block_m):
                cta_tiles, _, cta_common = plan(cta_row0, q_len, kv_len, 0, block_m)
                whole = min(cta_common // sl.TILE_KEYS, cta_tiles)  # the CTA's unmasked tiles: 0 .. whole - 1
                needed = 0
                for row0 in range(cta_row0, cta_row0 + block_m, sl.WARP_ROWS):
                    for g in range(8):
                        tiles, limits, _ = plan(row0, q_len, kv_len, g, sl.WARP_ROWS)
                        assert tiles <= cta_tiles
                        needed = max(needed, tiles)
                        rows = [row0 + g + 8 * r for r in range(2)]
                        assert all(limit >= whole * sl.TILE_KEYS - 1 for row, limit in zip(rows, limits)
                                   if row < q_len), (q_len, kv_len, row0, g)
                assert needed == cta_tiles


@pytest.mark.parametrize("stages,shared_dequant", [(2, False), (4, False), (8, False), (4, True), (8, True)],
                         ids=["2-stages", "4-stages", "8-stages", "4-stages-shared-dequant", "8-stages-shared-dequant"])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 4, 5, 11])
def test_ring_schedule(tiles, stages, shared_dequant):
    """The kernel's walk through the ring (`ring_prologue`, `ring_copy`, `ring_compute`, `ring_wait`) against a
    model of cp.async groups: each step computes the next tile (last to first) from a stage whose copy group has
    completed under ``cp.async.wait_group(ring_wait)``; a copy never overwrites a stage a later step still reads
    (its V / Delta_S, or its K still to be expanded) nor one read before the barrier of this step; every tile is
    copied once; each copy's page-table entry was fetched the step before. With ``shared_dequant``, step p
    expands the K of step p + 1 from a landed stage into the fragment buffer step p + 1 reads, and computes from
    the buffer holding its own tile, written before this step's barrier (the mma-sync kernel: 4 stages; the exact
    kernel: 2, without)."""
    lookahead = int(shared_dequant)
    groups, holds, copied, last_read = [], {}, [], {}
    for index in range(stages - 1):
        tile, stage = sl.ring_prologue(index, tiles)
        groups.append((tile, stage) if tile >= 0 else None)
        if tile >= 0:
            holds[stage] = tile
            copied.append(tile)
    fetched = sl.ring_copy(0, tiles, stages)[0]
    buffers, buffer_read = {}, {}
    if shared_dequant and tiles:  # the prologue: wait_group(stages - 2), barrier, expand step 0's K
        tile, stage, buffer = sl.ring_compute(0, tiles, stages)
        assert (tile, stage) in groups[:len(groups) - (stages - 2)] and holds[stage] == tile
        buffers[buffer] = tile
    for step in range(tiles):
        tile, stage, buffer = sl.ring_compute(step, tiles, stages)
        assert tile == tiles - 1 - step and 0 <= stage < stages
        complete = groups[:len(groups) - sl.ring_wait(stages, shared_dequant)]
        assert (tile, stage) in complete and holds[stage] == tile
        # barrier: every read of the steps before this one is done
        copy_tile, copy_stage = sl.ring_copy(step, tiles, stages)
        assert copy_tile == fetched
        if copy_tile >= 0:
            assert last_read.get(copy_stage, -1) < step, "overwrites a stage this step reads"
            assert all(holds.get(copy_stage) != t for t in range(tile - lookahead, tile + 1)), "a live stage"
            holds[copy_stage] = copy_tile
            copied.append(copy_tile)
        groups.append((copy_tile, copy_stage) if copy_tile >= 0 else None)
        fetched = sl.ring_copy(step + 1, tiles, stages)[0]
        if shared_dequant:
            next_tile, next_stage, next_buffer = sl.ring_compute(step + 1, tiles, stages)
            if next_tile >= 0:
                assert (next_tile, next_stage) in complete and holds[next_stage] == next_tile
                assert next_buffer != buffer and buffer_read.get(next_buffer, -1) < step
                buffers[next_buffer] = next_tile
                last_read[next_stage] = step
            assert buffers[buffer] == tile
            buffer_read[buffer] = step
        last_read[stage] = step
    assert copied == list(range(tiles - 1, -1, -1))


@pytest.mark.parametrize("compensate", [True, False], ids=["compensated", "direct"])
def test_fragment_buffers_sit_after_the_ring_without_bank_conflicts(compensate):
    for heads in (1, 2, 4, 5):
        for stages in (3, 4, 8):
            ring = stages * sl.stage_bytes(heads, compensate)
            for buffer in (0, 1):
                offsets = [sl.frag_lane_base(stages, heads, buffer, LANES, compensate) + sl.frag_offset(n, q)
                           for n in range(lay.N_TILES) for q in range(sl.FRAG_QUADS)]
                flat = np.concatenate(offsets)
                assert flat.min() >= ring + buffer * sl.FRAG_BUFFER_BYTES
                assert flat.max() + 16 <= ring + (buffer + 1) * sl.FRAG_BUFFER_BYTES
                assert len(set(flat.tolist())) == flat.size  # every (n-tile, quad, lane) its own 16 bytes
                assert all(_banks_conflict_free(o, 16) for o in offsets)
