"""The prefill register math, run on the CPU: every register of a warp is a NumPy vector over its 32 lanes and the
PTX primitives that `warp_mma` and `prefill_tile` use are emulated (MMAs with NVIDIA's fragment layouts, as in
test_decode_layout), so the very functions the mma-sync kernel traces compute one warp's 16 query rows over its
KV tiles. The glue gathers each lane's operands from the paged cache's bytes (the bytes the kernel's ring stage
gives it: test_prefill_staged_layout) and expands K as the kernel's shared expansion does (`warp_mma.k_fragments`).
The result must equal the reference's `mpfa` tile loop (`reference._kv_tiles`, 32-key tiles in reverse) on the same
NVFP4/FP8 operands, up to FP32 summation order: causal with kv_len > q_len (chunked prefill), rows that see no
key, a ragged last tile, and non-causal, through both of the kernel's tile loops (masked tiles, then whole tiles).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpfa.kernels import dequantize_nvfp4, quantize_nvfp4
from mpfa.kernels.reference import VARIANTS, _kv_tiles

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import decode_layout as lay  # noqa: E402
from mpfa.kernels.sm90 import prefill_tile as tile_math  # noqa: E402
from mpfa.kernels.sm90 import warp_mma  # noqa: E402
from mpfa.kernels.sm90.prefill_staged_layout import TILE_KEYS, WARP_ROWS  # noqa: E402

LANES = np.arange(32)
G, C = LANES // 4, LANES % 4
HEAD_DIM = 128


# --- the warp: one vector of 32 lanes per register ----------------------------------------------------------------

def _u32(x):
    return np.broadcast_to(np.asarray(x).astype(np.int64).astype(np.uint32), (32,)).copy()


def _f32(x):
    return np.broadcast_to(np.asarray(x, dtype=np.float32), (32,)).copy()


def _halves(reg) -> np.ndarray:
    return _u32(reg).view(np.float16).reshape(32, 2)


def _from_halves(halves: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(halves.astype(np.float16)).view(np.uint32).reshape(32)


def _bytes(reg) -> np.ndarray:
    return _u32(reg).view(np.uint8).reshape(32, 4)


def _e4m3(byte_values: np.ndarray) -> np.ndarray:
    codes = torch.from_numpy(np.ascontiguousarray(byte_values, dtype=np.uint8))
    return codes.view(torch.float8_e4m3fn).double().numpy()


def prmt(a, b, selector):
    source = np.concatenate([_bytes(a), _bytes(b)], axis=1)
    picked = source[:, [(selector >> (4 * i)) & 7 for i in range(4)]]
    return np.ascontiguousarray(picked).view(np.uint32).reshape(32)


def mul_f16x2(a, b):
    return _from_halves(_halves(a) * _halves(b))  # the kernel's products are exact in FP16


def e4m3x2_to_f16x2(pair):
    return _from_halves(_e4m3(_bytes(pair)[:, :2]))


def f32x2_to_e4m3x2(lo, hi):
    codes = [torch.from_numpy(_f32(x)).to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)
             for x in (lo, hi)]
    return codes[0] | (codes[1] << 8)


def _mma(a_mat_of, b_mat_of, a, b, c, k):
    a_mat, b_mat = np.zeros((16, k)), np.zeros((k, 8))
    for lane, (g, t) in enumerate(zip(G, C)):
        a_mat_of(a_mat, [x[lane] for x in a], g, t)
        b_mat_of(b_mat, [x[lane] for x in b], g, t)
    d = a_mat @ b_mat
    return [_f32(_f32(c[i]).astype(np.float64) + d[G + 8 * (i // 2), 2 * C + i % 2]) for i in range(4)]


def mma_f16_m16n8k16(a, b, c):
    """A: reg r holds row g + 8 (r % 2), k 2t + 8 (r // 2) + {0, 1}; B: reg r holds k 2t + 8 r + {0, 1}, col g."""
    a, b = [_halves(x) for x in a], [_halves(x) for x in b]

    def a_of(mat, regs, g, t):
        for r in range(4):
            mat[g + 8 * (r % 2), 2 * t + 8 * (r // 2) + np.arange(2)] = regs[r]

    def b_of(mat, regs, g, t):
        for r in range(2):
            mat[2 * t + 8 * r + np.arange(2), g] = regs[r]

    return _mma(a_of, b_of, a, b, c, 16)


def mma_e4m3_m16n8k32(a, b, c):
    """A: reg r holds row g + 8 (r % 2), k 4t + 16 (r // 2) + byte; B: reg r holds k 4t + 16 r + byte, col g."""
    a, b = [_e4m3(_bytes(x)) for x in a], [_e4m3(_bytes(x)) for x in b]

    def a_of(mat, regs, g, t):
        for r in range(4):
            mat[g + 8 * (r % 2), 4 * t + 16 * (r // 2) + np.arange(4)] = regs[r]

    def b_of(mat, regs, g, t):
        for r in range(2):
            mat[4 * t + 16 * r + np.arange(4), g] = regs[r]

    return _mma(a_of, b_of, a, b, c, 32)


def shuffle_xor(x, mask):
    return _f32(x)[LANES ^ mask]


def shuffle_idx(x, lane):
    return _f32(x)[_u32(lane).astype(np.int64)]


def bits_to_f32(bits):
    return _u32(bits).view(np.float32)


def exp2_approx(x):
    return np.exp2(_f32(x))


def select_(condition, a, b):
    return np.where(np.broadcast_to(condition, (32,)), a, b)


@pytest.fixture
def numpy_warp(monkeypatch: pytest.MonkeyPatch):
    """Bind the emulated primitives in the modules whose functions the kernel traces."""
    shared = dict(Uint32=_u32, Float32=_f32, fmax=np.fmax)
    for name, value in {**shared, "shuffle_xor": shuffle_xor, "prmt": prmt, "mul_f16x2": mul_f16x2,
                        "e4m3x2_to_f16x2": e4m3x2_to_f16x2, "f32x2_to_e4m3x2": f32x2_to_e4m3x2,
                        "mma_f16_m16n8k16": mma_f16_m16n8k16,
                        "mma_e4m3_m16n8k32": mma_e4m3_m16n8k32}.items():
        monkeypatch.setattr(warp_mma, name, value)
    for name, value in {**shared, "shuffle_idx": shuffle_idx, "bits_to_f32": bits_to_f32,
                        "exp2_approx": exp2_approx, "select_": select_, "imin": np.minimum,
                        "imax": np.maximum}.items():
        monkeypatch.setattr(tile_math, name, value)


# --- what the kernel loads ----------------------------------------------------------------------------------------

def _gather_words(rows: np.ndarray, index, valid) -> list:
    """Lane-wise 16-byte chunks rows[index[lane], start[lane]:+16] -> 4 lane vectors of u32 (zeros where invalid)."""
    picked = np.where(valid[:, None], rows[np.where(valid, index[0], 0)[:, None], index[1][:, None] + np.arange(16)], 0)
    words = np.ascontiguousarray(picked.astype(np.uint8)).view(np.uint32)
    return [words[:, w].copy() for w in range(4)]


def _gather_pair(rows: np.ndarray, index, valid) -> np.ndarray:
    picked = np.where(valid[:, None], rows[np.where(valid, index[0], 0)[:, None], index[1][:, None] + np.arange(2)], 0)
    return (picked[:, 0].astype(np.uint32) | (picked[:, 1].astype(np.uint32) << 8))


def warp_forward(q, k, v, ds_bits, row0, q_len, kv_len, causal, lam):
    """One warp of the mma-sync kernel on one (sequence, head): q/k NVFP4 (codes, uint8 scales), v e4m3 bytes
    [kv_len, 128], ds_bits BF16 bits [kv_len] -> output rows row0..row0 + 15 [16, 128] (NaN where not written)."""
    q_codes, q_scales = q
    k_codes, k_scales = k
    num_tiles, limits, common = tile_math.warp_plan(row0, q_len, kv_len, G, causal=causal, tile_keys=TILE_KEYS,
                                                    warp_rows=WARP_ROWS)
    q_regs = []
    for r in range(2):
        row = row0 + G + 8 * r
        valid = row < q_len
        q_regs.append(warp_mma.q_chunk_regs(_gather_words(q_codes, (row, 16 * C), valid),
                                            _gather_pair(q_scales, (row, 2 * C), valid)))
    a_steps = tile_math.qk_a_steps(*q_regs)
    m_rows, l_rows = [_f32(-math.inf)] * 2, [_f32(0.0)] * 2
    acc = [_f32(0.0)] * tile_math.ACC_REGS
    assert np.all(num_tiles == num_tiles[0]) and np.ndim(common) == 0
    full_tiles = min(int(common) // TILE_KEYS, int(num_tiles[0]))
    # The kernel's two loops: the masked tiles (last first), then the tiles every row sees whole.
    plan = [(tile, True) for tile in range(int(num_tiles[0]) - 1, full_tiles - 1, -1)]
    plan += [(tile, False) for tile in range(full_tiles - 1, -1, -1)]
    assert [tile for tile, _ in plan] == list(range(int(num_tiles[0]) - 1, -1, -1))
    for tile_index, masked in plan:
        tile = tile_index * TILE_KEYS
        if not masked:  # the whole-tile path: every key exists and every row of the warp sees it
            assert tile + TILE_KEYS <= kv_len and all(np.all(limit >= tile + TILE_KEYS - 1) for limit in limits)
        fragments, ds = [], []
        for n_tile in range(TILE_KEYS // 8):
            key = tile + lay.qk_key(n_tile, G)
            fragments.append(warp_mma.k_fragments(_gather_words(k_codes, (key, 16 * C), key < kv_len),
                                                  _gather_pair(k_scales, (key, 2 * C), key < kv_len)))
        for n_tile in range(TILE_KEYS // 8):
            for half in range(2):
                key = tile + lay.score_key(n_tile, C, half)
                ds.append(np.where(key < kv_len, ds_bits[np.minimum(key, kv_len - 1)], 0).astype(np.uint32))
        seen = tuple(limit - tile - 2 * C for limit in limits) if masked else None
        scores = tile_math.qk_scores(a_steps, fragments, ds, seen)
        probs, alphas, m_rows, l_rows = tile_math.online_softmax(scores, m_rows, l_rows, _f32(lam * 2.0**7))
        acc = tile_math.rescale(acc, alphas, C)
        for pv in range(TILE_KEYS // 32):
            v_rows = []
            for k_half in range(2):
                for j in range(4):
                    key = tile + tile_math.pv_tile_key(pv, k_half, C, j)
                    v_rows.append(_gather_words(v, (key, 16 * G), key < kv_len))
            acc = tile_math.pv_step(acc, probs, warp_mma.transpose_v(v_rows), pv)
    out = np.full((WARP_ROWS, HEAD_DIM), np.nan)
    with np.errstate(divide="ignore"):
        rows = tile_math.output_rows(acc, l_rows, C)
    for nq, w, values in rows:
        for lane in LANES:
            if row0 + 8 * nq + 2 * C[lane] + w < q_len:
                out[8 * nq + 2 * C[lane] + w, 16 * G[lane] + np.arange(16)] = [x[lane] for x in values]
    return out


def _operands(gen: torch.Generator, q_len: int, kv_len: int):
    q = quantize_nvfp4(torch.randn(q_len, HEAD_DIM, generator=gen) * 2)
    k = quantize_nvfp4(torch.randn(kv_len, HEAD_DIM, generator=gen) * 3)
    v = (torch.randn(kv_len, HEAD_DIM, generator=gen) * 2).to(torch.float8_e4m3fn)
    ds = (torch.randn(kv_len, generator=gen) * 4).bfloat16()
    return q, k, v, ds


@pytest.mark.parametrize("q_len,kv_len,row0,causal", [
    (48, 111, 32, True),  # chunked prefill: the last 48 of 111 tokens, a ragged last tile
    (40, 40, 16, True),  # plain causal, rows past the sequence's end in the warp
    (32, 26, 0, True),  # q_len > kv_len: rows 0-5 see no key and give 0
    (16, 75, 0, False),  # non-causal
], ids=["chunked", "causal-tail-rows", "rows-without-keys", "non-causal"])
def test_warp_matches_reference_tile_loop(numpy_warp, q_len, kv_len, row0, causal):
    gen = torch.Generator().manual_seed(q_len * 1000 + kv_len)
    q, k, v, ds = _operands(gen, q_len, kv_len)
    lam = math.log2(math.e) / math.sqrt(HEAD_DIM)
    got = warp_forward((q.codes.numpy(), q.scales.view(torch.uint8).numpy()),
                       (k.codes.numpy(), k.scales.view(torch.uint8).numpy()), v.view(torch.uint8).numpy(),
                       ds.view(torch.int16).numpy().astype(np.uint16), row0, q_len, kv_len, causal, lam)

    rows = torch.arange(row0, min(row0 + WARP_ROWS, q_len))
    q_pos = rows + kv_len - q_len if causal else None
    m, l, acc = _kv_tiles(dequantize_nvfp4(q)[rows][None], dequantize_nvfp4(k)[None], v.float()[None],
                          ds.float()[None], q_pos, (0, kv_len), spec=VARIANTS["mpfa"], lam=lam, block_n=TILE_KEYS,
                          reverse=True)
    expected = torch.where((l > 0)[..., None], acc / torch.where(l > 0, l, 1)[..., None], 0)[0].double().numpy()

    written = got[:rows.numel()]
    assert np.isnan(got[rows.numel():]).all(), "rows past the sequence must not be written"
    assert np.isfinite(written).all()
    if causal and kv_len < q_len:
        assert (written[:q_len - kv_len] == 0).all() and (expected[:q_len - kv_len] == 0).all()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(written, expected, rtol=0, atol=2e-3 * scale)
    assert np.sqrt(np.mean((written - expected) ** 2)) <= 2e-4 * scale


@pytest.mark.parametrize("masked", [False, True], ids=["whole", "masked"])
def test_direct_scores_are_the_scores_of_a_zero_delta_s(numpy_warp, masked):
    """The direct build (``compensate=False``: no Delta_S, ``ds_bits`` None) starts the accumulators at 0, so its
    scores are bit for bit those of an all-zero Delta_S, masked scores -inf in both."""
    rng = np.random.default_rng(11)
    a_steps = [[_from_halves(rng.uniform(-2, 2, (32, 2))) for _ in range(4)] for _ in range(lay.K_STEPS_QK)]
    fragments = [warp_mma.k_fragments([rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
                                       for _ in range(4)],
                                      rng.integers(0x28, 0x48, 32).astype(np.uint32)
                                      | rng.integers(0x28, 0x48, 32).astype(np.uint32) << 8)
                 for _ in range(lay.N_TILES)]
    seen = (C + 3, C + 17) if masked else None
    zeros = [np.zeros(32, dtype=np.uint32)] * (2 * lay.N_TILES)
    direct = tile_math.qk_scores(a_steps, fragments, None, seen)
    compensated = tile_math.qk_scores(a_steps, fragments, zeros, seen)
    for n_tile in range(lay.N_TILES):
        for reg in range(4):
            assert np.array_equal(_f32(direct[n_tile][reg]).view(np.uint32),
                                  _f32(compensated[n_tile][reg]).view(np.uint32))
    values = np.stack([_f32(x) for n_tile in direct for x in n_tile])
    assert np.isinf(values).any() == masked and not np.isnan(values).any()


@pytest.mark.parametrize("exact_alpha", [False, True])
def test_p_scale_in_the_exponent(numpy_warp, exact_alpha):
    """``p_scale_log2`` (the wgmma kernels' e4m3(448 P) with the 448 in the exponent's bias): P and the row sums
    come out 448 x those of the plain softmax (to FP32 rounding of log2(448) and of the exponent's argument), the
    maxima and the alphas are the same values; a row that has seen no key still gets P = 0 and l = 0."""
    gen = np.random.default_rng(19)
    scores = [[_f32(gen.normal(0.0, 3.0, 32)) for _ in range(4)] for _ in range(8)]
    for half in range(2):  # row g = 0 of every lane quad sees no key of this tile
        for n_tile in range(8):
            scores[n_tile][half] = np.where(G == 0, -np.inf, scores[n_tile][half]).astype(np.float32)
    m_rows = [np.where(G == 0, -np.inf, _f32(1.5)).astype(np.float32), _f32(-0.5)]
    l_rows = [np.where(G == 0, 0.0, _f32(2.0)).astype(np.float32), _f32(3.0)]
    lam = _f32(math.log2(math.e) / math.sqrt(HEAD_DIM))
    plain = tile_math.online_softmax(scores, m_rows, l_rows, lam, exact_alpha=exact_alpha)
    scaled = tile_math.online_softmax(scores, m_rows, [x * np.float32(448) for x in l_rows], lam,
                                      exact_alpha=exact_alpha, p_scale_log2=math.log2(448))
    for n_tile in range(8):
        for i in range(4):
            np.testing.assert_allclose(scaled[0][n_tile][i], 448 * plain[0][n_tile][i], rtol=2e-6, atol=0)
    for r in range(2):
        np.testing.assert_array_equal(scaled[1][r], plain[1][r])  # alphas
        np.testing.assert_array_equal(scaled[2][r], plain[2][r])  # maxima
        np.testing.assert_allclose(scaled[3][r], 448 * plain[3][r], rtol=2e-6, atol=0)  # sums
    assert (plain[3][0][G == 0] == 0).all() and (scaled[3][0][G == 0] == 0).all()


@pytest.mark.parametrize("blocks", [1, 2, 8, 16])
def test_lane_row_maxima_is_the_rows_maximum(numpy_warp, blocks):
    """`lane_row_maxima` (4 chains joined by a tree) is each row's maximum over the lane's scores, -inf included,
    for the tiles' widths (1 .. 16 blocks of 8 keys: 2 .. 32 scores per row); the maximum of two parts' maxima is
    the whole's (the fp8 kernel's 128-key step takes its two tiles' apart); `online_softmax` given them returns what
    it computes."""
    gen = np.random.default_rng(blocks)
    scores = [[_f32(gen.normal(0.0, 4.0, 32)) for _ in range(4)] for _ in range(blocks)]
    scores[0][1] = np.where(G < 3, -np.inf, scores[0][1]).astype(np.float32)
    maxima = tile_math.lane_row_maxima(scores)
    for r in range(2):
        expected = np.max([scores[n][2 * r + half] for n in range(blocks) for half in range(2)], axis=0)
        np.testing.assert_array_equal(maxima[r], expected)
    if blocks > 1:
        split = blocks // 2
        parts = [tile_math.lane_row_maxima(scores[:split]), tile_math.lane_row_maxima(scores[split:])]
        for r in range(2):
            np.testing.assert_array_equal(np.fmax(parts[0][r], parts[1][r]), maxima[r])
    m_rows, l_rows, lam = [_f32(0.5), _f32(-1.0)], [_f32(1.0), _f32(2.0)], _f32(0.125)
    given = tile_math.online_softmax(scores, m_rows, l_rows, lam, lane_max=maxima)
    taken = tile_math.online_softmax(scores, m_rows, l_rows, lam)
    for r in range(2):
        np.testing.assert_array_equal(given[2][r], taken[2][r])
        np.testing.assert_array_equal(given[3][r], taken[3][r])
