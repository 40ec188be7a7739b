"""Inline-PTX pieces of a CTA-wide cp.async (global -> shared) ring, beside `ptx` (which has the 16- and 4-byte
copies, commit / wait and the shared-memory vector loads): an 8-byte copy, a 16-bit shared-memory load, a 16-byte
shared-memory store and a predicated 32-bit global load. Every shared-memory access is ``pinned`` (a side effect
for LLVM), so it stays ordered with the cp.async waits and the CTA barriers around it.
"""

from __future__ import annotations

from cutlass import Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from .ptx import _asm, _side_effect_asm, _u32, _unpack


@dsl_user_op
def cp_async_8(smem_address: Int32, address: Int64, src_bytes: Uint32, *, loc=None, ip=None) -> None:
    """Copy 8 bytes global -> shared (``.ca``); zero-filled and nothing read when ``src_bytes`` is 0."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                      _u32(src_bytes, loc, ip)],
                     "cp.async.ca.shared.global [$0], [$1], 8, $2;", "r,l,r")


@dsl_user_op
def load_shared_u16(smem_address: Int32, *, loc=None, ip=None) -> Uint32:
    """2 bytes from shared memory, zero-extended (ordered after the preceding cp.async wait and barrier)."""
    value, struct = _asm([T.i32()], [Int32(smem_address).ir_value(loc=loc, ip=ip)], "ld.shared.u16 $0, [$1];",
                         "=r,r", pinned=True)
    return _unpack(value, struct, 1, T.i32(), Uint32)


@dsl_user_op
def load_u32_if(address: Int64, predicate: Uint32, *, loc=None, ip=None) -> Uint32:
    """A 32-bit global load (read-only path) issued where the kernel places it; 0 when ``predicate`` is 0 (nothing
    is read)."""
    value, struct = _asm(
        [T.i32()],
        [Int64(address).ir_value(loc=loc, ip=ip), _u32(predicate, loc, ip)],
        "{\n .reg .pred p;\n setp.ne.u32 p, $2, 0;\n mov.b32 $0, 0;\n @p ld.global.nc.u32 $0, [$1];\n}",
        "=&r,l,r",
        pinned=True,
    )
    return _unpack(value, struct, 1, T.i32(), Uint32)




@dsl_user_op
def store_shared_v4_u32(smem_address: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    """16 bytes to shared memory."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), _u32(a, loc, ip), _u32(b, loc, ip),
                      _u32(c, loc, ip), _u32(d, loc, ip)],
                     "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r")


@dsl_user_op
def store_shared_v2_u32(smem_address: Int32, a: Uint32, b: Uint32, *, loc=None, ip=None) -> None:
    """8 bytes to shared memory."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), _u32(a, loc, ip), _u32(b, loc, ip)],
                     "st.shared.v2.b32 [$0], {$1, $2};", "r,r,r")


@dsl_user_op
def store_shared_u32(smem_address: Int32, a: Uint32, *, loc=None, ip=None) -> None:
    """4 bytes to shared memory."""
    _side_effect_asm([Int32(smem_address).ir_value(loc=loc, ip=ip), _u32(a, loc, ip)], "st.shared.u32 [$0], $1;",
                     "r,r")
