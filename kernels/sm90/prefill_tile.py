"""The register math of one prefill warp on one KV tile, as plain functions of the warp's registers.

The mma-sync kernel (`prefill_mma_sync`) traces these inline (loads, addresses and the tile loop stay in the
kernel), the wgmma kernels their walk, masking and online softmax; the CPU tests run the very same functions on a
NumPy model of the warp (every register a vector over the 32 lanes, the PTX primitives emulated), so the fragment
bookkeeping is checked without a GPU. Only the primitives bound at module level here and in `warp_mma` may be
used (the model replaces them); loops are Python loops (unrolled).

A warp owns 16 query rows; lane (g, c) works on rows g and g + 8 (index r = 0, 1):

* scores[n][2 r + half]: S * 2**-7 of row g + 8 r at key 8 n + 2c + half (``score_key``);
* acc[acc_index(nq, m_tile, i)]: O^T of query row 8 nq + 2c + i % 2, dimension ``o_dim(m_tile, g, i // 2)``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

from . import decode_layout as lay
from .ptx import bits_to_f32, exp2_approx, shuffle_idx
from .warp_mma import P_SCALE, p_fragment, p_pair, pv_mtile, qk_ntile, quad_max, quad_sum

select_ = cutlass.select_
fmax = cute.arch.fmax
imin = cutlass.min
imax = cutlass.max

ACC_REGS = 2 * lay.M_TILES * 4  # O^T registers of a lane: 2 query n-tiles x 8 dimension m-tiles x 4


def acc_index(nq, m_tile, i):
    """O^T register of query n-tile ``nq`` (rows 8 nq..8 nq + 7), dimension m-tile ``m_tile``, C register ``i``."""
    return 4 * (lay.M_TILES * nq + m_tile) + i


def pv_tile_key(step, k_half, c, j):
    """Key (within the tile) at P^T k-index ``16 k_half + 4c + j`` of 32-key PV step ``step``."""
    return 32 * step + lay.pv_key(k_half, c, j)


def warp_plan(row0, q_len, kv_len, g, *, causal: bool, tile_keys: int, warp_rows: int) -> tuple:
    """(number of key tiles the warp's rows row0..row0 + warp_rows - 1 see, (last key row g sees, last key row
    g + 8 sees), number of leading keys every row of the warp sees). Query i sees keys 0 .. i + kv_len - q_len
    (bottom-right aligned causal mask) or all kv_len keys; a warp past the sequence's queries gets no tiles."""
    last_key = kv_len - 1
    limits = (kv_len - 1, kv_len - 1)
    common = kv_len
    if causal:
        last_key = imin(imin(row0 + warp_rows - 1, q_len - 1) + kv_len - q_len, kv_len - 1)
        limits = tuple(imin(row0 + g + 8 * r + kv_len - q_len, kv_len - 1) for r in range(2))
        common = imax(imin(row0 + kv_len - q_len, kv_len - 1) + 1, 0)
    tiles = (imax(last_key + 1, 0) + tile_keys - 1) // tile_keys
    return select_(row0 < q_len, tiles, 0 * tiles), limits, common


def masked_and_whole(tiles, common, tile_keys: int) -> tuple:
    """(tiles holding a masked score, whole tiles) of a walk of ``tiles`` key tiles, last tile first, whose leading
    ``common`` keys every row sees: the masked tiles come first in the walk."""
    whole = imin(common // tile_keys, tiles)
    return tiles - whole, whole


def qk_a_steps(q_lo: list, q_hi: list) -> list:
    """A registers of the 8 QK k-steps from the f16x2 chunks of rows g (a0, a2) and g + 8 (a1, a3)."""
    return [[q_lo[r0], q_hi[r0], q_lo[r1], q_hi[r1]]
            for r0, r1 in (lay.qk_step_regs(k_step) for k_step in range(lay.K_STEPS_QK))]


def qk_scores(a_steps: list, fragments: list, ds_bits: list | None, seen: tuple | None) -> list:
    """S * 2**-7 of the tile. ``fragments[n]``: the B registers of n-tile n (chunk c of key 8 n + g,
    `warp_mma.k_fragments`); ``ds_bits[2 n + half]`` the BF16 Delta_S of key 8 n + 2c + half (None: no
    compensation, the direct build); ``seen[r]``: row g + 8 r sees the key 8 n + 2c + half of this tile iff
    8 n + half <= seen[r] (None: every row sees every key of the tile). Delta_S, or -inf for a masked score, is the
    accumulator's initial value."""
    return [qk_ntile(a_steps, fragments[n_tile], score_init(ds_bits, seen, n_tile))
            for n_tile in range(len(fragments))]


def score_init(ds_bits: list | None, seen: tuple | None, n_tile: int,
               scale_log2: int = lay.SCORE_SCALE_LOG2) -> list:
    """The initial accumulators of n-tile ``n_tile`` (rows g, g + 8 x keys 8 n + 2c, + 1, as `qk_scores`' S):
    Delta_S * 2**-7 (2**-``scale_log2``; 0: Delta_S itself, no multiply), or -inf where ``seen`` masks the score.
    ``ds_bits`` None (the direct build, no compensation): 0, exactly the value of an all-zero Delta_S."""
    init = []
    for r in range(2):
        for half in range(2):
            if ds_bits is None:
                ds = Float32(0.0)
            else:
                ds = bits_to_f32(ds_bits[2 * n_tile + half] << 16)
                if scale_log2:
                    ds = ds * Float32(2.0 ** -scale_log2)
            init.append(ds if seen is None else Float32(select_(seen[r] >= 8 * n_tile + half, ds,
                                                                Float32(-math.inf))))
    return init


MAX_CHAINS = 4  # a row's lane maximum as 4 interleaved chains: 32 scores take a chain of 7 + 2 FMNMX, not 31


def lane_row_maxima(scores: list) -> list:
    """Rows g, g + 8's maxima over this lane's ``scores``: `MAX_CHAINS` interleaved chains joined by a tree. The
    maximum is exact in any order, so this is one chain's value with a shorter dependency chain on the softmax's
    critical path (the exponents wait for it)."""
    maxima = []
    for r in range(2):
        values = [scores[n_tile][2 * r + half] for n_tile in range(len(scores)) for half in range(2)]
        chains = values[:MAX_CHAINS]
        for i, value in enumerate(values[MAX_CHAINS:]):
            chains[i % MAX_CHAINS] = fmax(chains[i % MAX_CHAINS], value)
        while len(chains) > 1:
            chains = [fmax(chains[i], chains[i + 1]) if i + 1 < len(chains) else chains[i]
                      for i in range(0, len(chains), 2)]
        maxima.append(chains[0])
    return maxima


def online_softmax(scores: list, m_rows: list, l_rows: list, lam_scaled: Float32, exp2=None,
                   exact_alpha: bool = False, p_scale_log2: float = 0.0, lane_max: list | None = None) -> tuple:
    """Rows g, g + 8: m_new = max(m, rowmax S), P = exp2(lam S - lam m_new), alpha = exp2(lam m - lam m_new),
    l = alpha l + (this lane's part of) rowsum P. A row that has seen no key keeps m = -inf and gets P = 0 and
    alpha = 0 (the reference's m_ref = 0). ``exact_alpha``: alpha is exactly 1 where the row's maximum stays (as
    in the reference; the compiler otherwise fuses lam m - lam m_new into an FFMA that leaves a rounding residue),
    and 1 for a row that has seen no key (its O and l are 0): what lets a warp skip rescaling O (the wgmma kernels;
    the mma-sync kernel has no registers left for the select). -> (P in the scores' layout, alphas, new m rows,
    new l rows). ``exp2``: replaces `exp2_approx` (only for the timing ablations of `ablation`). ``p_scale_log2``:
    P and l come out times 2**p_scale_log2 (one subtraction per row from the exponent's bias, instead of a multiply
    per P: the wgmma kernels' e4m3(448 P) with log2(448)); alpha is unchanged. ``lane_max``: `lane_row_maxima` of
    ``scores``, where the caller took them already (the fp8 kernel's 128-key step takes its first tile's while the
    second's wgmma runs)."""
    exp2 = exp2_approx if exp2 is None else exp2
    probs = [[None] * 4 for _ in scores]
    alphas, m_new_rows, l_new_rows = [], [], []
    lane_max = lane_row_maxima(scores) if lane_max is None else lane_max
    for r in range(2):
        tile_max = quad_max(lane_max[r])
        m_new = fmax(m_rows[r], tile_max)
        m_lam = Float32(select_(m_new == -math.inf, Float32(0.0), m_new * lam_scaled))
        p_bias = m_lam
        if p_scale_log2:
            p_bias = Float32(select_(m_new == -math.inf, Float32(-p_scale_log2),
                                     m_new * lam_scaled - Float32(p_scale_log2)))
        row_sum = Float32(0.0)
        for n_tile in range(len(scores)):
            for half in range(2):
                p = exp2(scores[n_tile][2 * r + half] * lam_scaled - p_bias)
                probs[n_tile][2 * r + half] = p
                row_sum = row_sum + p
        alpha = exp2(m_rows[r] * lam_scaled - m_lam)
        if exact_alpha:
            alpha = Float32(select_(m_new == m_rows[r], Float32(1.0), alpha))
        alphas.append(alpha)
        m_new_rows.append(m_new)
        l_new_rows.append(alpha * l_rows[r] + row_sum)
    return probs, alphas, m_new_rows, l_new_rows


def rescale(acc: list, alphas: list, c) -> list:
    """acc * alpha of its query row: row 8 nq + 2c + w's alpha is held by lane 8c + 4w (row g = 2c + w)."""
    alpha_rows = [shuffle_idx(alphas[nq], Uint32(8 * c + 4 * w)) for nq in range(2) for w in range(2)]
    return [acc[acc_index(nq, m_tile, i)] * alpha_rows[2 * nq + i % 2]
            for nq in range(2) for m_tile in range(lay.M_TILES) for i in range(4)]


def pv_step(acc: list, probs: list, transposed: list, step: int) -> list:
    """acc += V^T e4m3(448 P)^T over 32-key step ``step`` (n-tiles 4 step..4 step + 3); ``transposed``: the step's V
    chunks through `transpose_v`. Query n-tile nq takes P of row g + 8 nq."""
    acc = list(acc)
    for nq in range(2):
        p_regs = p_fragment([p_pair(probs[4 * step + n][2 * nq], probs[4 * step + n][2 * nq + 1]) for n in range(4)])
        for m_tile in range(lay.M_TILES):
            c_regs = pv_mtile(transposed, p_regs, m_tile, [acc[acc_index(nq, m_tile, i)] for i in range(4)])
            for i in range(4):
                acc[acc_index(nq, m_tile, i)] = c_regs[i]
    return acc


def output_rows(acc: list, l_rows: list, c) -> list:
    """[(nq, w, values)]: O = acc / (448 l) of query row 8 nq + 2c + w at dimensions 16g + 0..15 (in order); 0
    for a row that saw no key (l = 0)."""
    sums = [quad_sum(l_rows[0]), quad_sum(l_rows[1])]
    rows = []
    for nq in range(2):
        for w in range(2):
            l_row = shuffle_idx(sums[nq], Uint32(8 * c + 4 * w))
            inv = Float32(select_(l_row > Float32(0.0), Float32(1.0) / (l_row * Float32(P_SCALE)), Float32(0.0)))
            rows.append((nq, w, [acc[acc_index(nq, m_tile, w + 2 * upper)] * inv
                                 for m_tile in range(lay.M_TILES) for upper in range(2)]))
    return rows
