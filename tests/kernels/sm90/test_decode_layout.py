"""The warp-level register layout of `decode_layout`, checked on the CPU: a NumPy model of one warp builds every
operand register with `decode_layout` exactly as the kernels do, runs the MMAs with NVIDIA's fragment layouts (from
CUTLASS's MMA traits for SM80 m16n8k16 FP16 and SM89 m16n8k32 e4m3), and must reproduce S = Q K^T + Delta_S
and O = e4m3(448 P) V computed directly from the formats: the heads-in-rows form of the mma-sync prefill, and the
decode kernel's keys-in-rows S^T = K Q^T, byte-level K expansion and PV on FP16 MMAs. Also the decode's shared-memory
staging, page-table reads and partitions."""

from __future__ import annotations

import numpy as np
import torch

from mpfa.kernels import E2M1_GRID, dequantize_nvfp4, quantize_nvfp4
from mpfa.kernels.cache_layout import delta_s_row
from mpfa.kernels.formats import NVFP4Tensor
from mpfa.kernels.sm90 import decode_layout as lay

LANES = np.arange(32)
G_OF_LANE, C_OF_LANE = LANES // 4, LANES % 4
HEAD_DIM = 128


def _f16_halves(reg: int) -> tuple[float, float]:
    halves = np.array([reg & 0xFFFF, reg >> 16], dtype=np.uint16).view(np.float16)
    return float(halves[0]), float(halves[1])


def _mul_f16x2(a: int, b: int) -> int:
    """mul.rn.f16x2 (the products in the kernel are exact in FP16, so NumPy's FP16 multiply is faithful)."""
    lo = np.float16(_f16_halves(a)[0]) * np.float16(_f16_halves(b)[0])
    hi = np.float16(_f16_halves(a)[1]) * np.float16(_f16_halves(b)[1])
    bits = np.array([lo, hi], dtype=np.float16).view(np.uint16)
    return int(bits[0]) | int(bits[1]) << 16


def _e4m3(byte_values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.array(byte_values, dtype=np.uint8)).view(torch.float8_e4m3fn).double().numpy()


def _words(row: np.ndarray) -> list[int]:
    """16 bytes -> 4 little-endian u32."""
    return [int(w) for w in np.ascontiguousarray(row, dtype=np.uint8).view("<u4")]


def _prmt(a: int, b: int, selector: int) -> int:
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(source[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def _mma_f16(a: list[list[int]], b: list[list[int]], c: np.ndarray) -> np.ndarray:
    """m16n8k16 row.col: lane (g, c) holds A regs (row g + 8 (r % 2), cols 2c + 8 (r // 2) + {0, 1}),
    B regs (rows 2c + 8 r + {0, 1}, col g), C (row g + 8 (i // 2), col 2c + i % 2)."""
    a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
    for lane, (g, t) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
        for r in range(4):
            a_mat[g + 8 * (r % 2), 2 * t + 8 * (r // 2) + np.arange(2)] = _f16_halves(a[lane][r])
        for r in range(2):
            b_mat[2 * t + 8 * r + np.arange(2), g] = _f16_halves(b[lane][r])
    d = a_mat @ b_mat
    return c + np.array([[d[g + 8 * (i // 2), 2 * t + i % 2] for i in range(4)] for g, t in zip(G_OF_LANE, C_OF_LANE)])


def _mma_e4m3(a: list[list[int]], b: list[list[int]]) -> np.ndarray:
    """m16n8k32 row.col e4m3: A regs (row g + 8 (r % 2), k 4c + 16 (r // 2) + byte), B regs (k 4c + 16 r + byte,
    col g), C as for m16n8k16."""
    a_mat, b_mat = np.zeros((16, 32)), np.zeros((32, 8))
    for lane, (g, t) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
        for r in range(4):
            a_mat[g + 8 * (r % 2), 4 * t + 16 * (r // 2) + np.arange(4)] = _e4m3(np.frombuffer(a[lane][r].to_bytes(4, "little"), np.uint8))
        for r in range(2):
            b_mat[4 * t + 16 * r + np.arange(4), g] = _e4m3(np.frombuffer(b[lane][r].to_bytes(4, "little"), np.uint8))
    d = a_mat @ b_mat
    return np.array([[d[g + 8 * (i // 2), 2 * t + i % 2] for i in range(4)] for g, t in zip(G_OF_LANE, C_OF_LANE)])


def test_e2m1_word_decodes_every_code_in_every_position():
    for code in range(16):
        word = sum(code << (4 * n) for n in range(8))
        for j in range(4):
            lo, hi = _f16_halves(lay.e2m1_word_to_f16x2(word, j))
            expected = (-1.0 if code & 8 else 1.0) * E2M1_GRID[code & 7] * 2.0**-14
            assert lo == hi == expected
            assert np.signbit(lo) == bool(code & 8)


def _q_lane_regs(q_codes: np.ndarray, q_scales: np.ndarray, group: int, g: int, c: int) -> list:
    """Lane (g, c)'s QK A-operand registers: head g's dims 32c .. 32c + 31 as f16x2 (e2m1 x 2**14 x block scale),
    zeros for rows past the group."""
    words = _words(q_codes[g, 16 * c:16 * c + 16]) if g < group else [0] * 4
    scale_pair = _e4m3(q_scales[g, 2 * c:2 * c + 2]) if g < group else np.zeros(2)
    regs = []
    for reg in range(lay.QK_REGS):
        word, j = divmod(reg, 4)
        exact = _mul_f16x2(lay.e2m1_word_to_f16x2(words[word], j), lay.F16X2_TWO_POW_14)
        scale = np.array([scale_pair[word // 2]] * 2, dtype=np.float16).view(np.uint16)
        regs.append(_mul_f16x2(exact, int(scale[0]) | int(scale[1]) << 16))
    return regs


def _qk_tile_model(q: NVFP4Tensor, k: NVFP4Tensor, ds: np.ndarray, group: int) -> np.ndarray:
    """S * 2**-7 [group, 32] as the warp computes it (q: [group, d], k: [32, d] NVFP4; ds [32, group])."""
    q_codes, q_scales = q.codes.numpy(), q.scales.view(torch.uint8).numpy()
    k_codes, k_scales = k.codes.numpy(), k.scales.view(torch.uint8).numpy()
    scores = np.full((group, lay.TILE_KEYS), np.nan)
    q_regs = [_q_lane_regs(q_codes, q_scales, group, g, c) for g, c in zip(G_OF_LANE, C_OF_LANE)]
    for n_tile in range(lay.N_TILES):
        a_steps, b_steps = [], []
        init = np.zeros((32, 4))
        for lane, (g, c) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
            key = lay.qk_key(n_tile, g)
            words = _words(k_codes[key, 16 * c:16 * c + 16])
            scales = _e4m3(k_scales[key, 2 * c:2 * c + 2]) * 2.0**lay.SCORE_SCALE_LOG2
            steps_b = []
            for step in range(lay.K_STEPS_QK):
                scale = np.array([scales[lay.scale_block_of_step(step)]] * 2, dtype=np.float16).view(np.uint16)
                steps_b.append([_mul_f16x2(lay.e2m1_word_to_f16x2(words[r // 4], r % 4), int(scale[0]) | int(scale[1]) << 16)
                                for r in lay.qk_step_regs(step)])
            b_steps.append(steps_b)
            r_pairs = [lay.qk_step_regs(step) for step in range(lay.K_STEPS_QK)]
            a_steps.append([[q_regs[lane][r0], 0, q_regs[lane][r1], 0] for r0, r1 in r_pairs])
            for half in range(2):
                init[lane, half] = ds[lay.score_key(n_tile, c, half), g] * 2.0**-lay.SCORE_SCALE_LOG2 if g < group else 0
        acc = init
        for step in range(lay.K_STEPS_QK):
            acc = _mma_f16([a_steps[lane][step] for lane in LANES], [b_steps[lane][step] for lane in LANES], acc)
        for lane, (g, c) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
            if g < group:
                for half in range(2):
                    scores[g, lay.score_key(n_tile, c, half)] = acc[lane, half]
    return scores


def _qk_problem(gen: torch.Generator, group: int) -> tuple:
    """(q [group, d], k [32, d] NVFP4, Delta_S [32, group] BF16-exact, S + Delta_S^T [group, 32] in float64)."""
    q = quantize_nvfp4(torch.randn(group, HEAD_DIM, generator=gen) * 3)
    k = quantize_nvfp4(torch.randn(lay.TILE_KEYS, HEAD_DIM, generator=gen) * 5)
    ds = torch.randn(lay.TILE_KEYS, group, generator=gen).bfloat16().double().numpy()
    return q, k, ds, (dequantize_nvfp4(q).double() @ dequantize_nvfp4(k).double().T).numpy() + ds.T


def test_qk_fragments_compute_scores_plus_delta_s():
    gen = torch.Generator().manual_seed(11)
    for group in (4, 5, 8):
        q, k, ds, expected = _qk_problem(gen, group)
        np.testing.assert_allclose(_qk_tile_model(q, k, ds, group) * 2.0**lay.SCORE_SCALE_LOG2, expected,
                                   rtol=1e-12, atol=1e-12)


def _scatter_o(out: np.ndarray, d: np.ndarray, m_tile: int, group: int) -> None:
    """PV m-tile ``m_tile``'s accumulator ``d`` [lane, 4] into O [group, d] (lane (g, c): heads 2c, 2c + 1)."""
    for lane, (g, c) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
        for i in range(4):
            head = 2 * c + i % 2
            if head < group:
                out[head, lay.o_dim(m_tile, g, i // 2)] = d[lane, i]


def _pv_problem(gen: torch.Generator, group: int) -> tuple:
    """(P e4m3 bytes [group, 32] = e4m3(448 P) of random P, V e4m3 bytes [32, d], e4m3(448 P) V [group, d])."""
    p = torch.rand(group, lay.TILE_KEYS, generator=gen)
    p_bytes = (p * 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    v = (torch.randn(lay.TILE_KEYS, HEAD_DIM, generator=gen) * 4).to(torch.float8_e4m3fn)
    return p_bytes, v.view(torch.uint8).numpy(), _e4m3(p_bytes) @ v.double().numpy()


def test_pv_fragments_compute_fp8_p_times_v():
    gen = torch.Generator().manual_seed(12)
    sel_lo, sel_hi, sel_even, sel_odd = lay.transpose_selectors()
    for group in (4, 5, 8):
        p_bytes, v_bytes, expected = _pv_problem(gen, group)

        a_regs, b_regs = [], []
        for g, c in zip(G_OF_LANE, C_OF_LANE):
            pairs = [int(p_bytes[g, lay.score_key(n, c, 0)]) | int(p_bytes[g, lay.score_key(n, c, 1)]) << 8
                     if g < group else 0 for n in range(lay.N_TILES)]
            b_regs.append([pairs[0] | pairs[1] << 16, pairs[2] | pairs[3] << 16])
            transposed = []
            for k_half in range(2):
                rows = [_words(v_bytes[lay.pv_key(k_half, c, j), 16 * g:16 * g + 16]) for j in range(4)]
                by_dim = []
                for w in range(4):
                    lo01, hi01 = _prmt(rows[0][w], rows[1][w], sel_lo), _prmt(rows[0][w], rows[1][w], sel_hi)
                    lo23, hi23 = _prmt(rows[2][w], rows[3][w], sel_lo), _prmt(rows[2][w], rows[3][w], sel_hi)
                    by_dim += [_prmt(lo01, lo23, sel_even), _prmt(lo01, lo23, sel_odd),
                               _prmt(hi01, hi23, sel_even), _prmt(hi01, hi23, sel_odd)]
                transposed.append(by_dim)
            a_regs.append(transposed)
        out = np.full((group, HEAD_DIM), np.nan)
        for m_tile in range(lay.M_TILES):
            lower, upper = lay.pv_a_regs(m_tile)
            d = _mma_e4m3([[t[0][lower], t[0][upper], t[1][lower], t[1][upper]] for t in a_regs], b_regs)
            _scatter_o(out, d, m_tile, group)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


# --- the decode's copies, shared-memory ring and partitions ----------------------------------------------------


def test_word_copies_hold_the_lanes_16_bit_values():
    """The decode copies the aligned 4-byte words holding a lane's 2-byte values (cp.async's smallest size): lane
    c's K-scale word holds blocks 2c, 2c + 1 of a key, its Delta_S word heads 2c, 2c + 1. Modelled on little-endian
    head-major arrays like the cache's ([KV head, slot] rows of 8 scale bytes and of `delta_s_row` BF16 values, 8
    or 16 bytes: every word aligned, for any group), at the kernel's byte offsets."""
    rng = np.random.default_rng(0)
    hkv, slots = 3, 5
    scales = rng.integers(0, 256, size=(hkv, slots, 8), dtype=np.uint8)
    flat = scales.reshape(-1)
    for kv_head in range(hkv):
        for slot in range(slots):
            for c in range(4):
                offset = (kv_head * slots + slot) * 8 + 4 * (c >> 1)
                assert offset % 4 == 0
                word = int(flat[offset:offset + 4].view(np.uint32)[0])
                picked = _prmt(word, word, lay.scale_pair_selector(c)).to_bytes(4, "little")
                assert picked[::2] == bytes(scales[kv_head, slot, 2 * c:2 * c + 2])
    for group in (1, 3, 4, 5, 8):
        row = delta_s_row(group)
        ds = rng.integers(0, 1 << 16, size=(hkv, slots, row), dtype=np.uint16)
        as_bytes = ds.reshape(-1).view(np.uint8)
        for kv_head in range(hkv):
            for slot in range(slots):
                for c in range(-(-group // 2)):
                    offset = (kv_head * slots + slot) * row * 2 + 4 * c
                    assert offset % 4 == 0
                    word = int(as_bytes[offset:offset + 4].view(np.uint32)[0])
                    for h in range(2):
                        assert _prmt(word, 0, lay.delta_s_selector(h)) == int(ds[kv_head, slot, 2 * c + h]) << 16


def _bank_groups(offsets: np.ndarray) -> np.ndarray:
    """The 16-byte bank group (4 banks of 4 bytes, 8 groups per 128 bytes) of each 16-byte shared access."""
    return (offsets // 16) % 8


def test_stage_chunks_lie_like_their_global_rows_and_are_bank_conflict_free():
    k_offsets, v_offsets = lay.k_stage_offset(G_OF_LANE, C_OF_LANE), lay.v_stage_offset(G_OF_LANE, C_OF_LANE)
    for offsets in (k_offsets, v_offsets):  # one 16-byte chunk per lane, the 512-byte unit exactly covered
        assert sorted(offsets.tolist()) == list(range(0, 512, 16))
    for g in range(8):  # key g's K row: chunks c = 0..3 in order, 64 contiguous bytes (as in global memory)
        assert k_offsets[G_OF_LANE == g].tolist() == [64 * g + 16 * c for c in range(4)]
    for c in range(4):  # the V row of key 2c (+ half): its 8 chunks fill one 128-byte row (one L2 line)
        assert sorted(v_offsets[C_OF_LANE == c].tolist()) == list(range(128 * c, 128 * c + 128, 16))
    for quarter in range(4):  # 16-byte accesses go 8 lanes at a time: distinct bank groups, no conflict
        lanes = slice(8 * quarter, 8 * quarter + 8)
        for offsets in (k_offsets, v_offsets):
            assert len(set(_bank_groups(offsets[lanes]).tolist())) == 8
    # the lane-major V offset this replaced (the K one) spread a key's 8 chunks 64 bytes apart over 512 bytes
    assert np.diff(np.sort(k_offsets[C_OF_LANE == 0])).tolist() == [64] * 7


def test_shared_memory_ring_keeps_the_warps_per_sm():
    import pytest

    pytest.importorskip("cutlass")
    from mpfa.kernels.sm90 import decode
    from mpfa.kernels.sm90.decode_launch import WARPS_PER_SM

    per_lane_chunks = lay.N_TILES * 3  # 4 K chunks + 8 V chunks of 16 B
    assert decode.STAGE_BYTES == per_lane_chunks * 32 * 16 + per_lane_chunks * 32 * 4 == 7680
    # 227 KB usable per SM on sm90, 1 KB reserved per CTA
    assert WARPS_PER_SM * (decode.SplitKVDecodeSm90(8, 4, 128).smem_bytes + 1024) <= 227 * 1024


def _assert_one_wave(warps_per_sm: int | None, target: int) -> None:
    """Partitions for 8 KV heads on 132 SMs: tile multiples in [MIN_PARTITION, MAX_PARTITION], at most one wave of
    ``target`` warps per SM unless clamped, and the shortest that fits."""
    from mpfa.kernels.sm90.decode_launch import MAX_PARTITION, MIN_PARTITION, choose_partition_size

    for batch, seq in ((1, 8192), (1, 32768), (1, 131072), (8, 131072), (8, 8192), (3, 100_003)):
        size = choose_partition_size(batch, 8, seq, 132, warps_per_sm=warps_per_sm)
        assert size % lay.TILE_KEYS == 0 and MIN_PARTITION <= size <= MAX_PARTITION
        warps = batch * 8 * -(-seq // size)
        assert warps <= target * 132 or size in (MIN_PARTITION, MAX_PARTITION)
        if size > MIN_PARTITION:  # the next smaller partition would overflow one wave
            assert batch * 8 * -(-seq // (size - lay.TILE_KEYS)) > target * 132 - batch * 8


def test_partitions_fill_one_wave_of_decode_warps(monkeypatch):
    """`PARTITION_WARPS_PER_SM` (6) warps per SM by default; every slot when it says so."""
    from mpfa.kernels.sm90 import decode_launch as launch
    from mpfa.kernels.sm90.decode_launch import WARPS_PER_SM, choose_partition_size

    assert choose_partition_size(1, 8, 32768, 132) == FEWER_WARPS_SIZES[1, 32768][2]
    _assert_one_wave(None, launch.PARTITION_WARPS_PER_SM)
    monkeypatch.setattr(launch, "PARTITION_WARPS_PER_SM", WARPS_PER_SM)
    _assert_one_wave(None, WARPS_PER_SM)
    assert choose_partition_size(1, 8, 131072, 132) == 672
    assert choose_partition_size(8, 8, 131072, 132) == 5472


# (batch, context) -> partition size at 12 (every slot), 8, 6 (the default) and 3 warps per SM; 8 KV heads, 132 SMs
FEWER_WARPS_SIZES = {
    (1, 32768): (192, 256, 352, 672),  # 171, 128, 94, 49 partitions (40:8 32K x 1: 1.55x FlashInfer at 12)
    (8, 32768): (1376, 2048, 2752, 5472),  # 24, 16, 12, 6
    (1, 131072): (672, 1024, 1344, 2688),  # 196, 128, 98, 49
    (1, 8192): (128, 128, 128, 192),  # MIN_PARTITION up to 6 warps per SM
    (8, 131072): (5472, 8192, 8192, 8192),  # MAX_PARTITION from 8 warps per SM
}


def test_partitions_for_fewer_warps_per_sm():
    """Partitions aimed at n warps per SM: fewer and longer, one wave of n; 40:8 and 32:8 alike (one warp per KV
    head and partition). The workspace follows: eager (every request that size) and as CUDA-graph buffers
    (MIN_PARTITION floor: a request's keys spread over all partitions, none left out)."""
    from mpfa.kernels.sm90.decode_launch import MIN_PARTITION, DecodeWorkspace

    for warps in (8, 6, 3):
        _assert_one_wave(warps, warps)
    for (batch, seq), sizes in FEWER_WARPS_SIZES.items():
        for warps, size in zip((12, 8, 6, 3), sizes):
            for num_q_heads in (40, 32):
                eager = DecodeWorkspace.allocate(batch, num_q_heads, 8, seq, "cpu", warps_per_sm=warps)
                parts = -(-seq // size)
                assert eager.partition_size == size and tuple(eager.o.shape) == (batch, num_q_heads, parts, 128)
                assert eager.partition_keys(seq) == size
                graph = DecodeWorkspace.allocate(batch, num_q_heads, 8, seq, "cpu", min_partition=MIN_PARTITION,
                                                 warps_per_sm=warps)
                for n in (seq, seq // 3 + 1, 1):
                    assert -(-n // graph.partition_keys(n)) <= parts and graph.partition_keys(n) <= size


def test_partition_warps_default_bounds_and_adoption(monkeypatch):
    """`PARTITION_WARPS_PER_SM` by default, for every decode; 1 up to `WARPS_PER_SM` on request; bad targets and
    argument pairs are one-line errors."""
    import pytest

    from mpfa.kernels.sm90 import decode_launch as launch

    assert launch.partition_warps() == launch.PARTITION_WARPS_PER_SM == 6
    assert launch.partition_warps(launch.WARPS_PER_SM) == 12 and launch.partition_warps(1) == 1
    for warps in (13, 0):
        with pytest.raises(ValueError, match=f"decode partitions aim at 1 to 12 warps per SM, got {warps}"):
            launch.choose_partition_size(1, 8, 32768, 132, warps_per_sm=warps)
    with pytest.raises(ValueError, match="partition_size or warps_per_sm, not both"):
        launch.DecodeWorkspace.allocate(1, 40, 8, 32768, "cpu", 256, warps_per_sm=6)
    assert launch.choose_partition_size(1, 8, 32768, 132) == 352
    assert launch.choose_partition_size(1, 8, 32768, 132, warps_per_sm=3) == 672  # a pinned target wins
    monkeypatch.setattr(launch, "PARTITION_WARPS_PER_SM", 10)
    assert launch.partition_warps() == 10 and launch.choose_partition_size(1, 8, 32768, 132) == 224


def test_partitions_spread_each_request_over_the_grid():
    for parts in (1, 7, 24, 197):
        for floor in (32, 128, 672):
            for n in range(1, parts * 1024, 97):
                size = lay.partition_keys(n, parts, floor)
                assert size % lay.TILE_KEYS == 0 and size >= floor
                assert -(-n // size) <= parts  # the grid's partitions hold every key
                if size > floor:  # not at the floor: no smaller tile multiple would fit in `parts` partitions
                    assert -(-n // (size - lay.TILE_KEYS)) > parts
    # 32K in buffers sized for 128K (24 partitions of 5536 keys at batch 8): all 24 slots work, not 6
    assert -(-32768 // lay.partition_keys(32768, 24, 128)) == 24
    # the floor equal to the workspace's partition size gives every request that size (eager launches)
    assert all(lay.partition_keys(n, 10, 640) == 640 for n in range(1, 6400))


def test_one_page_read_per_tile_gives_every_keys_slot():
    """With pages of >= 32 keys, one page-table read (`tile_page_base`) plus the key's offset equals `key_slot`
    (one read per key) for every key of a tile inside the sequence; a prefetch tile before the start gets the first
    page's first slot."""
    import random

    rng = random.Random(7)
    for page_shift in (5, 6, 7):
        page_size = 1 << page_shift
        for end in (1, 31, 32, 33, 100, 257, 1000):
            pages = rng.sample(range(4 * end + 8), -(-end // page_size))
            reads = []

            def page_of(index):
                reads.append(index)
                return pages[index]

            for tile in range(-2 * lay.TILE_KEYS, end, lay.TILE_KEYS):
                reads.clear()
                base = lay.tile_page_base(page_of, tile, end, page_shift)
                assert len(reads) == 1
                if tile < 0:
                    assert base == pages[0] * page_size
                for key in range(min(lay.TILE_KEYS, end - tile) if tile >= 0 else 0):
                    assert base + key == lay.key_slot(page_of, tile, key, end, page_shift)


# --- the decode's byte-level K expansion, scale / Delta_S picks, S^T = K Q^T and PV on FP16 MMAs ------------------

def test_k_byte_expansion_gives_the_exact_f16_registers():
    """Two words of FP16 high bytes per K word and one byte pick per register (a prmt with a zero second operand
    for codes 0, 1, 4, 5, a mask for 2, 3, 6, 7) give `e2m1_word_to_f16x2`'s registers, for every code in every
    position and random words."""
    rng = np.random.default_rng(4)
    words = [sum(code << (4 * n) for n in range(8)) for code in range(16)]
    words += [int(w) for w in rng.integers(0, 1 << 32, size=2000, dtype=np.uint64)]
    for word in words:
        for j in range(4):
            high_bytes = lay.e2m1_high_bytes(word, low_nibbles=j % 2 == 0) & 0xFFFFFFFF
            picked = _prmt(high_bytes, 0, lay.PICK_EVEN_BYTES) if j < 2 else high_bytes & lay.PICK_ODD_BYTES
            assert picked == lay.e2m1_word_to_f16x2(word, j) & 0xFFFFFFFF


def test_scale_and_delta_s_picks():
    """The lane's K block scales as (s_a, s_a, s_b, s_b) bytes from its aligned scale word, and head g's BF16
    Delta_S moved into the high half (the FP32 of the BF16) from its aligned word."""
    rng = np.random.default_rng(5)
    for word in (int(w) for w in rng.integers(0, 1 << 32, size=200, dtype=np.uint64)):
        data = word.to_bytes(4, "little")
        for c in range(4):
            s_a, s_b = data[2 * (c % 2)], data[2 * (c % 2) + 1]
            assert _prmt(word, word, lay.scale_pair_selector(c)).to_bytes(4, "little") == bytes([s_a, s_a, s_b, s_b])
        for g in range(8):
            assert _prmt(word, 0, lay.delta_s_selector(g)) == ((word >> (16 * (g % 2))) & 0xFFFF) << 16


def _e4m3x2_to_f16x2(pair: int) -> int:
    halves = np.array(_e4m3(np.frombuffer((pair & 0xFFFF).to_bytes(2, "little"), np.uint8)), dtype=np.float16)
    bits = halves.view(np.uint16)
    return int(bits[0]) | int(bits[1]) << 16


def test_pv_on_fp16_mmas_computes_fp8_p_times_v():
    """The decode's PV: per m-tile two m16n8k16 over the 2x2-byte-transposed V pairs (keys j0, j1 / j2, j3 of both
    16-key halves) unpacked to f16x2, with P's e4m3 pairs unpacked to f16x2, equals e4m3(448 P) V."""
    gen = torch.Generator().manual_seed(13)
    sel_lo, sel_hi = lay.transpose_selectors()[:2]
    for group in (4, 5, 8):
        p_bytes, v_bytes, expected = _pv_problem(gen, group)

        b_regs, pairs = [], []
        for g, c in zip(G_OF_LANE, C_OF_LANE):
            pf = [_e4m3x2_to_f16x2(int(p_bytes[g, lay.score_key(n, c, 0)]) | int(p_bytes[g, lay.score_key(n, c, 1)]) << 8)
                  if g < group else 0 for n in range(lay.N_TILES)]
            b_regs.append(([pf[0], pf[2]], [pf[1], pf[3]]))
            rows = [_words(v_bytes[lay.score_key(n, c, half), 16 * g:16 * g + 16])
                    for n in range(lay.N_TILES) for half in range(2)]  # v_rows[2 n + half]
            pairs.append([[[[_prmt(rows[4 * k_half + 2 * jj][w], rows[4 * k_half + 2 * jj + 1][w], sel)
                             for sel in (sel_lo, sel_hi)] for w in range(4)] for jj in range(2)] for k_half in range(2)])
        out = np.full((group, HEAD_DIM), np.nan)
        for m_tile in range(lay.M_TILES):
            word, which = divmod(m_tile, 2)
            d = np.zeros((32, 4))
            for jj in range(2):
                a = [[f(lane_pairs[k_half][jj][word][which]) for k_half in range(2)
                      for f in (_e4m3x2_to_f16x2, lambda x: _e4m3x2_to_f16x2(x >> 16))] for lane_pairs in pairs]
                d = _mma_f16(a, [b[jj] for b in b_regs], d)
            _scatter_o(out, d, m_tile, group)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def _movmatrix_trans(x: list[int]) -> list[int]:
    """movmatrix.m8n8.trans.b16: lane (g, c) gives (row g, columns 2c, 2c + 1) and gets those of the transpose."""
    m = np.zeros((8, 8), dtype=np.int64)
    for lane, (g, c) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
        m[g, 2 * c], m[g, 2 * c + 1] = x[lane] & 0xFFFF, x[lane] >> 16
    return [int(m[2 * c, g]) | int(m[2 * c + 1, g]) << 16 for g, c in zip(G_OF_LANE, C_OF_LANE)]


def test_keys_in_m_compute_scores_and_hand_p_to_pv():
    """The decode's S^T = K Q^T (keys qk_key(2i, g), qk_key(2i + 1, g) in rows g, g + 8 of m-tile i; heads 2c,
    2c + 1 in the lane's columns; K * 2**-14 operands, Delta_S words of heads 2c, 2c + 1) gives S * 2**-14 + Delta_S,
    and the transpose of a lane's (key, head pair) values is the PV's P^T fragment: head g, keys
    score_key(n, c, 0 / 1)."""
    gen = torch.Generator().manual_seed(14)
    for group in (4, 5, 8):
        q, k, ds, expected = _qk_problem(gen, group)
        q_codes, q_scales = q.codes.numpy(), q.scales.view(torch.uint8).numpy()
        k_codes, k_scales = k.codes.numpy(), k.scales.view(torch.uint8).numpy()
        q_regs, k_regs = [], []
        for g, c in zip(G_OF_LANE, C_OF_LANE):
            q_regs.append(_q_lane_regs(q_codes, q_scales, group, g, c))
            lane_keys = []
            for n in range(lay.N_TILES):
                key = lay.qk_key(n, g)
                words = _words(k_codes[key, 16 * c:16 * c + 16])
                scales = _e4m3(k_scales[key, 2 * c:2 * c + 2])  # no 2**7: K * 2**-14
                regs = []
                for reg in range(lay.QK_REGS):
                    word, j = divmod(reg, 4)
                    scale = np.array([scales[word // 2]] * 2, dtype=np.float16).view(np.uint16)
                    regs.append(_mul_f16x2(lay.e2m1_word_to_f16x2(words[word], j), int(scale[0]) | int(scale[1]) << 16))
                lane_keys.append(regs)
            k_regs.append(lane_keys)
        scores = np.full((group, lay.TILE_KEYS), np.nan)
        for m_tile in range(2):
            lo, hi = 2 * m_tile, 2 * m_tile + 1
            acc = np.array([[ds[lay.qk_key(n, g), 2 * c + h] * 2.0**-14 if 2 * c + h < group else 0.0
                             for n in (lo, hi) for h in range(2)] for g, c in zip(G_OF_LANE, C_OF_LANE)])
            for step in range(lay.K_STEPS_QK):
                r0, r1 = lay.qk_step_regs(step)
                acc = _mma_f16([[k_regs[lane][lo][r0], k_regs[lane][hi][r0], k_regs[lane][lo][r1], k_regs[lane][hi][r1]]
                                for lane in LANES], [[q_regs[lane][r0], q_regs[lane][r1]] for lane in LANES], acc)
            for lane, (g, c) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
                for i in range(4):
                    head = 2 * c + i % 2
                    if head < group:
                        scores[head, lay.qk_key(lo + i // 2, g)] = acc[lane, i]
        np.testing.assert_allclose(scores * 2.0**14, expected, rtol=1e-12, atol=1e-12)

        # P^T: a lane's (key qk_key(n, g); heads 2c, 2c + 1) 16-bit values, transposed -> (head g; keys 8n + 2c + h)
        tag = lambda key, head: key * 16 + head  # noqa: E731
        for n in range(lay.N_TILES):
            x = [tag(lay.qk_key(n, g), 2 * c) | tag(lay.qk_key(n, g), 2 * c + 1) << 16 for g, c in zip(G_OF_LANE, C_OF_LANE)]
            y = _movmatrix_trans(x)
            for lane, (g, c) in enumerate(zip(G_OF_LANE, C_OF_LANE)):
                assert y[lane] == tag(lay.score_key(n, c, 0), g) | tag(lay.score_key(n, c, 1), g) << 16


def test_k_operand_is_exact_at_2_pow_minus_14():
    """The decode multiplies e2m1 * 2**-14 by the raw e4m3 block scale: every product is exact in FP16 (a multiple
    of 2**-24 below 2**-14, at most 8 significant bits above), for every code and finite scale."""
    codes = np.array(E2M1_GRID, dtype=np.float64) * 2.0**-14
    scales = _e4m3(np.arange(0, 127, dtype=np.uint8))
    for code in codes:
        products = np.float16(code) * scales.astype(np.float16)  # FP16 multiply, round to nearest
        np.testing.assert_array_equal(products.astype(np.float64), code * scales)
