"""The index mappings the wgmma prefill (v3, `prefill_wgmma`) assumes, checked on the CPU against CuTe's layouts of
the same tiled MMAs (traced host-side, every thread of the warpgroup) and the PTX ISA's wgmma fragment layouts:

* the F32 accumulator of ``m64nNk16`` (QK's S, PV's O): register ``4 j + 2 r + h`` of thread t (warp w, lane
  (g, c) = (lane / 4, lane % 4)) is row 16 w + g + 8 r, column 8 j + 2 c + h -- what the kernel assumes when it
  initialises S with Delta_S / -inf of (head w, query g + 8 r, key 8 j + 2 c + h), runs v1's online softmax on rows
  g, g + 8 (a row's 64 keys in the 4 lanes of one quad), rescales O by alpha of row g + 8 r and stores O;
* the FP16 register A fragment of the PV wgmma: `p_operand`'s word ``v1 + 2 v2 + 4 k`` is the fragment's f16x2
  holding A[row, key] for exactly the rows and keys whose P it packs;
* the shared-memory operands: Q and K as K-major [row][dim] and V read transposed as MN-major V^T (dims contiguous)
  address element (row, dim) at the byte `operand_offset` wrote it, in the canonical 128-byte-swizzle form wgmma's
  descriptor describes.
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

from mpfa.kernels.sm90 import prefill_staged_layout as sl  # noqa: E402
from mpfa.kernels.sm90 import prefill_wgmma as v3  # noqa: E402

THREADS = v3.THREADS
M = 64


def _mmas():
    """The kernel's two tiled MMAs (as `PrefillSm90Wgmma.kernel` builds them)."""
    mma_qk = sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K,
                                               OperandMajorMode.K, Float32, (1, 1, 1), (M, v3.TILE_KEYS))
    mma_pv = sm90_utils.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K,
                                               OperandMajorMode.MN, Float32, (1, 1, 1), (M, v3.HEAD_DIM),
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
    for name, mma, n in (("qk", mma_qk, v3.TILE_KEYS), ("pv", mma_pv, v3.HEAD_DIM)):
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


def test_accumulator_fragment_is_ptx_layout(accumulators):
    """CuTe's C partition of both MMAs, and the register order of the kernel's ``make_rmem_tensor`` fragments, is
    the PTX accumulator layout: register 4 j + 2 r + h = row 16 w + g + 8 r, column 8 j + 2 c + h."""
    for name, n in (("qk", v3.TILE_KEYS), ("pv", v3.HEAD_DIM)):
        assert all(accumulators[name + "_frag_identity"])
        coords = accumulators[name]
        assert all(coords[t][i] == _ptx_acc(t, i) for t in range(THREADS) for i in range(M * n // THREADS))
        every = sorted(x for thread in coords for x in thread)
        assert every == [(r, col) for r in range(M) for col in range(n)]  # a partition of the tile


def test_score_init_and_softmax_rows(accumulators):
    """(a) ``acc_s[4 block + i] = score_init(...)[i]``: score_init's value i is row g + 8 (i // 2), key
    8 block + 2c + i % 2 (Delta_S of that key, ``ds_read(block % 4, i % 2)`` in 32-key half ``block // 4``, masked
    iff the key is past ``limits[i // 2]``); M row 16 h + i is head h (= warp, ``head_in_cta``), query row i.
    (b) v1's online softmax treats scores[block][2 r + h] as row g + 8 r; its quad reductions (lanes 4 g .. 4 g + 3)
    see all 64 keys of the row and no other row's."""
    coords = accumulators["qk"]
    for t in range(THREADS):
        warp, lane = t // 32, t % 32
        g, c = lane // 4, lane % 4
        for block in range(v3.N_BLOCKS):
            for i in range(4):
                r, half = i // 2, i % 2
                row, key = coords[t][4 * block + i]
                assert row // 16 == warp and row % 16 == g + 8 * r  # head = warp, query row g + 8 r
                half_stage, block_in_half = block // 4, block % 4
                assert key == 32 * half_stage + 8 * block_in_half + 2 * c + half
    for warp in range(4):
        for g in range(8):
            for r in range(2):
                keys = sorted(key for lane in range(4 * g, 4 * g + 4) for i in range(v3.TILE_KEYS * M // THREADS)
                              for row, key in [coords[32 * warp + lane][i]]
                              if row == 16 * warp + g + 8 * r and (i >> 1) & 1 == r)
                assert keys == list(range(v3.TILE_KEYS))


def test_output_rescale_and_store(accumulators):
    """(c) O: ``acc_o[i] *= alphas[(i >> 1) & 1]`` rescales by the alpha of the register's row, and `_store_rows`
    writes ``acc_o[4 j + 2 r + {0, 1}]`` to row g + 8 r, dimensions 8 j + 2 c + {0, 1}."""
    coords = accumulators["pv"]
    for t in range(THREADS):
        warp, lane = t // 32, t % 32
        g, c = lane // 4, lane % 4
        for i in range(len(coords[t])):
            assert coords[t][i][0] == 16 * warp + g + 8 * ((i >> 1) & 1)
        for j in range(v3.HEAD_DIM // 8):
            for r in range(2):
                for h in range(2):
                    assert coords[t][4 * j + 2 * r + h] == (16 * warp + g + 8 * r, 8 * j + 2 * c + h)


def _a_fragment(found):
    _, mma_pv = _mmas()
    for t in range(THREADS):
        thr = mma_pv.get_slice(t)
        part = thr.partition_A(cute.make_identity_tensor((M, v3.TILE_KEYS)))
        frag = thr.make_fragment_A(thr.partition_shape_A((M, v3.TILE_KEYS)))  # the kernel's t_p
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


def test_register_a_fragment_is_ptx_layout(a_fragment):
    """CuTe's RS A fragment of the PV MMA (the kernel's ``t_p``): 4 k-steps of 8 FP16, element 8 k + i of thread
    t = PTX's a_i of k-step k: A[16 w + g + 8 ((i >> 1) & 1), 16 k + 2 c + (i & 1) + 8 (i >> 2)]."""
    assert set(a_fragment["k_steps"]) == {v3.TILE_KEYS // 16}
    assert set(map(tuple, a_fragment["step_order"])) == {tuple(range(8))}
    for t in range(THREADS):
        for e, coord in enumerate(a_fragment["a"][t]):
            k, i = divmod(e, 8)
            row, col = _ptx_a(t, i)
            assert coord == (row, 16 * k + col), (t, e, coord)


def test_p_operand_places_p_where_pv_reads_it(a_fragment, accumulators, monkeypatch):
    """`p_operand` on symbolic P: P of (row, key) -- at S accumulator register 4 block + i -- lands in the f16x2
    word of ``t_p`` (recast to 32 bits: elements 2 word, 2 word + 1) that the PV wgmma reads as A[row, key],
    A[row, key + 1], for every thread and k-step."""
    monkeypatch.setattr(v3, "p_pair", lambda lo, hi: (lo, hi))
    monkeypatch.setattr(v3, "e4m3x2_to_f16x2", lambda pair: pair)
    s_coords = accumulators["qk"]
    for t in range(THREADS):
        probs = [[s_coords[t][4 * block + i] for i in range(4)] for block in range(v3.N_BLOCKS)]
        words = {}
        v3.p_operand(probs, words)
        a = a_fragment["a"][t]
        assert sorted(words) == list(range(len(a) // 2))
        for word, (lo, hi) in words.items():
            assert (lo, hi) == (a[2 * word], a[2 * word + 1]), (t, word)


def _operands(found):
    layout = v3.operand_layout()
    found["swizzle"] = str(layout.inner)
    found["outer"] = str(layout.outer)
    # the kernel's V^T view: (dim, key) -> V's (key, dim)
    vt = cute.composition(layout.outer, cute.make_ordered_layout((v3.HEAD_DIM, v3.TILE_KEYS), order=(1, 0)))
    found["vt"] = str(vt)
    found["q"] = [[layout.outer((row, dim)) for dim in range(v3.HEAD_DIM)] for row in range(v3.TILE_KEYS)]
    found["v"] = [[vt((dim, key)) for dim in range(v3.HEAD_DIM)] for key in range(v3.TILE_KEYS)]
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
    return v3.operand_offset(row, col // 8) + 2 * (col % 8)


def test_q_and_k_are_k_major_at_operand_offset(operands):
    """QK's A (Q [16 h + i][dim]) and B (K [key][dim]) operands: the K-major tile element (row, dim) is the byte
    the expansion wrote it at, in the canonical K-major SW128 form (8-row x 128-byte atoms: SBO 1024 bytes, second
    64-dim half 8 KB on)."""
    assert operands["swizzle"] == "S<3,4,3>"
    assert operands["outer"] == "((8,8),(64,2)):((64,512),(1,4096))"
    assert all(_swizzled_bytes(operands["q"][row][dim]) == _written(row, dim)
               for row in range(v3.TILE_KEYS) for dim in range(v3.HEAD_DIM))
    assert "K" in operands["majors"][0] and "K" in operands["majors"][1]


def test_v_transposed_is_mn_major_at_operand_offset(operands):
    """PV's B operand V^T (n = dim, k = key), read MN-major (``tnspB``): element (dim, key) is the byte where the V
    expansion wrote V[key][dim]; the view is the canonical MN-major SW128 form (64 contiguous dims x 8 keys atoms:
    keys 8 apart 1024 bytes, the second 64-dim half 8 KB on)."""
    assert operands["vt"] == "((64,2),64):((1,4096),64)"  # keys: (8,8):(64,512), coalesced
    assert all(_swizzled_bytes(operands["v"][key][dim]) == _written(key, dim)
               for key in range(v3.TILE_KEYS) for dim in range(v3.HEAD_DIM))
    assert "MN" in operands["majors"][2]


@pytest.mark.parametrize("warpgroups", v3.WARPGROUPS)
def test_expand_kv_writes_every_element_once(warpgroups):
    """`_expand_kv`'s stores cover the K and V tiles once, with one warpgroup (v3: per thread 2 K chunks and 4 V
    pieces) or two (v3w8: 1 and 2): K (`k_expand_unit`) chunks ``4 chunk + quad`` of key ``32 half + key``, in
    the half `warpgroup_half` gives the warpgroup (the half it copies, too); V (`v_expand_unit`) chunks ``2 piece + quad``
    of key ``32 half + key``. `_expand_q` (each warpgroup its own tile): Q chunks ``4 (unit & 3) + quad`` of row
    ``unit / 4``."""
    threads = v3.THREADS * warpgroups
    k, v = [], []
    for tid in range(threads):
        wg, wg_tid = tid // v3.THREADS, tid % v3.THREADS
        for r in range(2 // warpgroups):
            half, key, chunk = v3.k_expand_unit(wg, wg_tid, r, warpgroups)
            assert half == (r if warpgroups == 1 else wg) == v3.warpgroup_half(wg, r, warpgroups)  # v3w8: half w
            k += [(32 * half + key, 4 * chunk + quad) for quad in range(4)]
        for r in range(v3.V_UNITS // threads):
            half, key, piece = v3.v_expand_unit(tid, r, threads)
            assert half in (0, 1) and 0 <= key < 32
            v += [(32 * half + key, 2 * piece + quad) for quad in range(2)]
    q = sorted(((tid + v3.THREADS * r) >> 2, 4 * ((tid + v3.THREADS * r) & 3) + quad) for r in range(2)
               for tid in range(v3.THREADS) for quad in range(4))
    every = [(row, chunk) for row in range(v3.TILE_KEYS) for chunk in range(v3.HEAD_DIM // 8)]
    assert sorted(k) == sorted(v) == q == every
    assert len(k) == len(v) == len(every)  # once each
    assert sorted(v3.operand_offset(row, chunk) for row, chunk in every) == list(range(0, v3.OPERAND_BYTES, 16))


def _wavefronts(addresses: list[int]) -> int:
    """Shared-memory wavefronts of one 16-byte-per-lane access of a quarter-warp (8 lanes): the most distinct
    addresses that fall in one of the 8 16-byte bank groups."""
    groups: dict[int, set] = {}
    for address in addresses:
        groups.setdefault((address // 16) % 8, set()).add(address)
    return max(len(found) for found in groups.values())


@pytest.mark.parametrize("warpgroups", v3.WARPGROUPS)
def test_expansion_is_bank_conflict_free(warpgroups):
    """Every 16-byte load and store of `_expand_k` / `_expand_v` is one wavefront per quarter-warp (ncu of v3 before
    this mapping: 42% of the shared-store wavefronts were conflicts, 2-way on the K and V operand stores): K reads
    its chunk at ``64 key + 16 chunk`` of the ring half and stores units ``4 chunk + quad`` (FP16, `operand_offset`;
    v3's `k_expand_unit`) or ``2 chunk + unit`` (e4m3, `fp8_operand_offset`; v4's `k_expand_unit`) of row
    ``32 half + key``; V reads piece ``piece ^
    v_swizzle(key)`` of its 128-byte row and stores units ``2 piece + quad``."""
    from mpfa.kernels.sm90 import prefill_staged_layout as sl
    from mpfa.kernels.sm90 import prefill_wgmma_fp8qk as v4

    threads = v3.THREADS * warpgroups
    for first in range(0, threads, 8):
        lanes = range(first, first + 8)
        for r in range(2 // warpgroups):
            for k_unit, store, units_per_chunk in ((v3.k_expand_unit, v3.operand_offset, 4),
                                                   (v4.k_expand_unit, v4.fp8_operand_offset, 2)):
                units = [k_unit(t // v3.THREADS, t % v3.THREADS, r, warpgroups) for t in lanes]
                assert _wavefronts([sl.K_OFFSET + sl.K_ROW_BYTES * key + 16 * chunk for _, key, chunk in units]) == 1
                for unit in range(units_per_chunk):
                    assert _wavefronts([store(32 * half + key, units_per_chunk * chunk + unit)
                                        for half, key, chunk in units]) == 1
        for r in range(v3.V_UNITS // threads):
            units = [v3.v_expand_unit(t, r, threads) for t in lanes]
            assert _wavefronts([sl.V_OFFSET + sl.V_ROW_BYTES * key + 16 * (piece ^ sl.v_swizzle(key))
                                for _, key, piece in units]) == 1
            for quad in range(2):
                assert _wavefronts([v3.operand_offset(32 * half + key, 2 * piece + quad)
                                    for half, key, piece in units]) == 1


def test_shared_memory_offsets():
    """v3: Q, K, V, ring; v3w8: Q of warpgroup 0, Q of warpgroup 1, K, V, ring; every operand tile 1024-byte
    aligned (the 128-byte swizzle's repeat, base offset 0 in the descriptors)."""
    assert v3.smem_offsets(1) == (0, 16384, 32768, 49152)
    assert v3.smem_offsets(2) == (0, 32768, 49152, 65536)
    assert all(offset % v3.OPERAND_ALIGN == 0 for w in v3.WARPGROUPS for offset in v3.smem_offsets(w))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_v3w8_walk_is_v3s_walk_per_warpgroup(monkeypatch: pytest.MonkeyPatch, causal):
    """A model of the tile loop's control flow (`_run_wgmma_tiles` / `_wgmma_step`): the v3w8 CTA walks the tiles of
    its last row and masks the tiles its first row does not see whole; warpgroup w, with its own rows' plan
    (`prefill_tile.warp_plan` over 16 rows), skips a masked tile past all its rows. Then every warpgroup whose rows
    start inside the sequence computes exactly the tiles of the v3 CTA with the same rows, in the same order, with
    the same visible scores (a tile v3 takes whole and v3w8 masks has every score visible): the same arithmetic,
    so the same output bit for bit."""
    from mpfa.kernels.sm90 import prefill_tile as tile_math

    for name, value in {"imin": min, "imax": max, "select_": lambda c, a, b: a if c else b}.items():
        monkeypatch.setattr(tile_math, name, value)
    keys = v3.TILE_KEYS

    def plan(row0, q_len, kv_len, g, rows):
        return tile_math.warp_plan(row0, q_len, kv_len, g, causal=causal, tile_keys=keys, warp_rows=rows)

    def visible(row0, q_len, kv_len, tile, masked):
        """The (row, key) scores of the tile that start at Delta_S (not -inf): `score_init` on `limits`."""
        seen = set()
        for g in range(8):
            limits = plan(row0, q_len, kv_len, g, v3.ROWS)[1]
            for r in range(2):
                for c in range(4):
                    for block in range(v3.N_BLOCKS):
                        for half in range(2):
                            key = 8 * block + 2 * c + half
                            if not masked or limits[r] - tile * keys - 2 * c >= 8 * block + half:
                                seen.add((g + 8 * r, key))
        return frozenset(seen)

    def walk(cta_row0, block_m, row0, q_len, kv_len):
        """[(tile, visible scores)] the warpgroup of rows row0 .. row0 + 15 computes in a CTA of block_m rows."""
        cta_tiles, _, cta_common = plan(cta_row0, q_len, kv_len, 0, block_m)
        own_tiles = plan(row0, q_len, kv_len, 0, v3.ROWS)[0]
        masked_tiles = cta_tiles - min(cta_common // keys, cta_tiles)
        steps = []
        for step in range(cta_tiles):
            tile, _, _ = sl.ring_compute(step, cta_tiles, v3.STAGES)
            masked = step < masked_tiles
            if block_m > v3.ROWS and masked and tile >= own_tiles:
                continue  # `_wgmma_step`: no row of this warpgroup sees the tile
            steps.append((tile, visible(row0, q_len, kv_len, tile, masked)))
        return steps

    skipped = 0
    for q_len in [1, 15, 16, 17, 31, 32, 33, 40, 48, 63, 64, 95, 130]:
        for kv_len in (q_len, q_len + 7, q_len + 20, q_len + 40, q_len + 100):
            for cta_row0 in range(0, q_len, 2 * v3.ROWS):
                for wg in range(2):
                    row0 = cta_row0 + v3.ROWS * wg
                    if row0 >= q_len:
                        continue  # no row stored
                    w8 = walk(cta_row0, 2 * v3.ROWS, row0, q_len, kv_len)
                    assert w8 == walk(row0, v3.ROWS, row0, q_len, kv_len), (q_len, kv_len, row0)
                    skipped += len(w8) < plan(cta_row0, q_len, kv_len, 0, 2 * v3.ROWS)[0]
    assert skipped > 0 if causal else skipped == 0  # the skip is exercised (causal only)
