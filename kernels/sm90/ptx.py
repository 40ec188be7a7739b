"""Inline-PTX building blocks for the sm90 CuTe DSL kernels: predicated vector loads, warp-level MMAs on raw
registers, byte permutes and FP8 conversions.

The kernels place every operand in registers themselves (their fragment maps are in `decode_layout`), so the
MMAs take plain 32-bit registers instead of CuTe fragments. The CuTe DSL built against CUDA 12.9 refuses its
SM89 FP8 warp-MMA atom, but ptxas accepts ``mma.sync ... e4m3`` for sm_90a, so it is issued here directly.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result_types: list, operands: list, text: str, constraints: str, *, pinned: bool = False):
    """``pinned``: keep the instruction where the kernel issues it (LLVM otherwise sinks loads next to their first
    use, which serialises the memory latency the kernel prefetches to hide)."""
    struct = len(result_types) > 1
    return llvm.inline_asm(
        llvm.StructType.get_literal(result_types) if struct else result_types[0],
        operands,
        text,
        constraints,
        has_side_effects=pinned,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ), struct


def _unpack(value, struct: bool, count: int, ir_type, wrap):
    if not struct:
        return wrap(value)
    return [wrap(llvm.extractvalue(ir_type, value, [i])) for i in range(count)]


def _u32(x, loc=None, ip=None):
    return Uint32(x).ir_value(loc=loc, ip=ip)


def _f32(x, loc=None, ip=None):
    return Float32(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def load_v4_u32(address: Int64, predicate: Uint32, *, loc=None, ip=None) -> list:
    """16 bytes from global memory (read-only path) as 4 x u32; zeros when ``predicate`` is 0 (nothing is read)."""
    value, struct = _asm(
        [T.i32()] * 4,
        [Int64(address).ir_value(loc=loc, ip=ip), _u32(predicate, loc, ip)],
        "{\n .reg .pred p;\n setp.ne.u32 p, $5, 0;\n"
        " mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
        " @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];\n}",
        "=&r,=&r,=&r,=&r,l,r",
        pinned=True,
    )
    return _unpack(value, struct, 4, T.i32(), Uint32)


@dsl_user_op
def load_u32_group(addresses: list, vector: int = 1, *, loc=None, ip=None) -> list:
    """``vector`` (1 or 4) x u32 from each global address (read-only path), the loads in one asm block, back to back
    in the PTX where the kernel places them (LLVM cannot sink them to their uses; ptxas may still schedule some of
    them next to their first use) -> one list of ``vector`` words per address."""
    n = len(addresses)
    lines = []
    for i in range(n):
        outs = ", ".join(f"${vector * i + j}" for j in range(vector))
        lines.append(f"ld.global.nc.v4.u32 {{{outs}}}, [${vector * n + i}];" if vector == 4
                     else f"ld.global.nc.u32 {outs}, [${vector * n + i}];")
    value, struct = _asm([T.i32()] * (vector * n), [Int64(a).ir_value(loc=loc, ip=ip) for a in addresses],
                         "\n".join(lines), ",".join(["=r"] * (vector * n) + ["l"] * n), pinned=True)
    words = _unpack(value, struct, vector * n, T.i32(), Uint32)
    return [words[vector * i:vector * (i + 1)] for i in range(n)]


@dsl_user_op
def load_u16(address: Int64, predicate: Uint32, default: Uint32, *, loc=None, ip=None) -> Uint32:
    """A 16-bit global load, zero-extended; ``default`` when ``predicate`` is 0 (nothing is read)."""
    value, struct = _asm(
        [T.i32()],
        [Int64(address).ir_value(loc=loc, ip=ip), _u32(predicate, loc, ip), _u32(default, loc, ip)],
        "{\n .reg .pred p;\n .reg .b16 h;\n setp.ne.u32 p, $2, 0;\n mov.b32 $0, $3;\n"
        " @p ld.global.nc.u16 h, [$1];\n @p cvt.u32.u16 $0, h;\n}",
        "=&r,l,r,r",
        pinned=True,
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def load_u32(address: Int64, *, loc=None, ip=None) -> Uint32:
    """A 32-bit global load, issued where the kernel places it."""
    value, struct = _asm([T.i32()], [Int64(address).ir_value(loc=loc, ip=ip)], "ld.global.nc.u32 $0, [$1];", "=r,l",
                         pinned=True)
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def store_v4_f32(address: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip), _f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip), _f32(d, loc, ip)],
        "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def store_v4_u32(address: Int64, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip), _u32(a, loc, ip), _u32(b, loc, ip), _u32(c, loc, ip), _u32(d, loc, ip)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def store_u32(address: Int64, a: Uint32, *, loc=None, ip=None) -> None:
    """4 bytes to global memory."""
    _side_effect_asm([Int64(address).ir_value(loc=loc, ip=ip), _u32(a, loc, ip)], "st.global.b32 [$0], $1;", "l,r")


@dsl_user_op
def store_v2_f32(address: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """8 bytes (two FP32) to global memory."""
    _side_effect_asm([Int64(address).ir_value(loc=loc, ip=ip), _f32(a, loc, ip), _f32(b, loc, ip)],
                     "st.global.v2.f32 [$0], {$1, $2};", "l,f,f")


@dsl_user_op
def mma_f16_m16n8k16(a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """D = A B + C, A 16x16 row-major and B 16x8 column-major in FP16 (4 and 2 f16x2 registers), C/D FP32 (4)."""
    value, struct = _asm(
        [T.f32()] * 4,
        [_u32(x, loc, ip) for x in a] + [_u32(x, loc, ip) for x in b] + [_f32(x, loc, ip) for x in c],
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
    )
    return _unpack(value, struct, 4, T.f32(), Float32)


@dsl_user_op
def mma_e4m3_m16n8k32(a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """D = A B + C, A 16x32 row-major and B 32x8 column-major in FP8 e4m3 (4 and 2 registers of 4), C/D FP32."""
    value, struct = _asm(
        [T.f32()] * 4,
        [_u32(x, loc, ip) for x in a] + [_u32(x, loc, ip) for x in b] + [_f32(x, loc, ip) for x in c],
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
    )
    return _unpack(value, struct, 4, T.f32(), Float32)


@dsl_user_op
def prmt(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """Byte permute: byte i of the result is byte ``selector`` nibble i of {b, a} (a = bytes 0-3)."""
    value, struct = _asm(
        [T.i32()], [_u32(a, loc, ip), _u32(b, loc, ip)], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r"
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def mul_f16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Lane-wise FP16 product of two f16x2 registers, round to nearest (subnormals kept)."""
    value, struct = _asm([T.i32()], [_u32(a, loc, ip), _u32(b, loc, ip)], "mul.rn.f16x2 $0, $1, $2;", "=r,r,r")
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def e4m3x2_to_f16x2(pair: Uint32, *, loc=None, ip=None) -> Uint32:
    """The two e4m3 bytes in the low 16 bits of ``pair`` -> f16x2 (byte 0 to the low half); exact."""
    value, struct = _asm(
        [T.i32()], [_u32(pair, loc, ip)],
        "{\n .reg .b16 h;\n cvt.u16.u32 h, $1;\n cvt.rn.f16x2.e4m3x2 $0, h;\n}", "=r,r",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def f16x2x2_to_e4m3x4(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Two f16x2 -> four e4m3 (round to nearest even, saturating): ``a``'s low, high half in bytes 0, 1, ``b``'s in
    bytes 2, 3 (``cvt.rn.satfinite.e4m3x2.f16x2``; exact for values e4m3 represents)."""
    value, struct = _asm(
        [T.i32()], [_u32(a, loc, ip), _u32(b, loc, ip)],
        "{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f16x2 lo, $1;\n cvt.rn.satfinite.e4m3x2.f16x2 hi, $2;\n"
        " mov.b32 $0, {lo, hi};\n}", "=r,r,r",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def max_u16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Lane-wise unsigned maximum of two pairs of 16-bit integers (``max.u16x2``, sm_90)."""
    value, struct = _asm([T.i32()], [_u32(a, loc, ip), _u32(b, loc, ip)], "max.u16x2 $0, $1, $2;", "=r,r,r")
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def e4m3_pow2_exponent(scale: Uint32, *, loc=None, ip=None) -> Uint32:
    """The e4m3 block scale in the low byte of ``scale`` -> the exponent e (two's complement) of the power-of-two
    e4m3 requantization scale of a group whose largest magnitude is 6 x scale: the smallest e with
    6 scale / 2**e <= 448 (`formats.e4m3_pow2_scale`), 0 for a zero scale. 6 scale = m 2**E, m in [1, 2):
    e = E - 8 + (m > 1.75)."""
    value, struct = _asm(
        [T.i32()], [_u32(scale, loc, ip)],
        "{\n .reg .b16 h, lo, hi;\n .reg .b32 x2, bits, ex, up;\n .reg .f32 f;\n .reg .pred p, z;\n"
        " cvt.u16.u32 h, $1;\n cvt.rn.f16x2.e4m3x2 x2, h;\n mov.b32 {lo, hi}, x2;\n cvt.f32.f16 f, lo;\n"
        " mul.f32 f, f, 0f40C00000;\n mov.b32 bits, f;\n shr.u32 ex, bits, 23;\n and.b32 up, bits, 0x7fffff;\n"
        " setp.gt.u32 p, up, 0x600000;\n selp.u32 up, 1, 0, p;\n add.u32 ex, ex, up;\n sub.u32 ex, ex, 135;\n"
        " setp.eq.u32 z, bits, 0;\n selp.u32 $0, 0, ex, z;\n}", "=r,r",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def shuffle_xor_u32(x: Uint32, mask: int, *, loc=None, ip=None) -> Uint32:
    """`shuffle_xor` of a 32-bit integer."""
    value, struct = _asm(
        [T.i32()], [_u32(x, loc, ip)], f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", "=r,r"
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def f32x2_to_e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two FP32 -> e4m3 (round to nearest even, saturating) in the low 16 bits: ``lo`` in byte 0, ``hi`` in byte 1."""
    value, struct = _asm(
        [T.i32()], [_f32(lo, loc, ip), _f32(hi, loc, ip)],
        "{\n .reg .b16 h;\n cvt.rn.satfinite.e4m3x2.f32 h, $2, $1;\n cvt.u32.u16 $0, h;\n}", "=r,f,f",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def f32x2_to_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two FP32 -> bf16x2 (round to nearest even): ``lo`` in the low half."""
    value, struct = _asm([T.i32()], [_f32(lo, loc, ip), _f32(hi, loc, ip)], "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f")
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def exp2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """2**x with the SFU (``ex2.approx.ftz``: ~2 ulp, exp2(-inf) = 0)."""
    value, struct = _asm([T.f32()], [_f32(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f")
    return _unpack(value, struct, 1, T.f32(), Float32)


@dsl_user_op
def shuffle_idx(x: Float32, lane: Uint32, *, loc=None, ip=None) -> Float32:
    """The value of ``x`` held by ``lane`` (all 32 lanes must take part)."""
    value, struct = _asm(
        [T.f32()], [_f32(x, loc, ip), _u32(lane, loc, ip)], "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r"
    )
    return _unpack(value, struct, 1, T.f32(), Float32)


@dsl_user_op
def shuffle_xor(x: Float32, mask: int, *, loc=None, ip=None) -> Float32:
    """The value of ``x`` held by lane ``lane ^ mask`` (all 32 lanes must take part)."""
    value, struct = _asm(
        [T.f32()], [_f32(x, loc, ip)], f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;", "=f,f"
    )
    return _unpack(value, struct, 1, T.f32(), Float32)


@dsl_user_op
def bits_to_f32(bits: Uint32, *, loc=None, ip=None) -> Float32:
    """Reinterpret a 32-bit pattern as FP32."""
    return Float32(llvm.bitcast(T.f32(), _u32(bits, loc, ip), loc=loc, ip=ip))


# --- cp.async (global -> shared, per thread) for the pipelined decode -------------------------------------------
# Every lane copies and later reads back only its own shared-memory words, so `cp_async_wait_group` (which covers
# the issuing thread's copies) is the only synchronisation needed: no barrier, no cross-lane hazards.


def _side_effect_asm(operands: list, text: str, constraints: str) -> None:
    llvm.inline_asm(None, operands, text, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def cp_async_16(smem_address: Int32, address: Int64, src_bytes: Uint32, *, loc=None, ip=None) -> None:
    """Copy 16 bytes global -> shared (L2 only, ``.cg``); bytes past ``src_bytes`` (16 or 0) are zero-filled, and
    with 0 nothing is read from global memory."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                      _u32(src_bytes, loc, ip)],
                     "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r")


@dsl_user_op
def cp_async_4(smem_address: Int32, address: Int64, src_bytes: Uint32, *, loc=None, ip=None) -> None:
    """Copy 4 bytes global -> shared (``.ca``: the only size class below 16 bytes); zero-filled when
    ``src_bytes`` is 0."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                      _u32(src_bytes, loc, ip)],
                     "cp.async.ca.shared.global [$0], [$1], 4, $2;", "r,l,r")


@dsl_user_op
def bulk_copy_g2s(smem_address: Int32, address: Int64, size: int, mbar_address: Int32, *, loc=None,
                  ip=None) -> None:
    """Copy ``size`` bytes (a compile-time multiple of 16; both addresses 16-byte aligned) global -> shared with one
    bulk copy (the TMA's non-tensor form, async proxy), completed as ``size`` transaction bytes on the mbarrier at
    ``mbar_address`` (which the issuing thread has armed with ``mbarrier.arrive.expect_tx``)."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                      Int32(mbar_address).ir_value(loc=loc, ip=ip)],
                     f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {size}, [$2];",
                     "r,l,r,~{memory}")


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    """Close the thread's current group of cp.async copies (an empty group is allowed)."""
    _side_effect_asm([], "cp.async.commit_group;", "")


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most ``pending`` of the thread's committed cp.async groups are still in flight."""
    _side_effect_asm([], f"cp.async.wait_group {pending};", "")


def _plus(offset: int) -> str:
    """A compile-time byte offset in a PTX address, folded into the instruction ("" for none)."""
    return f"+{offset}" if offset else ""


@dsl_user_op
def load_shared_v4_u32(smem_address: Int32, offset: int = 0, *, loc=None, ip=None) -> list:
    """16 bytes from shared memory at ``smem_address + offset`` (a compile-time offset) as 4 x u32 (ordered after
    the preceding cp.async wait)."""
    value, struct = _asm([T.i32()] * 4, [Int32(smem_address).ir_value(loc=loc, ip=ip)],
                         f"ld.shared.v4.u32 {{$0, $1, $2, $3}}, [$4{_plus(offset)}];", "=r,=r,=r,=r,r", pinned=True)
    return _unpack(value, struct, 4, T.i32(), Uint32)


@dsl_user_op
def load_shared_u32(smem_address: Int32, offset: int = 0, *, loc=None, ip=None) -> Uint32:
    """4 bytes from shared memory at ``smem_address + offset`` (a compile-time offset; ordered after the preceding
    cp.async wait)."""
    value, struct = _asm([T.i32()], [Int32(smem_address).ir_value(loc=loc, ip=ip)],
                         f"ld.shared.u32 $0, [$1{_plus(offset)}];", "=r,r", pinned=True)
    return _unpack(value, struct, 1, T.i32(), Uint32)


# --- 8x8 b16 matrices through shared memory (the fp8 prefill kernel's V transpose) ---------------------------------

@dsl_user_op
def ldmatrix_x4_trans(smem_address: Int32, *, loc=None, ip=None) -> list:
    """Four 8x8 matrices of 16-bit elements, transposed: lanes 8 i .. 8 i + 7 give the addresses of matrix i's 8
    rows (16 bytes each); register i of lane (g, c) = (lane / 4, lane % 4) holds matrix i's elements (row 2c,
    column g) in its low and (row 2c + 1, column g) in its high 16 bits."""
    value, struct = _asm([T.i32()] * 4, [Int32(smem_address).ir_value(loc=loc, ip=ip)],
                         "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                         pinned=True)
    return _unpack(value, struct, 4, T.i32(), Uint32)


@dsl_user_op
def stmatrix_x4(smem_address: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    """Four 8x8 matrices of 16-bit elements to shared memory: lanes 8 i .. 8 i + 7 give the addresses of matrix i's
    8 rows (16 bytes each); lane (g, c) gives matrix i's (row g, columns 2c, 2c + 1) in its register i (a, b, c,
    d)."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), _u32(a, loc, ip), _u32(b, loc, ip),
                      _u32(c, loc, ip), _u32(d, loc, ip)],
                     "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r")


@dsl_user_op
def f32x4_to_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Uint32:
    """Four FP32 -> e4m3 (round to nearest even, saturating): ``a`` in byte 0 .. ``d`` in byte 3."""
    value, struct = _asm(
        [T.i32()], [_f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip), _f32(d, loc, ip)],
        "{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        " mov.b32 $0, {lo, hi};\n}", "=r,f,f,f,f",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


# --- the split-KV decode: copies with immediate offsets and one predicate, operand conversions ------------------------

@dsl_user_op
def cp_async_16_at(smem_address: Int32, smem_offset: int, address: Int64, offset: int, valid: Uint32, *, loc=None,
                   ip=None) -> None:
    """`cp_async_16` of [address + offset] to [smem_address + smem_offset] (compile-time byte offsets, folded into
    the instruction); zeros, and nothing read, when ``valid`` is 0 (cp.async's ignore-src predicate)."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                      _u32(valid, loc, ip)],
                     "{\n .reg .pred p;\n setp.eq.u32 p, $2, 0;\n"
                     f" cp.async.cg.shared.global [$0+{smem_offset}], [$1+{offset}], 16, p;\n}}", "r,l,r")


@dsl_user_op
def cp_async_4_at(smem_address: Int32, smem_offset: int, address: Int64, offset: int, valid: Uint32, *, loc=None,
                  ip=None) -> None:
    """`cp_async_4` with compile-time offsets and an ignore-src predicate (see `cp_async_16_at`)."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                      _u32(valid, loc, ip)],
                     "{\n .reg .pred p;\n setp.eq.u32 p, $2, 0;\n"
                     f" cp.async.ca.shared.global [$0+{smem_offset}], [$1+{offset}], 4, p;\n}}", "r,l,r")


@dsl_user_op
def prmt_var(a: Uint32, b: Uint32, selector: Uint32, *, loc=None, ip=None) -> Uint32:
    """`prmt` with the selector held in a register (one that depends on the lane, or data): byte i of the result is
    byte ``selector`` nibble i (its low 3 bits) of {b, a}, or that byte's sign replicated where the nibble's bit 3
    is set; only the low 16 bits of ``selector`` count. With a table of 8 bytes in {b, a}: 4 look-ups by 3-bit
    index at once (the fp8 prefill kernel's e2m1 decode)."""
    value, struct = _asm([T.i32()], [_u32(a, loc, ip), _u32(b, loc, ip), _u32(selector, loc, ip)],
                         "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def e4m3x2_hi_to_f16x2(pair: Uint32, *, loc=None, ip=None) -> Uint32:
    """The two e4m3 bytes in the high 16 bits of ``pair`` -> f16x2 (byte 2 to the low half); exact."""
    value, struct = _asm(
        [T.i32()], [_u32(pair, loc, ip)],
        "{\n .reg .b16 l, h;\n mov.b32 {l, h}, $1;\n cvt.rn.f16x2.e4m3x2 $0, h;\n}", "=r,r",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def f32x2_to_e4m3x2_f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two FP32 rounded to e4m3 (nearest even, saturating), returned as the f16x2 of those e4m3 values (exact):
    ``lo`` in the low half. The FP16 MMA then computes what the e4m3 MMA would."""
    value, struct = _asm(
        [T.i32()], [_f32(lo, loc, ip), _f32(hi, loc, ip)],
        "{\n .reg .b16 h;\n cvt.rn.satfinite.e4m3x2.f32 h, $2, $1;\n cvt.rn.f16x2.e4m3x2 $0, h;\n}", "=r,f,f",
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def movmatrix_trans(a: Uint32, *, loc=None, ip=None) -> Uint32:
    """Transpose an 8x8 matrix of 16-bit elements across the warp: lane (g, c) gives (row g, columns 2c, 2c + 1)
    and gets (row g, columns 2c, 2c + 1) of the transpose (``movmatrix.sync.aligned.m8n8.trans.b16``)."""
    value, struct = _asm([T.i32()], [_u32(a, loc, ip)], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")
    return _unpack(value, struct, 1, T.i32(), Uint32)
