"""The fp8 prefill kernel's layouts, requantization and pipeline on the CPU (`prefill_fp8_layout`, `prefill_fp8`):

* the e4m3 Q / K operand tile (`fp8_operand_offset`) and the V^T tile (`vt_offset`) are CuTe's layouts of what the
  wgmma descriptors describe;
* the requantization (exponent from the NVFP4 block scales, two exact power-of-two steps on the block scale in FP16,
  e4m3 per pair; e2m1 decoded by table look-up in the operand pass) is `formats.fake_quant_fp8_pow2` per query row
  and per 64-key tile, bit for bit;
* the V transpose (ldmatrix.trans, byte permutes, stmatrix, modelled per lane from the PTX ISA's definitions) writes
  V^T in the key order `pv_key`, and `p_operand_fp8` packs each thread's own S accumulator values into the e4m3 A
  fragment of CuTe's ``m64n136k32`` register-A MMA in the same key order, so the fragment times V^T is P V;
* the FP32 Delta_S in the consumers' order, the operand images, the 128-key walk and the mbarrier pipeline (a model
  of the producer and both consumers that must finish every walk without deadlock).
"""

from __future__ import annotations

import os
import random

import numpy as np
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

from mpfa.kernels import formats  # noqa: E402
from mpfa.kernels.sm90 import decode_layout as lay  # noqa: E402
from mpfa.kernels.sm90 import prefill_fp8 as kernel  # noqa: E402
from mpfa.kernels.sm90 import prefill_fp8_layout as fp8  # noqa: E402
from mpfa.kernels.sm90 import prefill_staged_layout as sl  # noqa: E402
from mpfa.kernels.sm90.prefill_wgmma import HEAD_DIM, N_BLOCKS, THREADS, TILE_KEYS  # noqa: E402

exact_layout = load("test_prefill_exact_layout.py", "_prefill_exact_layout_fp8")
_ptx_acc, _trace = exact_layout._ptx_acc, exact_layout._trace

KEYS, DIMS, M = TILE_KEYS, HEAD_DIM, 64


# --- the e4m3 operand tiles against CuTe's layouts ------------------------------------------------------------------

def test_fp8_operand_offset_is_cutes_layout():
    """`fp8_operand_offset` (where the expansion stores a 16-byte unit) is CuTe's swizzled e4m3 wgmma layout of the
    tile: the layout's element (= byte) offset with the 128-byte swizzle (bits 4-6 ^= bits 7-9) applied."""
    def fn(found):
        layout = fp8.fp8_operand_layout()
        found["inner"], found["cosize"] = str(layout.inner), cute.cosize(layout.outer)
        found["ok"] = []
        for row in range(KEYS):
            for unit in range(DIMS // 16):
                for byte in range(0, 16, 5):
                    offset = layout.outer((row, 16 * unit + byte))
                    written = fp8.fp8_operand_offset(row, unit) + byte
                    found["ok"].append((offset ^ (((offset >> 7) & 7) << 4)) == written)
    found = _trace(fn)
    assert found["inner"] == "S<3,4,3>" and found["cosize"] == KEYS * DIMS
    assert len(found["ok"]) == KEYS * DIMS // 16 * 4 and all(found["ok"])


def test_vt_offset_is_cutes_layout():
    """`vt_offset` = CuTe's e4m3 K-major 64-byte-swizzle layout of V^T [136][64] (Swizzle<2,4,3>: bits 4-5 ^=
    bits 7-8), the layout PV's B descriptor describes, over all 136 rows (V^T's and the row-sum rows)."""
    def fn(found):
        layout = fp8.vt_layout()
        found["inner"] = str(layout.inner)
        found["ok"] = []
        for d in range(fp8.PV_N):
            for unit in range(KEYS // 16):
                for byte in range(0, 16, 5):
                    offset = layout.outer((d, 16 * unit + byte))
                    found["ok"].append((offset ^ (((offset >> 7) & 3) << 4)) == fp8.vt_offset(d, unit) + byte)
    found = _trace(fn)
    assert found["inner"] == "S<2,4,3>" and all(found["ok"]) and len(found["ok"]) == fp8.PV_N * 4 * 4
    assert fp8.vt_offset(DIMS, 0) == DIMS * KEYS  # the row-sum rows after V^T's 128


# --- the requantization, modelled on the CPU ------------------------------------------------------------------------

def _kernel_requantize(values: torch.Tensor, group_dims: tuple) -> torch.Tensor:
    """What the kernel computes from NVFP4 ``values`` (FP32, last dim a multiple of 16) requantized with one
    power-of-two scale per group (``group_dims``): the exponent from the group's largest block scale
    (`exponent_from_scale`), the block scale times 2**-e in two FP16 power-of-two steps (`factor_exponents`), e2m1
    times that in FP16, e4m3 (round to nearest even, saturating), times 2**e."""
    t = formats.quantize_nvfp4(values)
    codes = formats.decode_e2m1(formats.unpack_e2m1(t.codes)).unflatten(-1, (-1, 16))
    scales = t.scales.float()  # [..., blocks]
    top = scales.abs().amax(dim=group_dims, keepdim=True)
    e = torch.tensor([fp8.exponent_from_scale(x) for x in top.flatten().tolist()]).reshape(top.shape)
    steps = [fp8.factor_exponents(x) for x in e.flatten().tolist()]
    a = torch.tensor([x for x, _ in steps]).reshape(top.shape)
    b = torch.tensor([y for _, y in steps]).reshape(top.shape)
    assert (a.abs() <= 15).all() and (b >= 0).all() and (b <= 15).all() and torch.equal(a + b, -e)
    block_scales = ((scales.half() * torch.exp2(a.float()).half()).half() * torch.exp2(b.float()).half()).half()
    assert torch.isfinite(block_scales).all() and block_scales.max() <= 448 / 6
    exact = codes * scales.unsqueeze(-1) * torch.exp2(-e.float()).unsqueeze(-1)
    product = (codes.half() * block_scales.unsqueeze(-1)).half()
    assert torch.equal(product.float(), exact), "FP16 rounded a value"
    out = product.to(torch.float8_e4m3fn).float() * torch.exp2(e.float()).unsqueeze(-1)
    return out.flatten(-2)


@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_requantization_is_fake_quant_fp8_pow2(spread: float):
    """Per 64-key tile of K (group = the tile's keys x dims) and per Q row (group = the row's dims), on NVFP4
    values with magnitudes spread over ``spread`` binades per key / row: bit-exact with
    `formats.fake_quant_fp8_pow2` of the dequantized values, and the exponent is the reference's."""
    gen = torch.Generator().manual_seed(7)
    tiles = torch.randn(6, 64, 128, generator=gen) * torch.exp2(spread * torch.rand(6, 64, 1, generator=gen)
                                                                 - 8 * torch.rand(6, 1, 1, generator=gen))
    nvfp4 = formats.fake_quant_nvfp4(tiles)
    expected = formats.fake_quant_fp8_pow2(nvfp4, (-2, -1))
    got = torch.stack([_kernel_requantize(tile, (0, 1)) for tile in tiles])
    assert torch.equal(got, expected)
    rows = tiles[0]
    assert torch.equal(_kernel_requantize(rows, (1,)).reshape(64, 128), formats.fake_quant_fp8_pow2(nvfp4[0]))


def test_exponent_model_matches_reference_scale():
    """`exponent_from_scale` (as `ptx.e4m3_pow2_exponent`) = `formats.e4m3_pow2_scale`'s exponent of 6 x scale, for
    every positive e4m3 scale."""
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    reference = formats.e4m3_pow2_scale((6 * scales).unsqueeze(-1)).squeeze(-1)
    assert [fp8.exponent_from_scale(float(s)) for s in scales] == torch.log2(reference).int().tolist()
    assert fp8.exponent_from_scale(0.0) == 0


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode) on ints: byte i is byte ``selector`` nibble i (low 3 bits) of {b, a}, or
    its sign replicated where the nibble's bit 3 is set; only the low 16 bits of ``selector`` count."""
    pool = (a | (b << 32)).to_bytes(8, "little")
    out = []
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        out.append((0xFF if byte & 0x80 else 0) if nibble & 8 else byte)
    return int.from_bytes(bytes(out), "little")


def _f16_bits_times(bits: int, factor: float) -> int:
    """One half of an FP16 multiply (``mul.rn.f16x2``): the product of two FP16 is exact in FP32, then one rounding."""
    value = np.array([bits], dtype=np.uint16).view(np.float16).astype(np.float32) * np.float32(factor)
    return int(value.astype(np.float16).view(np.uint16)[0])


def _lut_regs(word: int) -> list[int]:
    return list(fp8.e2m1_word_f16x2_lut(word, lookup=_prmt, permute=_prmt))


def test_lut_decode_gives_the_shift_decodes_fp16_bits():
    """For every code pair (j, j + 4) of a word in every register j, among random other codes: the table look-up
    (`e2m1_word_f16x2_lut`, the operand pass's K decode) gives exactly the bits of `e2m1_word_to_f16x2` x 2**14
    (`e2m1_word_f16x2_shift`, the Q decode; -0 for code 8 included), the FP16 of the code's value."""
    rng = random.Random(5)
    for j in range(4):
        for low in range(16):
            for high in range(16):
                others = rng.getrandbits(32) & ~((0xF << (4 * j)) | (0xF << (4 * j + 16)))
                word = others | (low << (4 * j)) | (high << (4 * j + 16))
                got = _lut_regs(word)[j]
                shifted = lay.e2m1_word_to_f16x2(word, j)
                expected = [_f16_bits_times((shifted >> (16 * h)) & 0xFFFF, 2.0**14) for h in range(2)]
                assert got == expected[0] | (expected[1] << 16), (j, low, high, hex(word))
                for half, code in enumerate((low, high)):
                    value = (-1.0 if code & 8 else 1.0) * formats.E2M1_GRID[code & 7]
                    bits = int(torch.tensor([value]).half().view(torch.int16)[0]) & 0xFFFF
                    assert (got >> (16 * half)) & 0xFFFF == bits


def test_lut_expansion_is_fake_quant_fp8():
    """The whole K element path of the operand pass, modelled bit by bit: every e2m1 code x every positive e4m3
    block scale x every tile exponent that block can meet (the tile's largest block scale from the block's own up to
    448): the looked-up FP16 value times the block scale times 2**-e in FP16 (`factor_exponents`' two exact steps),
    to e4m3 (round to nearest even, saturating) -- equal to `formats.fake_quant_fp8` of the exact value with the
    scale 2**e."""
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = list(range(16))
    words = [sum(code << (4 * n) for n in range(8)) for code in codes]  # every position holds the code
    f16_of_code = np.array([_lut_regs(w)[0] & 0xFFFF for w in words], dtype=np.uint16).view(np.float16)
    values = torch.tensor(f16_of_code.astype(np.float32))  # the kernel's FP16 of each code
    grid = torch.tensor([(-1.0 if code & 8 else 1.0) * formats.E2M1_GRID[code & 7] for code in codes])
    checked = 0
    for top in scales.tolist():
        e = fp8.exponent_from_scale(top)
        a, b = fp8.factor_exponents(e)
        blocks = scales[scales <= top]
        factors = ((blocks.half() * torch.tensor(2.0**a).half()).half() * torch.tensor(2.0**b).half()).half()
        product = (values.half()[:, None] * factors[None, :]).half()  # HMUL2: exact product, one rounding
        got = product.float().to(torch.float8_e4m3fn).float() * 2.0**e
        exact = grid[:, None] * blocks[None, :]
        assert torch.equal(got, formats.fake_quant_fp8(exact, 2.0**e)), top
        checked += got.numel()
    assert checked == 16 * 126 * 127 // 2


# --- V^T and P ----------------------------------------------------------------------------------------------------

def test_pv_key_permutes_each_16_keys():
    keys = [fp8.pv_key(p) for p in range(KEYS)]
    assert sorted(keys) == list(range(KEYS))
    assert all(k // 16 == p // 16 for p, k in enumerate(keys))
    assert keys[:8] == [0, 1, 8, 9, 2, 3, 10, 11]


STAGE = 8192  # any stage size (a multiple of 16) holding a 32-key half


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


def _transpose(ring: bytearray) -> bytearray:
    """The operand pass's `_expand_v` for every warp and round: ldmatrix.x4.trans (PTX: lane (g, c) gets matrix i's
    16-bit elements (row 2c, column g), (row 2c + 1, column g)), the byte permutes, stmatrix.x4 (lane (g, c) gives
    matrix i's row g, columns 2c, 2c + 1)."""
    vt = bytearray(fp8.VT_BYTES)
    rounds = fp8.BLOCKS // fp8.BLOCKS_PER_WARP_STEP // (THREADS // 32)
    for r in range(rounds):
        for warp in range(THREADS // 32):
            tids = [32 * warp + lane for lane in range(32)]
            rows = []  # rows[i][row] = the 16 bytes lane 8 i + row addresses
            for i in range(4):
                row_bytes = []
                for row in range(8):
                    half, key, piece = fp8.v_load_lane(tids[8 * i + row], r, THREADS)
                    at = half * STAGE + sl.V_OFFSET + sl.V_ROW_BYTES * key + 16 * (piece ^ sl.v_swizzle(key))
                    row_bytes.append(ring[at:at + 16])
                rows.append(row_bytes)
            for lane in range(32):
                g, c = lane // 4, lane % 4
                m = [int.from_bytes(bytes(rows[i][2 * c][2 * g:2 * g + 2]) + bytes(rows[i][2 * c + 1][2 * g:2 * g + 2]),
                                    "little") for i in range(4)]
                out = [_prmt(m[0], m[1], fp8.EVEN_BYTES), _prmt(m[0], m[1], fp8.ODD_BYTES),
                       _prmt(m[2], m[3], fp8.EVEN_BYTES), _prmt(m[2], m[3], fp8.ODD_BYTES)]
                for i in range(4):  # matrix i, row g, bytes 4c .. 4c + 3, at the address lane 8 i + g gives
                    dim, unit = fp8.v_store_lane(tids[8 * i + g], r, THREADS)
                    at = fp8.vt_offset(dim, unit) + 4 * c
                    vt[at:at + 4] = out[i].to_bytes(4, "little")
    return vt


def test_transpose_writes_vt_in_pv_key_order():
    """Every byte of V^T's 128 rows: row d, k position p holds V[pv_key(p)][d], and every block is written exactly
    once (the stores cover the V^T rows)."""
    gen = torch.Generator().manual_seed(3)
    v = torch.randint(0, 256, (KEYS, DIMS), generator=gen)
    vt = _transpose(_ring(v))
    for d in range(DIMS):
        for p in range(KEYS):
            assert vt[fp8.vt_offset(d, p >> 4) + (p & 15)] == v[fp8.pv_key(p), d], (d, p)
    units = {fp8.v_store_lane(t, r, THREADS) for r in range(fp8.BLOCKS // 2 // (THREADS // 32)) for t in range(THREADS)}
    assert units == {(d, u) for d in range(DIMS) for u in range(KEYS // 16)}


def _a_fragment(found):
    e4m3 = cutlass.Float8E4M3FN
    mma = sm90_utils.make_trivial_tiled_mma(e4m3, e4m3, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
                                            (M, fp8.PV_N), a_source=warpgroup.OperandSource.RMEM)
    coords = []
    for t in range(THREADS):
        thr = mma.get_slice(t)
        part = thr.partition_A(cute.make_identity_tensor((M, KEYS)))
        frag = thr.make_fragment_A(thr.partition_shape_A((M, KEYS)))
        coords.append([tuple(part[frag.layout.get_hier_coord(e)]) for e in range(cute.size(frag))])
    found["a"] = coords


@pytest.mark.slow
def test_p_fragment_times_vt_is_pv(monkeypatch):
    """`p_operand_fp8` on symbolic P (each S accumulator register's (row, key), PTX's accumulator layout): byte b
    of word w is element 4 w + b of CuTe's e4m3 A fragment of the PV MMA, which holds A[row, p]; it must be
    P[row, pv_key(p)]. Then A (from the fragments) x B (V^T in k positions) = P V exactly, on integer values."""
    a_fragment = _trace(_a_fragment)["a"]
    monkeypatch.setattr(fp8, "f32x4_to_e4m3x4", lambda *x: x)
    gen = torch.Generator().manual_seed(5)
    p = torch.randint(-8, 9, (M, KEYS), generator=gen).double()
    v = torch.randint(-8, 9, (KEYS, DIMS), generator=gen).double()
    a = torch.full((M, KEYS), float("nan"), dtype=torch.float64)
    for t in range(THREADS):
        probs = [[_ptx_acc(t, 4 * block + i) for i in range(4)] for block in range(N_BLOCKS)]
        words = {}
        fp8.p_operand_fp8(probs, words)
        assert sorted(words) == list(range(8))
        for w in range(8):
            for b in range(4):
                row, pos = a_fragment[t][4 * w + b]
                src_row, key = words[w][b]
                assert src_row == row and key == fp8.pv_key(pos), (t, w, b)
                a[row, pos] = p[src_row, key]
    b_op = v[[fp8.pv_key(pos) for pos in range(KEYS)]]  # V^T read by k position (test above)
    assert torch.equal(a @ b_op, p @ v)


# --- Delta_S, the images, the walk and the pipeline ---------------------------------------------------------------

@pytest.mark.parametrize("group", fp8.GROUPS)
def test_staged_delta_s_layout(group):
    """The FP32 Delta_S of an image: the operand pass's (head, key) slots fill the group's area once each, and
    consumer lane c of head h finds key 16 i + 8 b + 2c + half at slot 2b + half of its i-th 16-byte word; a lane's
    two keys are one 8-byte store."""
    offsets = {fp8.ds_staged_offset(h, k): (h, k) for h in range(group) for k in range(KEYS)}
    assert sorted(offsets) == list(range(0, fp8.image_ds_bytes(group), 4))
    for h in range(group):
        for c in range(4):
            for i in range(KEYS // 16):
                word = fp8.ds_staged_read(h, c, i)
                assert word % 16 == 0
                for b in range(2):
                    for half in range(2):
                        assert offsets[word + 4 * (2 * b + half)] == (h, 16 * i + 8 * b + 2 * c + half)
    for k in range(0, KEYS, 2):
        assert fp8.ds_staged_offset(0, k + 1) == fp8.ds_staged_offset(0, k) + 4 and fp8.ds_staged_offset(0, k) % 8 == 0


def test_images_layout():
    """An image: K, V^T with its row-sum rows, every head's Delta_S, then the exponent in the last 16 bytes; 18 KB
    (9 16-byte units per pass thread) for GQA groups 1-5, 19 KB for 6-8; the attention kernel's 8 stages of images
    and its mbarriers fit a CTA."""
    from mpfa.kernels.sm90.prefill_fp8_pass import UNITS_PER_THREAD, OperandPass

    assert fp8.IMAGE_BYTES == 18432 == 16 * THREADS * UNITS_PER_THREAD
    assert fp8.GROUPS == tuple(range(1, 9))
    for group in fp8.GROUPS:  # the whole group's Delta_S before the exponent
        image = fp8.image_bytes(group)
        assert image == (18432 if group <= 5 else 19456) and image % 1024 == 0
        assert fp8.FP8_OPERAND_BYTES + fp8.VT_BYTES + fp8.image_ds_bytes(group) <= fp8.exponent_offset(group)
        assert fp8.exponent_offset(group) + 4 <= image
        attention = kernel.PrefillSm90Fp8(8, group, 128, True)
        assert (attention.image_bytes, attention.exponent_offset) == (image, fp8.exponent_offset(group))
        assert attention.smem_bytes <= 227 * 1024
        assert attention.offsets[1] + kernel.OPERAND_STAGES * image == attention.barrier_offset
        operand_pass = OperandPass(8, group, 128)
        assert 16 * operand_pass.image_units == image == operand_pass.offsets[3]
        assert operand_pass.smem_bytes == image + operand_pass.tile_bytes
    assert [fp8.exponent_offset(group) for group in (1, 4, 5)] == [18416] * 3
    assert [fp8.image_row(start, h, t, 10) for start, h, t in ((0, 0, 0), (3, 0, 4), (0, 1, 0), (5, 1, 2))] == [
        0, 7, 10, 17]


def _image_bytes_written(group: int) -> dict:
    """Byte -> what the operand pass writes there in an image of GQA ``group`` (`OperandPass`: K, V^T with its
    row-sum rows, each (head, key)'s FP32 Delta_S by `_stage_keys`, the exponent), failing on a byte written twice."""
    from mpfa.kernels.sm90.prefill_fp8_pass import OperandPass

    operand_pass = OperandPass(8, group, 128)
    written = {}

    def write(offset: int, size: int, what) -> None:
        for byte in range(offset, offset + size):
            assert byte not in written, (group, byte, written.get(byte), what)
            written[byte] = what

    write(operand_pass.offsets[1], fp8.FP8_OPERAND_BYTES, "k")
    write(operand_pass.offsets[2], fp8.VT_BYTES, "vt")
    ds = operand_pass.offsets[2] + fp8.VT_BYTES
    for unit in range(group * TILE_KEYS // 2):  # `_stage_keys`: head unit / 32, keys 2 (unit % 32), + 1
        head, key = unit >> 5, (unit & 31) << 1
        write(ds + fp8.ds_staged_offset(head, key), 4, ("ds", head, key))
        write(ds + fp8.ds_staged_offset(head, key + 1), 4, ("ds", head, key + 1))
    write(fp8.exponent_offset(group), 4, "exponent")
    return written


@pytest.mark.parametrize("group", fp8.GROUPS)
def test_every_head_of_the_group_reads_its_own_delta_s_from_the_image(group):
    """Byte-level, per GQA group: everything the operand pass writes lies in the bytes it stores (the image), once
    (the 18 KB image had no room at groups 6-8: head 5's Delta_S of key 54 on the exponent at group 6, heads 6 and 7
    past the image's end at 7 and 8); every CTA's consumer lanes (`prefill_staged_layout.cta_shape`: gcd(group, 4)
    heads, numbered in the group from the CTA's first) read their head's Delta_S of the keys of their scores, and
    the tile's exponent, from an operand stage of the attention kernel."""
    written = _image_bytes_written(group)
    attention = kernel.PrefillSm90Fp8(8, group, 128, True)
    assert max(written) < attention.image_bytes  # the pass stores the image's bytes, the producer copies them
    assert written[attention.exponent_offset] == "exponent"
    heads = sl.cta_shape(group)[0]
    ds = attention.offsets[2] - attention.offsets[1] + fp8.VT_BYTES  # in an operand stage
    for block_head in range(8 * group // heads):
        first_head = block_head * heads
        for head_in_cta in range(heads):
            head = first_head % group + head_in_cta  # in the group: the kernel's ds_lane (`PrefillSm90Fp8._consume`)
            for c in range(4):
                lane = fp8.ds_staged_read(head, c, 0)
                for i in range(N_BLOCKS // 2):
                    word = ds + lane + fp8.ds_staged_read(0, 0, i)
                    for b in range(2):
                        for half in range(2):
                            key = 16 * i + 8 * b + 2 * c + half
                            assert written[word + 4 * (2 * b + half)] == ("ds", head, key), (group, head, c, i)


def test_image_layout_packs_the_sequences_tiles():
    """Each sequence's tiles start after the tiles (64 keys, rounded up) of the sequences before it; without the
    host's lengths a KV head gets batch x the page table's tiles (no read-back), with them exactly the sum, and the
    operand pass's grid the longest sequence's tiles."""
    from mpfa.kernels.sm90.prefill_launch import image_layout

    lengths = [130, 64, 1, 0, 4096]
    starts, rows, grid = image_layout(torch.tensor(lengths, dtype=torch.int32), 80)
    assert starts.tolist() == [0, 3, 4, 5, 5] and (rows, grid) == (5 * 80, 80)
    starts, rows, grid = image_layout(torch.tensor(lengths, dtype=torch.int32), 80, lengths)
    assert starts.tolist() == [0, 3, 4, 5, 5] and (rows, grid) == (69, 64)
    with pytest.raises(ValueError, match="5 sequences' lengths"):
        image_layout(torch.tensor(lengths, dtype=torch.int32), 80, lengths[:2])
    starts, rows, grid = image_layout(torch.tensor([0, 0], dtype=torch.int32), 80, [0, 0])
    assert starts.tolist() == [0, 0] and (rows, grid) == (0, 1)  # no keys: one tile's grid, whose CTAs exit
    starts, rows, grid = image_layout(torch.tensor([129], dtype=torch.int32), 80, [129])
    assert starts.tolist() == [0] and (rows, grid) == (3, 3)


@pytest.mark.parametrize("tiles", range(12))
def test_wide_walk(tiles: int):
    """The consumers' 128-key steps: every walk step in exactly one consumer step, each step's 64-key tiles one of
    the sequence's 128-key tiles (indices 2j, 2j + 1: the reference's ``block_n`` 128), every masked tile in a step
    taken by the masked body, at most one whole tile there (the partner of a masked tile)."""
    for masked in range(tiles + 1):
        lead, masked_pairs, pairs = kernel.wide_walk(tiles, masked)
        units = [((0,), masked > 0)] if lead else []
        units += [((lead + 2 * pair, lead + 2 * pair + 1), pair < masked_pairs) for pair in range(pairs)]
        steps = [(step, masked_body) for unit, masked_body in units for step in unit]
        assert sorted(step for step, _ in steps) == list(range(tiles)), (tiles, masked)
        assert all(len({(tiles - 1 - step) // 2 for step in unit}) == 1 for unit, _ in units), (tiles, masked)
        assert all(masked_body for step, masked_body in steps if step < masked), (tiles, masked)
        assert sum(masked_body for step, masked_body in steps if step >= masked) <= 1, (tiles, masked)


def test_stage_parity():
    """Walk step p uses operand stage p mod 8 in its (p / 8)-th use: the parity flips on every use of a stage."""
    assert [kernel.stage_parity(p) for p in range(32)] == [(p % 8, (p // 8) % 2) for p in range(32)]


def _pipeline_completes(tiles: int, stages: int) -> bool:
    """Whether the producer and the two consumers finish a walk of ``tiles`` steps with ``stages`` operand stages:
    the producer fills step p once both consumers released step p - stages, and ``full`` completes when its bytes
    land; each consumer takes the 128-key units of `wide_walk` (an odd walk's first step alone), waits for each of a
    unit's stages' ``full`` and releases them once the unit is done. Runs each party as far as it can until none
    moves."""
    lead = tiles & 1
    units = [(0,)] * lead + [(lead + 2 * k, lead + 2 * k + 1) for k in range(tiles // 2)]
    program = [action for unit in units for action in [("full", p) for p in unit] + [("release", p) for p in unit]]
    full, released, done, produced = [False] * tiles, [0] * tiles, [0, 0], 0
    while True:
        moved = False
        while produced < tiles and (produced < stages or released[produced - stages] == 2):
            full[produced], produced, moved = True, produced + 1, True
        for w in range(2):
            while done[w] < len(program):
                action, step = program[done[w]]
                if action == "full" and not full[step]:
                    break
                if action == "release":
                    released[step] += 1
                done[w], moved = done[w] + 1, True
        if done == [len(program)] * 2:
            return True
        if not moved:
            return False


def test_pipeline_never_deadlocks():
    """The kernel's 8 operand stages finish every walk length; one stage would not (a pair needs two)."""
    assert all(_pipeline_completes(tiles, kernel.OPERAND_STAGES) for tiles in range(40))
    assert _pipeline_completes(7, 2) and not _pipeline_completes(5, 1)
