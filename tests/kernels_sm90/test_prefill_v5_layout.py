"""The FP8-PV layouts of prefill v5 (`prefill_wgmma_fp8pv`), on the CPU: the V transpose (ldmatrix.trans, byte
permutes, stmatrix, modelled per lane from the PTX ISA's definitions) writes V^T in the key order `pv_key`, at the
offsets of CuTe's 64-byte-swizzle K-major layout; `p_operand_fp8` packs each thread's own S accumulator values
into the e4m3 A fragment CuTe's FP8 ``m64n128k32`` register-A MMA reads, with the same key order; so the fragment
times the V^T tile is P V for every (row, key, dim)."""

from __future__ import annotations

import os

import pytest
import torch
from siblings import load

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup  # noqa: E402

from mpfa.kernels.sm90 import prefill_staged_layout as sl  # noqa: E402
from mpfa.kernels.sm90 import prefill_wgmma_fp8pv as v5  # noqa: E402



v3_layout = load("test_prefill_wgmma_layout.py", "_prefill_wgmma_layout_v3")
_ptx_acc, _trace = v3_layout._ptx_acc, v3_layout._trace

KEYS, DIMS, M, THREADS = v5.TILE_KEYS, v5.HEAD_DIM, 64, 128


def test_pv_key_permutes_each_16_keys():
    keys = [v5.pv_key(p) for p in range(KEYS)]
    assert sorted(keys) == list(range(KEYS))
    assert all(k // 16 == p // 16 for p, k in enumerate(keys))
    assert keys[:8] == [0, 1, 8, 9, 2, 3, 10, 11]


def _ring(v: torch.Tensor) -> bytearray:
    """The V bytes of a 64-key tile in two ring stages (`prefill_staged_layout`: [32 keys][128 B], chunk d of key k
    at chunk d ^ v_swizzle(k)), stage h at h * STAGE."""
    ring = bytearray(2 * STAGE)
    for key in range(KEYS):
        half, k = divmod(key, sl.TILE_KEYS)
        for chunk in range(DIMS // 16):
            at = half * STAGE + sl.V_OFFSET + sl.V_ROW_BYTES * k + 16 * (chunk ^ sl.v_swizzle(k))
            ring[at:at + 16] = bytes(v[key, 16 * chunk:16 * chunk + 16].tolist())
    return ring


STAGE = 8192  # any stage size (a multiple of 16) holding a 32-key half


def _word(mem, at: int) -> int:
    return int.from_bytes(mem[at:at + 4], "little")


def _prmt(a: int, b: int, selector: int) -> int:
    pool = (a | (b << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def _transpose(ring: bytearray, threads: int) -> bytearray:
    """`_expand_v` of every warp and round: ldmatrix.x4.trans (PTX: lane (g, c) gets matrix i's 16-bit elements
    (row 2c, column g), (row 2c + 1, column g)), the byte permutes, stmatrix.x4 (lane (g, c) gives matrix i's row
    g, columns 2c, 2c + 1)."""
    vt = bytearray(v5.VT_BYTES)
    rounds = v5.BLOCKS // v5.BLOCKS_PER_WARP_STEP // (threads // 32)
    for r in range(rounds):
        for warp in range(threads // 32):
            tids = [32 * warp + lane for lane in range(32)]
            rows = []  # rows[i][row] = the 16 bytes lane 8 i + row addresses
            for i in range(4):
                row_bytes = []
                for row in range(8):
                    half, key, piece = v5.v_load_lane(tids[8 * i + row], r, threads)
                    at = half * STAGE + sl.V_OFFSET + sl.V_ROW_BYTES * key + 16 * (piece ^ sl.v_swizzle(key))
                    row_bytes.append(ring[at:at + 16])
                rows.append(row_bytes)
            for lane in range(32):
                g, c = lane // 4, lane % 4
                m = [int.from_bytes(bytes(rows[i][2 * c][2 * g:2 * g + 2]) + bytes(rows[i][2 * c + 1][2 * g:2 * g + 2]),
                                    "little") for i in range(4)]
                out = [_prmt(m[0], m[1], v5.EVEN_BYTES), _prmt(m[0], m[1], v5.ODD_BYTES),
                       _prmt(m[2], m[3], v5.EVEN_BYTES), _prmt(m[2], m[3], v5.ODD_BYTES)]
                for i in range(4):  # matrix i, row g, bytes 4c .. 4c + 3, at the address lane 8 i + g gives
                    dim, unit = v5.v_store_lane(tids[8 * i + g], r, threads)
                    at = v5.vt_offset(dim, unit) + 4 * c
                    vt[at:at + 4] = out[i].to_bytes(4, "little")
    return vt


@pytest.mark.parametrize("threads", [128, 256])
def test_transpose_writes_vt_in_pv_key_order(threads):
    """Every byte of V^T: row d, k position p holds V[pv_key(p)][d] (one warpgroup and v5w8's two), and every
    block is written exactly once (the stores cover the 8 KB tile)."""
    gen = torch.Generator().manual_seed(3)
    v = torch.randint(0, 256, (KEYS, DIMS), generator=gen)
    vt = _transpose(_ring(v), threads)
    for d in range(DIMS):
        for p in range(KEYS):
            assert vt[v5.vt_offset(d, p >> 4) + (p & 15)] == v[v5.pv_key(p), d], (d, p)
    units = {(v5.v_store_lane(t, r, threads)) for r in range(v5.BLOCKS // 2 // (threads // 32)) for t in range(threads)}
    assert units == {(d, u) for d in range(DIMS) for u in range(KEYS // 16)}


def test_vt_offset_is_cutes_layout():
    """`vt_offset` = CuTe's e4m3 K-major 64-byte-swizzle layout of V^T [128][64] (Swizzle<2,4,3>: bits 4-5 ^=
    bits 7-8), the layout PV's B descriptor describes; the 64-row halves (``pv_n`` 64) start at row 64's offset."""
    def fn(found):
        layout = v5.vt_layout()
        found["inner"] = str(layout.inner)
        found["ok"] = []
        for d in range(DIMS):
            for unit in range(KEYS // 16):
                for byte in range(0, 16, 5):
                    offset = layout.outer((d, 16 * unit + byte))
                    found["ok"].append((offset ^ (((offset >> 7) & 3) << 4)) == v5.vt_offset(d, unit) + byte)
        half = v5.vt_layout(64)
        found["half"] = [half.outer((d, k)) == layout.outer((d, k)) for d in range(64) for k in range(0, KEYS, 7)]
    found = _trace(fn)
    assert found["inner"] == "S<2,4,3>" and all(found["ok"]) and all(found["half"])
    assert v5.vt_offset(64, 0) == 64 * 64


def _a_fragment(found):
    e4m3 = cutlass.Float8E4M3FN
    for n in (128, 64):
        mma = sm90_utils.make_trivial_tiled_mma(e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                (1, 1, 1), (M, n), a_source=warpgroup.OperandSource.RMEM)
        coords = []
        for t in range(THREADS):
            thr = mma.get_slice(t)
            part = thr.partition_A(cute.make_identity_tensor((M, KEYS)))
            frag = thr.make_fragment_A(thr.partition_shape_A((M, KEYS)))
            coords.append([tuple(part[frag.layout.get_hier_coord(e)]) for e in range(cute.size(frag))])
        found[n] = coords


@pytest.fixture(scope="module")
def a_fragment():
    return _trace(_a_fragment)


def test_p_fragment_times_vt_is_pv(a_fragment, monkeypatch):
    """`p_operand_fp8` on symbolic P (each S accumulator register's (row, key), PTX's accumulator layout): byte b
    of word w is element 4 w + b of CuTe's e4m3 A fragment (both PV shapes), which holds A[row, p]; it must be
    P[row, pv_key(p)]. Then A (from the fragments) x B (V^T in k positions) = P V exactly, on integer values."""
    monkeypatch.setattr(v5, "f32x4_to_e4m3x4", lambda *x: x)
    monkeypatch.setattr(v5, "Float32", lambda x: 1)
    gen = torch.Generator().manual_seed(5)
    p = torch.randint(-8, 9, (M, KEYS), generator=gen).double()
    v = torch.randint(-8, 9, (KEYS, DIMS), generator=gen).double()
    for n in (128, 64):
        a = torch.full((M, KEYS), float("nan"), dtype=torch.float64)
        for t in range(THREADS):
            probs = [[_ptx_acc(t, 4 * block + i) for i in range(4)] for block in range(v5.N_BLOCKS)]
            words = {}
            v5.p_operand_fp8(probs, words)
            assert sorted(words) == list(range(8))
            for w in range(8):
                for b in range(4):
                    row, pos = a_fragment[n][t][4 * w + b]
                    src_row, key = words[w][b]
                    assert src_row == row and key == v5.pv_key(pos), (t, w, b)
                    a[row, pos] = p[src_row, key]
        b_op = v[[v5.pv_key(pos) for pos in range(KEYS)]]  # V^T read by k position (test above)
        assert torch.equal(a @ b_op, p @ v)
