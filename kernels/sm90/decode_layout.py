"""Where every operand of the warp-level sm90 kernels sits in a warp's registers (pure index and bit arithmetic):
the split-KV decode and the mma-sync prefill.

The functions work on Python ints, NumPy arrays and CuTe DSL values alike, so the kernels trace them and the CPU
tests run the same code through a NumPy model of the warp's MMAs (`tests/kernels/sm90`).

A warp works on 32 keys per tile with two warp-level MMAs whose fragment layouts are NVIDIA's (lane = 4 * g + c:
g = lane // 4 "group", c = lane % 4 "thread in group"). The heads-in-rows form (the mma-sync prefill's; the decode
keeps its key and chunk map, transposed, `decode.SplitKVDecodeSm90._qk`):

* S = Q K^T on ``mma.m16n8k16`` FP16, one per 8-key n-tile and 16-element k-step. Rows are the group's query heads
  (row g; rows >= group size and rows 8-15 are zero), columns the n-tile's keys. Lane (g, c) loads key
  ``8 n + g``'s 16-byte chunk c of the NVFP4 K row (elements 32c..32c+31, blocks 2c and 2c+1) and supplies
  those 32 elements over the 8 k-steps; it supplies the same elements of query head g's Q row, so the product
  sums every d exactly once whatever the order. The accumulator starts at Delta_S (the compensation enters
  through the MMA) and lane (g, c) ends with S[head g, keys 8 n + 2c, 8 n + 2c + 1].
* O^T = V^T P^T on ``mma.m16n8k32`` e4m3, one per 16-dimension m-tile and 32-key step. P^T's k-index 4c..4c+3
  is keys (2c, 2c+1) of n-tiles 0 and 1 and 16+4c.. those of n-tiles 2 and 3: exactly the scores lane (g, c)
  already holds for head g, so P never leaves the registers. Lane (g, c) loads chunk g (dimensions 16g..16g+15)
  of the V rows of those 8 keys and transposes bytes so a register holds 4 keys of one dimension.
  Row g of m-tile t is dimension ``16g + 2t``, row g + 8 is ``16g + 2t + 1``; lane (g, c) ends with O for heads
  2c and 2c + 1 over dimensions 16g..16g+15.
"""

from __future__ import annotations

TILE_KEYS = 32
N_TILES = TILE_KEYS // 8
M_TILES = 8
K_STEPS_QK = 8
QK_REGS = 16  # f16x2 registers a lane holds for its 32-element chunk of a K (or Q) row

F16X2_TWO_POW_14 = 0x74007400  # 2**14 in both halves
F16X2_TWO_POW_7 = 0x58005800  # 2**7 in both halves
SCORE_SCALE_LOG2 = 7  # the MMA produces S * 2**-7 (K is dequantized as e2m1 * scale * 2**-7 to stay exact in FP16)


def partition_keys(seq_len, num_parts, min_partition, maximum=max):
    """Keys per partition for a request of ``seq_len`` keys split over the grid's ``num_parts`` partitions: the
    request's keys spread evenly over all of them (whole 32-key tiles), but no fewer than ``min_partition`` keys.

    The grid and workspace are sized for the longest context a launch may see (fixed under CUDA graphs); sizing
    each request's partitions from its own length keeps every partition slot busy at shorter contexts. With
    ``min_partition`` = the workspace's partition size, every request gets that size (the eager default).
    ``maximum``: ``cutlass.max`` inside a kernel."""
    span = num_parts * TILE_KEYS
    return maximum(TILE_KEYS * ((seq_len + span - 1) // span), min_partition)


def k_stage_offset(g, c):
    """Byte offset, within a 512-byte K unit of a shared-memory stage, of lane (g, c)'s 16-byte K chunk (chunk c of
    key ``qk_key(n, g)``): the lane's own index x 16, so key g's 64-byte row lies contiguous, as in global memory."""
    return 16 * (4 * g + c)


def v_stage_offset(g, c):
    """Byte offset, within a 512-byte V unit of a shared-memory stage, of lane (g, c)'s 16-byte V chunk (chunk g of
    key ``score_key(n, c, half)``): key-major, so the 8 lanes of one key fill one 128-byte row, as its bytes lie in
    global memory, with the chunks swizzled (g XOR 2c) so that the 8 lanes of each quarter-warp also hit distinct
    banks when they read their chunks back. At the lane-major offset (`k_stage_offset`) a key's chunks landed 64
    bytes apart: ncu counted ~32 shared-store wavefronts per V cp.async instead of 4, and the L2 one ~1-sector
    request per lane (docs/kernels.md)."""
    return 16 * (8 * c + (g ^ (2 * c)))


def clamped_token(tile, key, end, maximum=max, minimum=min):
    """Token of ``key`` in the tile starting at token ``tile``, clamped to [0, end - 1] (keys past the end read the
    last key's slot; their loads are predicated off)."""
    return maximum(minimum(tile + key, end - 1), 0)


def key_slot(page_of, tile, key, end, page_shift, maximum=max, minimum=min):
    """Cache slot of ``key`` in the tile at ``tile``: its clamped token's page (``page_of(page index)``, a page-table
    read) and offset; pages of ``2**page_shift`` keys. One page-table read per key."""
    token = clamped_token(tile, key, end, maximum, minimum)
    return (page_of(token >> page_shift) << page_shift) + (token & ((1 << page_shift) - 1))


def tile_page_base(page_of, tile, end, page_shift, maximum=max, minimum=min):
    """Slot of the tile's first (clamped) token. With pages of >= TILE_KEYS keys a tile (a multiple of TILE_KEYS
    from the sequence start) lies in one page, so this one page-table read gives every key's slot: the base plus
    the key's offset."""
    return key_slot(page_of, tile, 0, end, page_shift, maximum, minimum)


def qk_key(n_tile, g):
    """Key (within the tile) whose K chunk lane-group g loads for n-tile ``n_tile``."""
    return 8 * n_tile + g


def score_key(n_tile, c, half):
    """Key (within the tile) of accumulator column 2c + half of n-tile ``n_tile``."""
    return 8 * n_tile + 2 * c + half


def pv_key(k_half, c, j):
    """Key (within the tile) at P^T k-index ``16 k_half + 4c + j`` (j in 0..3) of the 32-key PV step."""
    return 8 * (2 * k_half + j // 2) + 2 * c + j % 2


def o_dim(m_tile, g, upper):
    """Head dimension of O^T row ``g + 8 upper`` in m-tile ``m_tile``."""
    return 16 * g + 2 * m_tile + upper


def e2m1_word_to_f16x2(word, j):
    """Word of 8 e2m1 codes -> f16x2 of codes j (low half) and j + 4 (high half), as value * 2**-14, exact.

    The code's exponent and mantissa bits become the low FP16 exponent bits and the top mantissa bit, so the
    e2m1 subnormal 0.5 and zero land on FP16 subnormals/zero: no special cases."""
    shift = 9 - 4 * j
    magnitude = (word << shift) if shift >= 0 else (word >> -shift)
    return (magnitude & 0x0E000E00) | ((word << (12 - 4 * j)) & 0x80008000)


def qk_step_regs(step):
    """The two f16x2 registers (b0 = k 2c, 2c+1; b1 = k 2c+8, 2c+9) a lane feeds to QK k-step ``step``."""
    return 2 * step, 2 * step + 1


def scale_block_of_step(step):
    """0 for the chunk's first NVFP4 block (block 2c), 1 for the second (block 2c + 1)."""
    return step // 4


def transpose_selectors():
    """prmt selectors of a 4x4 byte transpose: rows r0..r3 -> X[b] = (r0.b, r1.b, r2.b, r3.b)."""
    return 0x5140, 0x7362, 0x5410, 0x7632


def pv_a_regs(m_tile):
    """Indices into the transposed V bytes (4 x word + byte) feeding a0/a1 (first key half) and a2/a3 (second)."""
    return 2 * m_tile, 2 * m_tile + 1


# --- the decode's K expansion: the same f16x2 registers from 4 bytes at a time ------------------------------------
# An FP16 high byte (s 0 0 0 e1 e0 m 0) holds an e2m1 code as value * 2**-14 with a zero low byte: the register of
# codes j, j + 4 of a word (`e2m1_word_to_f16x2`) is two such bytes, so a word's 8 codes become two words of high
# bytes (codes 0, 2, 4, 6 and 1, 3, 5, 7) and each register is one byte pick of those: codes j, j + 4 are bytes
# j // 2 and j // 2 + 2, moved into the high halves by one prmt for j < 2 (`PICK_EVEN_BYTES`), masked in place else.
E2M1_SIGN_BYTES = 0x80808080
E2M1_MAGNITUDE_BYTES = 0x0E0E0E0E
PICK_EVEN_BYTES = 0x2404  # prmt(t, 0, .): bytes 0 and 2 of t into the high bytes of the two halves
PICK_ODD_BYTES = 0xFF00FF00  # t & .: bytes 1 and 3 of t, already in place


def e2m1_high_bytes(word, low_nibbles: bool):
    """FP16 high bytes of the word's 4 low-nibble codes (0, 2, 4, 6; ``low_nibbles``) or high-nibble codes (1, 3,
    5, 7), byte k for the code of byte k."""
    if low_nibbles:
        return ((word << 4) & E2M1_SIGN_BYTES) | ((word << 1) & E2M1_MAGNITUDE_BYTES)
    return (word & E2M1_SIGN_BYTES) | ((word >> 3) & E2M1_MAGNITUDE_BYTES)


def scale_pair_selector(c):
    """prmt selector of a lane's two K block scales (bytes 2 (c % 2), + 1 of its aligned scale word) -> bytes
    (s_a, s_a, s_b, s_b): the low half converts to both halves of block 2c's scale, the high half block 2c + 1's."""
    return 0x1100 + 0x2222 * (c % 2)


def delta_s_selector(g):
    """prmt selector (with a zero second operand) moving head g's BF16 Delta_S (low half of its aligned word for
    even g, high half for odd g) into the high half, zeros below: the FP32 of the BF16."""
    return 0x1044 + 0x2200 * (g % 2)
