"""The index mappings the wgmma prefill kernels assume (`prefill_wgmma`, `prefill_exact`), checked on the CPU against
CuTe's layouts of the same tiled MMAs (traced host-side, every thread of the warpgroup) and the PTX ISA's wgmma
fragment layouts:

* the F32 accumulator of ``m64nNk16`` (QK's S, PV's O): register ``4 j + 2 r + h`` of thread t (warp w, lane
  (g, c) = (lane / 4, lane % 4)) is row 16 w + g + 8 r, column 8 j + 2 c + h -- what the kernels assume when they
  initialise S with -inf of (head w, query g + 8 r, key 8 j + 2 c + h), run the online softmax on rows g, g + 8 (a
  row's 64 keys in the 4 lanes of one quad), rescale O by alpha of row g + 8 r and store O;
* the FP16 register A fragment of the exact kernel's PV wgmma: `p_operand`'s word ``r + 2 b + 4 k`` is the
  fragment's f16x2 holding A[row, key] for exactly the rows and keys whose P it packs;
* the shared-memory operands of the exact kernel: Q and K as K-major [row][dim] and V read transposed as MN-major
  V^T (dims contiguous) address element (row, dim) at the byte `operand_offset` wrote it, in the canonical
  128-byte-swizzle form wgmma's descriptor describes;
* the expansion's thread mappings (every element once, no bank conflict) and the two-warpgroup walk.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the wgmma ops check the target arch when they are built
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup  # noqa: E402

from mpfa.kernels.sm90 import prefill_exact as exact  # noqa: E402
from mpfa.kernels.sm90.dispatch import WGMMA_GROUPS  # noqa: E402
from mpfa.kernels.sm90 import prefill_staged_layout as sl  # noqa: E402
from mpfa.kernels.sm90 import prefill_wgmma as wgmma  # noqa: E402

THREADS = wgmma.THREADS
M = 64
TILE_KEYS, HEAD_DIM, N_BLOCKS, ROWS = wgmma.TILE_KEYS, exact.HEAD_DIM, wgmma.N_BLOCKS, wgmma.ROWS


def _mmas():
    """The exact kernel's two tiled MMAs (as `PrefillSm90Exact.kernel` builds them)."""
    mma_qk = sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K,
                                               OperandMajorMode.K, Float32, (1, 1, 1), (M, TILE_KEYS))
    mma_pv = sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K,
                                               OperandMajorMode.MN, Float32, (1, 1, 1), (M, HEAD_DIM),
                                               a_source=warpgroup.OperandSource.RMEM)
    return mma_qk, mma_pv


def _trace(fn):
    """Trace ``fn(found)`` host-side for sm_90a (the DSL reads the target arch when it is first set up, possibly
    before this module set CUTE_DSL_ARCH) and return what it recorded."""
    from cutlass.cutlass_dsl import BaseDSL

    found = {}

    @cute.jit
    def run():
        fn(found)

    envar = BaseDSL._get_dsl().envar
    arch, envar.arch = envar.arch, "sm_90a"
    try:
        run()
    finally:
        envar.arch = arch
    return found


def _ptx_acc(t: int, i: int) -> tuple:
    """PTX ISA, wgmma .m64nNk16 F32 accumulator (D) fragment: (row, column) of register i of thread t."""
    warp, lane = t // 32, t % 32
    g, c = lane // 4, lane % 4
    return 16 * warp + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * c + (i & 1)


def _ptx_a(t: int, i: int) -> tuple:
    """PTX ISA, wgmma .m64nNk16 .f16 A-from-registers fragment of one k-step: (row, k) of element i (a0..a7)."""
    warp, lane = t // 32, t % 32
    g, c = lane // 4, lane % 4
    return 16 * warp + g + 8 * ((i >> 1) & 1), 2 * c + (i & 1) + 8 * (i >> 2)


def _accumulators(found):
    mma_qk, mma_pv = _mmas()
    for name, mma, n in (("qk", mma_qk, TILE_KEYS), ("pv", mma_pv, HEAD_DIM)):
        coords = []
        for t in range(THREADS):
            thr = mma.get_slice(t)
            part = thr.partition_C(cute.make_identity_tensor((M, n)))
            frag = cute.make_rmem_tensor(thr.partition_shape_C((M, n)), Float32)  # the kernel's acc_s / acc_o
            assert cute.size(frag) == cute.size(part) == M * n // THREADS
            # register i of the kernel's fragment is value i of the partition (same shape, compact: checked below)
            assert str(frag.shape) == str(part.shape)
            coords.append([tuple(part[i]) for i in range(cute.size(part))])
            found.setdefault(name + "_frag_identity", []).append(
                all(frag.layout(i) == i for i in range(cute.size(frag))))
        found[name] = coords


@pytest.fixture(scope="module")
def accumulators():
    return _trace(_accumulators)


@pytest.mark.slow
def test_accumulator_fragment_is_ptx_layout(accumulators):
    """CuTe's C partition of both MMAs, and the register order of the kernel's ``make_rmem_tensor`` fragments, is
    the PTX accumulator layout: register 4 j + 2 r + h = row 16 w + g + 8 r, column 8 j + 2 c + h."""
    for name, n in (("qk", TILE_KEYS), ("pv", HEAD_DIM)):
        assert all(accumulators[name + "_frag_identity"])
        coords = accumulators[name]
        assert all(coords[t][i] == _ptx_acc(t, i) for t in range(THREADS) for i in range(M * n // THREADS))
        every = sorted(x for thread in coords for x in thread)
        assert every == [(r, col) for r in range(M) for col in range(n)]  # a partition of the tile


@pytest.mark.slow
def test_score_init_and_softmax_rows(accumulators):
    """(a) ``acc_s[4 block + i] = score_init(...)[i]``: score_init's value i is row g + 8 (i // 2), key
    8 block + 2c + i % 2 (masked iff the key is past ``limits[i // 2]``); M row 16 h + i is head h (= warp,
    ``head_in_cta``), query row i.
    (b) the online softmax treats scores[block][2 r + h] as row g + 8 r; its quad reductions (lanes 4 g .. 4 g + 3)
    see all 64 keys of the row and no other row's."""
    coords = accumulators["qk"]
    for t in range(THREADS):
        warp, lane = t // 32, t % 32
        g, c = lane // 4, lane % 4
        for block in range(N_BLOCKS):
            for i in range(4):
                r, half = i // 2, i % 2
                row, key = coords[t][4 * block + i]
                assert row // 16 == warp and row % 16 == g + 8 * r  # head = warp, query row g + 8 r
                half_stage, block_in_half = block // 4, block % 4
                assert key == 32 * half_stage + 8 * block_in_half + 2 * c + half
    for warp in range(4):
        for g in range(8):
            for r in range(2):
                keys = sorted(key for lane in range(4 * g, 4 * g + 4) for i in range(TILE_KEYS * M // THREADS)
                              for row, key in [coords[32 * warp + lane][i]]
                              if row == 16 * warp + g + 8 * r and (i >> 1) & 1 == r)
                assert keys == list(range(TILE_KEYS))


@pytest.mark.slow
def test_output_rescale_and_store(accumulators):
    """(c) O: ``acc_o[i] *= alphas[(i >> 1) & 1]`` rescales by the alpha of the register's row, and `_store_rows`
    writes ``acc_o[4 j + 2 r + {0, 1}]`` to row g + 8 r, dimensions 8 j + 2 c + {0, 1}."""
    coords = accumulators["pv"]
    for t in range(THREADS):
        warp, lane = t // 32, t % 32
        g, c = lane // 4, lane % 4
        for i in range(len(coords[t])):
            assert coords[t][i][0] == 16 * warp + g + 8 * ((i >> 1) & 1)
        for j in range(HEAD_DIM // 8):
            for r in range(2):
                for h in range(2):
                    assert coords[t][4 * j + 2 * r + h] == (16 * warp + g + 8 * r, 8 * j + 2 * c + h)


def _a_fragment(found):
    _, mma_pv = _mmas()
    for t in range(THREADS):
        thr = mma_pv.get_slice(t)
        part = thr.partition_A(cute.make_identity_tensor((M, TILE_KEYS)))
        frag = thr.make_fragment_A(thr.partition_shape_A((M, TILE_KEYS)))  # the kernel's t_p
        n = cute.size(frag)
        # element e of t_p (register order) -> (row, key) of A it holds: frag and part share the value shape
        found.setdefault("a", []).append([tuple(part[frag.layout.get_hier_coord(e)]) for e in range(n)])
        found.setdefault("k_steps", []).append(cute.size(frag.shape[2]))
        found.setdefault("shape", []).append(str(frag.shape))
        # per k-step: element i of frag[None, None, k] in PTX order a0..a7
        step = frag[None, None, 0]
        found.setdefault("step_order", []).append([step.layout(i) for i in range(cute.size(step))])


@pytest.fixture(scope="module")
def a_fragment():
    return _trace(_a_fragment)


@pytest.mark.slow
def test_register_a_fragment_is_ptx_layout(a_fragment):
    """CuTe's RS A fragment of the PV MMA (the kernel's ``t_p``): 4 k-steps of 8 FP16, element 8 k + i of thread
    t = PTX's a_i of k-step k: A[16 w + g + 8 ((i >> 1) & 1), 16 k + 2 c + (i & 1) + 8 (i >> 2)]."""
    assert set(a_fragment["k_steps"]) == {TILE_KEYS // 16}
    assert set(map(tuple, a_fragment["step_order"])) == {tuple(range(8))}
    for t in range(THREADS):
        for e, coord in enumerate(a_fragment["a"][t]):
            k, i = divmod(e, 8)
            row, col = _ptx_a(t, i)
            assert coord == (row, 16 * k + col), (t, e, coord)


@pytest.mark.slow
def test_p_operand_places_p_where_pv_reads_it(a_fragment, accumulators, monkeypatch):
    """`p_operand` on symbolic P: P of (row, key) -- at S accumulator register 4 block + i -- lands in the f16x2
    word of ``t_p`` (recast to 32 bits: elements 2 word, 2 word + 1) that the PV wgmma reads as A[row, key],
    A[row, key + 1], for every thread and k-step."""
    monkeypatch.setattr(exact, "f32x2_to_e4m3x2", lambda lo, hi: (lo, hi))
    monkeypatch.setattr(exact, "e4m3x2_to_f16x2", lambda pair: pair)
    s_coords = accumulators["qk"]
    for t in range(THREADS):
        probs = [[s_coords[t][4 * block + i] for i in range(4)] for block in range(N_BLOCKS)]
        words = {}
        exact.p_operand(probs, words)
        a = a_fragment["a"][t]
        assert sorted(words) == list(range(len(a) // 2))
        for word, (lo, hi) in words.items():
            assert (lo, hi) == (a[2 * word], a[2 * word + 1]), (t, word)


def _operands(found):
    layout = exact.operand_layout()
    found["swizzle"] = str(layout.inner)
    found["outer"] = str(layout.outer)
    # the kernel's V^T view: (dim, key) -> V's (key, dim)
    vt = cute.composition(layout.outer, cute.make_ordered_layout((HEAD_DIM, TILE_KEYS), order=(1, 0)))
    found["vt"] = str(vt)
    found["q"] = [[layout.outer((row, dim)) for dim in range(HEAD_DIM)] for row in range(TILE_KEYS)]
    found["v"] = [[vt((dim, key)) for dim in range(HEAD_DIM)] for key in range(TILE_KEYS)]
    mma_qk, mma_pv = _mmas()
    found["majors"] = (str(mma_qk.op.a_major_mode), str(mma_qk.op.b_major_mode), str(mma_pv.op.b_major_mode))


@pytest.fixture(scope="module")
def operands():
    return _trace(_operands)


def _swizzled_bytes(element_offset: int) -> int:
    """Swizzle<3,4,3> on byte offsets: bits 4-6 ^= bits 7-9 (the 128-byte swizzle of wgmma)."""
    b = 2 * element_offset
    return b ^ (((b >> 7) & 7) << 4)


def _written(row: int, col: int) -> int:
    """Byte where `operand_offset` / `_store_chunk` put element ``col`` of ``row`` (8 FP16 per 16-byte chunk)."""
    return exact.operand_offset(row, col // 8) + 2 * (col % 8)


@pytest.mark.slow
def test_q_and_k_are_k_major_at_operand_offset(operands):
    """QK's A (Q [16 h + i][dim]) and B (K [key][dim]) operands: the K-major tile element (row, dim) is the byte
    the expansion wrote it at, in the canonical K-major SW128 form (8-row x 128-byte atoms: SBO 1024 bytes, second
    64-dim half 8 KB on)."""
    assert operands["swizzle"] == "S<3,4,3>"
    assert operands["outer"] == "((8,8),(64,2)):((64,512),(1,4096))"
    assert all(_swizzled_bytes(operands["q"][row][dim]) == _written(row, dim)
               for row in range(TILE_KEYS) for dim in range(HEAD_DIM))
    assert "K" in operands["majors"][0] and "K" in operands["majors"][1]


@pytest.mark.slow
def test_v_transposed_is_mn_major_at_operand_offset(operands):
    """PV's B operand V^T (n = dim, k = key), read MN-major (``tnspB``): element (dim, key) is the byte where the V
    expansion wrote V[key][dim]; the view is the canonical MN-major SW128 form (64 contiguous dims x 8 keys atoms:
    keys 8 apart 1024 bytes, the second 64-dim half 8 KB on)."""
    assert operands["vt"] == "((64,2),64):((1,4096),64)"  # keys: (8,8):(64,512), coalesced
    assert all(_swizzled_bytes(operands["v"][key][dim]) == _written(key, dim)
               for key in range(TILE_KEYS) for dim in range(HEAD_DIM))
    assert "MN" in operands["majors"][2]


def test_expand_kv_writes_every_element_once():
    """`_expand_kv`'s stores cover the K and V tiles once, the two warpgroups sharing the work (per thread 1 K chunk
    and 2 V pieces): K (`k_expand_unit`) chunks ``4 chunk + quad`` of key ``32 half + key``, in the half
    `warpgroup_half` gives the warpgroup (the half it copies, too); V (`v_expand_unit`) chunks ``2 piece + quad`` of
    key ``32 half + key``. `_expand_q` (each warpgroup its own tile): Q chunks ``4 (unit & 3) + quad`` of row
    ``unit / 4``."""
    warpgroups = wgmma.WARPGROUPS
    threads = THREADS * warpgroups
    k, v = [], []
    for tid in range(threads):
        wg, wg_tid = tid // THREADS, tid % THREADS
        for r in range(2 // warpgroups):
            half, key, chunk = exact.k_expand_unit(wg, wg_tid, r, warpgroups)
            assert half == wg == wgmma.warpgroup_half(wg, r, warpgroups)  # warpgroup w: half w
            k += [(32 * half + key, 4 * chunk + quad) for quad in range(4)]
        for r in range(exact.V_UNITS // threads):
            half, key, piece = exact.v_expand_unit(tid, r, threads)
            assert half in (0, 1) and 0 <= key < 32
            v += [(32 * half + key, 2 * piece + quad) for quad in range(2)]
    q = sorted(((tid + THREADS * r) >> 2, 4 * ((tid + THREADS * r) & 3) + quad) for r in range(2)
               for tid in range(THREADS) for quad in range(4))
    every = [(row, chunk) for row in range(TILE_KEYS) for chunk in range(HEAD_DIM // 8)]
    assert sorted(k) == sorted(v) == q == every
    assert len(k) == len(v) == len(every)  # once each
    assert sorted(exact.operand_offset(row, chunk) for row, chunk in every) == list(range(0, exact.OPERAND_BYTES, 16))


def _wavefronts(addresses: list[int]) -> int:
    """Shared-memory wavefronts of one 16-byte-per-lane access of a quarter-warp (8 lanes): the most distinct
    addresses that fall in one of the 8 16-byte bank groups."""
    groups: dict[int, set] = {}
    for address in addresses:
        groups.setdefault((address // 16) % 8, set()).add(address)
    return max(len(found) for found in groups.values())


@pytest.mark.parametrize("warpgroups", [1, 2], ids=["fp8-operand-pass", "exact"])
def test_expansion_is_bank_conflict_free(warpgroups):
    """Every 16-byte load and store of the K and V expansions is one wavefront per quarter-warp: K reads its chunk
    at ``64 key + 16 chunk`` of the ring half and stores units ``4 chunk + quad`` (the exact kernel's FP16,
    `operand_offset`, 2 warpgroups) or ``2 chunk + unit`` (the fp8 operand pass's e4m3, `fp8_operand_offset`, 1
    warpgroup) of row ``32 half + key``; V (the exact kernel's) reads piece ``piece ^ v_swizzle(key)`` of its
    128-byte row and stores units ``2 piece + quad``."""
    from mpfa.kernels.sm90 import prefill_fp8_layout as fp8

    threads = THREADS * warpgroups
    k_unit, store, units_per_chunk = ((exact.k_expand_unit, exact.operand_offset, 4) if warpgroups == 2 else
                                      (fp8.k_expand_unit, fp8.fp8_operand_offset, 2))
    for first in range(0, threads, 8):
        lanes = range(first, first + 8)
        for r in range(2 // warpgroups):
            units = [k_unit(t // THREADS, t % THREADS, r, warpgroups) for t in lanes]
            assert _wavefronts([sl.K_OFFSET + sl.K_ROW_BYTES * key + 16 * chunk for _, key, chunk in units]) == 1
            for unit in range(units_per_chunk):
                assert _wavefronts([store(32 * half + key, units_per_chunk * chunk + unit)
                                    for half, key, chunk in units]) == 1
        if warpgroups == 1:
            continue
        for r in range(exact.V_UNITS // threads):
            units = [exact.v_expand_unit(t, r, threads) for t in lanes]
            assert _wavefronts([sl.V_OFFSET + sl.V_ROW_BYTES * key + 16 * (piece ^ sl.v_swizzle(key))
                                for _, key, piece in units]) == 1
            for quad in range(2):
                assert _wavefronts([exact.operand_offset(32 * half + key, 2 * piece + quad)
                                    for half, key, piece in units]) == 1


def test_shared_memory_offsets():
    """Q of warpgroup 0, Q of warpgroup 1, K, V, ring; every operand tile 1024-byte aligned (the 128-byte swizzle's
    repeat, base offset 0 in the descriptors)."""
    assert exact.smem_offsets() == (0, 32768, 49152, 65536)
    assert all(offset % wgmma.OPERAND_ALIGN == 0 for offset in exact.smem_offsets())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_each_warpgroup_walks_its_own_rows_tiles(monkeypatch: pytest.MonkeyPatch, causal):
    """A model of the exact kernel's tile loop (`PrefillSm90Exact._run_tiles` / `_step`): the two-warpgroup CTA
    walks the tiles of its last row and masks the tiles its first row does not see whole; warpgroup w, with its own
    rows' plan (`prefill_tile.warp_plan` over 16 rows), skips a masked tile past all its rows. Then every warpgroup
    whose rows start inside the sequence computes exactly the tiles a CTA of its rows alone would walk, in the same
    order, with the same visible scores (a tile taken whole alone and masked here has every score visible): the
    same arithmetic as walking its rows alone."""
    from mpfa.kernels.sm90 import prefill_tile as tile_math

    for name, value in {"imin": min, "imax": max, "select_": lambda c, a, b: a if c else b}.items():
        monkeypatch.setattr(tile_math, name, value)
    keys = TILE_KEYS

    def plan(row0, q_len, kv_len, g, rows):
        return tile_math.warp_plan(row0, q_len, kv_len, g, causal=causal, tile_keys=keys, warp_rows=rows)

    def visible(row0, q_len, kv_len, tile, masked):
        """The (row, key) scores of the tile that start at Delta_S (not -inf): `score_init` on `limits`."""
        seen = set()
        for g in range(8):
            limits = plan(row0, q_len, kv_len, g, ROWS)[1]
            for r in range(2):
                for c in range(4):
                    for block in range(N_BLOCKS):
                        for half in range(2):
                            key = 8 * block + 2 * c + half
                            if not masked or limits[r] - tile * keys - 2 * c >= 8 * block + half:
                                seen.add((g + 8 * r, key))
        return frozenset(seen)

    def walk(cta_row0, block_m, row0, q_len, kv_len):
        """[(tile, visible scores)] the warpgroup of rows row0 .. row0 + 15 computes in a CTA of block_m rows."""
        cta_tiles, _, cta_common = plan(cta_row0, q_len, kv_len, 0, block_m)
        own_tiles = plan(row0, q_len, kv_len, 0, ROWS)[0]
        masked_tiles = cta_tiles - min(cta_common // keys, cta_tiles)
        steps = []
        for step in range(cta_tiles):
            tile, _, _ = sl.ring_compute(step, cta_tiles, exact.STAGES)
            masked = step < masked_tiles
            if block_m > ROWS and masked and tile >= own_tiles:
                continue  # `_step`: no row of this warpgroup sees the tile
            steps.append((tile, visible(row0, q_len, kv_len, tile, masked)))
        return steps

    skipped = 0
    for q_len in [1, 15, 16, 17, 31, 32, 33, 40, 48, 63, 64, 95, 130]:
        for kv_len in (q_len, q_len + 7, q_len + 20, q_len + 40, q_len + 100):
            for cta_row0 in range(0, q_len, 2 * ROWS):
                for wg in range(2):
                    row0 = cta_row0 + ROWS * wg
                    if row0 >= q_len:
                        continue  # no row stored
                    both = walk(cta_row0, 2 * ROWS, row0, q_len, kv_len)
                    assert both == walk(row0, ROWS, row0, q_len, kv_len), (q_len, kv_len, row0)
                    skipped += len(both) < plan(cta_row0, q_len, kv_len, 0, 2 * ROWS)[0]
    assert skipped > 0 if causal else skipped == 0  # the skip is exercised (causal only)


@pytest.mark.parametrize("group", WGMMA_GROUPS)
def test_tile_rows_are_the_4_warp_ctas_warps(group):
    """A 64-row wgmma tile's rows (`tile_row_query`) cover each (query row, head) of the warpgroup once, and row
    16 w + i is warp w's row i in the 4-warp CTA (head ``w % heads``, rows from ``16 (w // heads)``)."""
    heads = sl.cta_shape(group)[0]
    coords = [wgmma.tile_row_query(row, heads) for row in range(64)]
    assert sorted(coords) == [(q, h) for q in range(sl.warpgroup_rows(group)) for h in range(heads)]
    for row, (query, head) in enumerate(coords):
        warp = row // 16
        assert (head, query - row % 16) == (warp % heads, 16 * (warp // heads))


@pytest.mark.parametrize("group", WGMMA_GROUPS)
def test_each_row_weights_its_own_heads_delta_s(group):
    """The Delta_S k-step at every GQA group: a CTA's ring holds per key the `prefill_staged_layout.ds_words` 4-byte
    words of the cache's Delta_S row from the word holding its first head (`PrefillSm90Base._cache_sources`, the
    head's index in the group), `_widen_ds` widens BF16 j of them into column j of the Delta_S tile (``ds_columns``
    columns, the rest 0), and a tile row's one-hot column (`_init_ds_column_tiles`: `ds_first_column` + the row's
    head in the CTA, `tile_row_query`) is its own query head's entry of the row, never a neighbour's or padding."""
    heads = sl.cta_shape(group)[0]
    launcher = exact.PrefillSm90Exact(8, group, 128, True)
    assert launcher.ds_columns == 2 * sl.ds_words(heads) <= exact.DS_COLUMNS
    for block_head in range(8 * group // heads):
        first_head = block_head * heads
        kv_head = first_head // group
        in_group = first_head - kv_head * group  # `_cache_sources`' group_first
        lead = exact.ds_first_column(heads, group, first_head)
        for row in range(M):
            _, head_in_cta = wgmma.tile_row_query(row, heads)
            column = lead + head_in_cta
            assert column < launcher.ds_columns
            entry = 2 * sl.ds_first_word(in_group) + column  # BF16 entry of the cache's Delta_S row
            assert entry == in_group + head_in_cta < group and (first_head + head_in_cta) // group == kv_head


def test_operand_offset_is_cutes_layout():
    """`operand_offset` (where the expansion stores a 16-byte chunk) is CuTe's swizzled wgmma layout of the tile:
    the layout's element offset, in bytes, with the 128-byte swizzle (bits 4-6 ^= bits 7-9) applied."""
    def fn(found):
        layout = exact.operand_layout()
        found["inner"] = str(layout.inner)
        found["ok"] = [_swizzled_bytes(layout.outer((row, 8 * chunk))) == exact.operand_offset(row, chunk)
                       for row in range(TILE_KEYS) for chunk in range(HEAD_DIM // 8)]
    found = _trace(fn)
    assert found["inner"] == "S<3,4,3>" and len(found["ok"]) == TILE_KEYS * HEAD_DIM // 8 and all(found["ok"])
