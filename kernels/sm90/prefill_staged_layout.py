"""Where a prefill kernel puts one 32-key KV tile of the paged cache in a shared-memory ring stage, which thread
copies which bytes there, where each lane reads its operands back, where the mma-sync kernel's expanded K goes, and
which tile is where at each step (pure index arithmetic).

The functions work on Python ints, NumPy arrays and CuTe DSL integers alike: the kernels trace them, and the CPU
test (tests/kernels/sm90/test_prefill_staged_layout.py) runs the same code on a byte-level model of the cache
and of shared memory, checking that every lane reads exactly the bytes of the paged cache its registers stand for
(`decode_layout`'s fragments), and runs the ring schedule on a model of cp.async groups.

A CTA owns ``heads`` consecutive query heads of one GQA group (`cta_shape`). A stage holds one tile of their KV
head (``TILE_KEYS`` keys, slots ``slot0 .. slot0 + 31`` of one page):

* K codes: [key][64 B], unswizzled. Lane (g, c) of every warp reads key 8 n + g, chunk c (bytes 16c..16c+15) for
  n-tile n: 512 n + 16 lane, lane-contiguous (no bank conflict).
* V: [key][128 B], the 16-byte chunk ``d`` of key ``k`` at chunk ``d ^ v_swizzle(k)``. Lane (g, c) reads chunk g of
  the keys ``pv_key(k_half, c, j)`` = 8 m + 2c + (j & 1): a quarter warp (g in {2p, 2p+1}, c = 0..3) then hits the
  chunks g ^ 2c, eight different 16-byte bank groups (unswizzled, 4 rows 128 B apart would share 2 groups: 4-way).
* K scales: [key][8 B] (blocks 0..7 of the key's row); lane (g, c) reads the pair of blocks 2c, 2c + 1 of key
  8 n + g: 64 n + 2 lane.
* Delta_S: [key][ds_words(heads) x 4 B]: the aligned 4-byte words of the cache's BF16 row of (KV head, slot)
  that hold the CTA's heads first_head .. first_head + heads - 1, numbered within the GQA group here (cp.async
  moves 4, 8 or 16 bytes; the cache's rows are 8 or 16 bytes, `cache_layout.delta_s_row`, so every word is
  aligned whatever the number of query heads). The CTA's head ``h`` sits ``ds_lead(first_head) + 2 h`` bytes into
  its key's words. The direct build (``compensate`` false: no Delta_S) neither copies nor allocates it; the other
  arrays keep their offsets.

Copies (`copy_plan`): each array is cut into units (16 B for K and V, 8 B for the scales, 4 B for Delta_S), the
arrays' units in a row (largest array first) are cut into warp slots of 32 units and the slots are dealt to the
4 copying warps round by round: a warp copies one slot per round (coalesced: consecutive lanes copy consecutive
bytes of a key's row), at most ceil(slots / 4) per tile; a round shared by several arrays picks a warp's array
with a warp-uniform condition.

After the ring, the mma-sync kernel keeps two fragment buffers of expanded K (`frag_lane_base`).
"""

from __future__ import annotations

import math

TILE_KEYS = 32
WARP_ROWS = 16  # query rows of a warp
HEAD_DIM = 128
K_ROW_BYTES = HEAD_DIM // 2  # NVFP4 codes of one key and KV head
SCALE_ROW_BYTES = HEAD_DIM // 16  # e4m3 block scales
V_ROW_BYTES = HEAD_DIM  # e4m3 V

K_OFFSET = 0
V_OFFSET = K_OFFSET + TILE_KEYS * K_ROW_BYTES  # 2048
SCALE_OFFSET = V_OFFSET + TILE_KEYS * V_ROW_BYTES  # 6144
DS_OFFSET = SCALE_OFFSET + TILE_KEYS * SCALE_ROW_BYTES  # 6400

K_UNITS = TILE_KEYS * K_ROW_BYTES // 16  # 128 x 16 B
V_UNITS = TILE_KEYS * V_ROW_BYTES // 16  # 256 x 16 B
SCALE_UNITS = TILE_KEYS  # 32 x 8 B
STAGE_ALIGN = 128
WARP = 32
N_TILES = TILE_KEYS // 8  # QK n-tiles of a tile
CTA_WARPS = 4  # warps of the CTA's block of heads and rows, and of a tile's copies


def cta_shape(group: int) -> tuple[int, int]:
    """(query heads per CTA, 16-row blocks per CTA) of the 4-warp CTA for a GQA group: as many heads of the group
    as divide both (group 4 -> the whole group x 16 rows, group 5 -> 1 head x 64 rows). Every K / V tile is copied
    group / heads times per 16 x row_blocks query rows of a KV head."""
    heads = math.gcd(group, CTA_WARPS)
    return heads, CTA_WARPS // heads


def warpgroup_rows(group: int) -> int:
    """Query rows per head of a 64-row wgmma tile (a wgmma kernel's warpgroup): the 4-warp CTA's rows,
    `cta_shape` (group 4 -> 16 rows of each of the 4 heads; group 5 -> 64 rows of 1 head)."""
    return WARP_ROWS * cta_shape(group)[1]


def ds_words(heads: int) -> int:
    """4-byte words per key that cover the CTA's BF16 Delta_S, wherever its first head starts (an odd number of
    heads may start 2 bytes into a word; an even number starts at an even head, word-aligned)."""
    return (heads + 1) // 2


def ds_units(heads: int) -> int:
    return TILE_KEYS * ds_words(heads)


def stage_bytes(heads: int, compensate: bool = True) -> int:
    """Bytes of a ring stage (a multiple of ``STAGE_ALIGN``); without ``compensate`` no Delta_S."""
    end = DS_OFFSET + (4 * ds_units(heads) if compensate else 0)
    return -(-end // STAGE_ALIGN) * STAGE_ALIGN


def ds_first_word(first_head):
    """The first 4-byte word of a Delta_S row holding head ``first_head``."""
    return (2 * first_head) >> 2


def ds_lead(first_head):
    """Bytes from that word to head ``first_head`` (0 or 2)."""
    return (2 * first_head) & 3


def v_swizzle(key):
    """The 16-byte chunk XOR of key ``key``'s V row."""
    return ((key >> 1) & 3) << 1


# --- copies: unit tid + r (r a constant) -> (key, byte offset in the key's row in the cache, offset in the stage) --
# Written so that a thread's rounds (r = 0, threads, ...) differ by constants where the divisibility allows it.

def k_copy(tid, r: int = 0):
    if r % 4:
        return k_copy(tid + r)
    return (tid >> 2) + r // 4, 16 * (tid & 3), K_OFFSET + 16 * tid + 16 * r


def v_copy(tid, r: int = 0):
    if r % 64:  # the swizzle repeats every 8 keys (64 units)
        unit = tid + r
        key, chunk = unit >> 3, unit & 7
        return key, 16 * chunk, V_OFFSET + V_ROW_BYTES * key + 16 * (chunk ^ v_swizzle(key))
    key, chunk = tid >> 3, tid & 7
    return key + r // 8, 16 * chunk, V_OFFSET + V_ROW_BYTES * (key + r // 8) + 16 * (chunk ^ v_swizzle(key))


def scale_copy(tid, r: int = 0):
    return tid + r, 0, SCALE_OFFSET + SCALE_ROW_BYTES * (tid + r)


def copy_arrays(heads: int, compensate: bool = True) -> tuple:
    """The arrays of a stage in copy order: (name, units, unit bytes, copy map (tid, r) -> (key, byte offset in
    the key's row, shared-memory offset) of unit tid + r); Delta_S last, and only with ``compensate``."""
    words = ds_words(heads)

    def ds_copy(tid, r: int = 0):
        unit = tid + r
        return unit // words, 4 * (unit % words), DS_OFFSET + 4 * unit

    arrays = (("k", K_UNITS, 16, k_copy), ("v", V_UNITS, 16, v_copy), ("scales", SCALE_UNITS, 8, scale_copy))
    return arrays + ((("delta_s", ds_units(heads), 4, ds_copy),) if compensate else ())


def copy_plan(heads: int, compensate: bool = True) -> list:
    """The 4 copying warps' copies of one tile: the arrays of `copy_arrays`, largest first (they fill whole rounds,
    which need no branch), in a row, cut into warp slots of 32 units (every array has a multiple of 32), slot s
    copied by warp s % 4 in round s // 4. -> [(array, r, first warp, end warp)], round by round: warps first ..
    end - 1 copy unit ``tid + r`` of ``array`` (tid = 32 warp + lane; ``r`` a constant, so the copy map's
    per-thread part is shared by all entries)."""
    spans, slots = [], 0
    for array in sorted(copy_arrays(heads, compensate), key=lambda array: -array[1]):
        assert array[1] % WARP == 0, array
        spans.append((array, slots, slots + array[1] // WARP))
        slots += array[1] // WARP
    plan = []
    for round_start in range(0, slots, CTA_WARPS):
        for array, first_slot, end_slot in spans:
            first, end = max(first_slot, round_start), min(end_slot, round_start + CTA_WARPS)
            if first < end:
                plan.append((array, WARP * (round_start - first_slot), first - round_start, end - round_start))
    return plan


# --- reads: lane (g, c) of a warp -------------------------------------------------------------------------------
# Each read is a per-lane base (computed once) plus a constant; the kernel adds the stage's base address.

def k_read(n_tile: int, lane):
    """K chunk c of key 8 n + g (`decode_layout.qk_key`): 16 bytes."""
    return K_OFFSET + 16 * lane + 512 * n_tile


def scale_read(n_tile: int, lane):
    """Block scales 2c, 2c + 1 of key 8 n + g: 2 bytes."""
    return SCALE_OFFSET + 2 * lane + 64 * n_tile


def ds_lane_base(heads: int, first_head, head_in_cta, c):
    return DS_OFFSET + 8 * ds_words(heads) * c + ds_lead(first_head) + 2 * head_in_cta


def ds_read(heads: int, n_tile: int, half: int):
    """Offset from `ds_lane_base` of the BF16 Delta_S of key 8 n + 2c + half (`decode_layout.score_key`)."""
    return 4 * ds_words(heads) * (8 * n_tile + half)


def v_lane_base(g, c):
    """Row 2c, chunk g ^ v_swizzle(8 m + 2c + b) = g ^ 2c: the lane's base for every V read of the tile."""
    return V_OFFSET + V_ROW_BYTES * 2 * c + 16 * (g ^ (2 * c))


def v_read(key_offset: int):
    """Offset from `v_lane_base` of the V chunk of key ``key_offset + 2c`` (``key_offset`` = 8 m + b, b in {0, 1}:
    the keys `prefill_tile.pv_tile_key(0, k_half, 0, j)`)."""
    return V_ROW_BYTES * key_offset


# --- the ring: which tile goes where when (tiles are walked last to first; step p computes tile tiles - 1 - p) -----
# Prologue: copies of steps 0 .. stages - 2 into stages 0 .. stages - 2, one cp.async group each. Step p: wait until
# at most stages - 2 - lookahead groups are pending (the groups of steps p .. p + lookahead have landed), CTA
# barrier, copy the tile of step p + stages - 1 into the stage step p - 1 used (every warp is past the barrier, so
# done with it), commit (an empty group when no tile is left), compute step p. The page-table entry of the next
# copy is fetched one step ahead. With ``shared_dequant`` (the mma-sync kernel; lookahead 1), the prologue waits for
# step 0's tile, barriers and expands its K into fragment buffer 0, and step p expands the K of step p + 1 (from
# its ring stage) into buffer (p + 1) % 2 after the barrier and computes from buffer p % 2 (expanded before that
# barrier).

def ring_prologue(index: int, tiles):
    """(tile index, stage) of the prologue's copy ``index`` (no copy when the tile index is negative)."""
    return tiles - 1 - index, index


def ring_copy(step, tiles, stages: int):
    """(tile index, stage) of the copy issued at ``step`` (no copy when the tile index is negative)."""
    return tiles - step - stages, (step + stages - 1) & (stages - 1)


def ring_compute(step, tiles, stages: int):
    """(tile index, stage, fragment buffer) that ``step`` computes (the buffer only with ``shared_dequant``)."""
    return tiles - 1 - step, step & (stages - 1), step & 1


def ring_wait(stages: int, shared_dequant: bool) -> int:
    """Groups a step may leave pending in its ``cp.async.wait_group``."""
    return stages - 2 - int(shared_dequant)


# --- dequantized K (the mma-sync kernel): each K tile expanded to FP16 once per CTA, not once per warp -------------
# Two buffers after the ring, each [n-tile][quad][lane][16 B]: lane (g, c)'s 16 f16x2 B registers of n-tile n
# (key 8 n + g, chunk c; register 2 k + b feeds b_b of k-step k) as 4 quads of 4 registers; warp w expands n-tile
# w. Every lane writes and reads lane-contiguous 512-byte rows (no bank conflict).

FRAG_QUADS = 4
FRAG_BUFFER_BYTES = 4 * FRAG_QUADS * 32 * 16  # 4 n-tiles of a 32-key tile: 8 KB


def frag_lane_base(stages: int, heads: int, buffer, lane, compensate: bool = True):
    """Lane ``lane``'s fragments in buffer ``buffer`` (0 or 1; the buffers follow the ring of `stage_bytes`)."""
    return stages * stage_bytes(heads, compensate) + FRAG_BUFFER_BYTES * buffer + 16 * lane


def frag_offset(n_tile, quad: int):
    """Offset from `frag_lane_base` of the lane's registers 4 quad .. 4 quad + 3 of n-tile ``n_tile``."""
    return FRAG_QUADS * 512 * n_tile + 512 * quad
