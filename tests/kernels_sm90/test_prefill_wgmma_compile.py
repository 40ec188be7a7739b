"""The wgmma prefill (v3, `prefill_wgmma`) compiles for sm_90a on a CPU-only machine through the launcher's path
(`compile_prefill_kernel(..., kernel="v3")`): both GEMMs on warpgroup MMA (per copy of the tile body 8
HGMMA.64x64x16 for QK and 4 HGMMA.64x128x16 with V^T read transposed, ``tnspB``, for PV; no mma.sync), no local
memory, registers and shared memory that leave 2 CTAs (2 warpgroups) per SM; the direct build
(``compensate=False``) without Delta_S copies or reads. v3w8 (``kernel="v3w8"``, 2 warpgroups per CTA): the same
per tile body and warpgroup, 2 CTAs (4 warpgroups) per SM, half of v3's K / V expansion stores per thread.
Also the switch, v3's limits (GQA group 4, pages of >= 64 keys), the operand-tile layout against CuTe's, and the
benchmark backends."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_launch  # noqa: E402
from mpfa.kernels.sm90.sass import (  # noqa: E402
    MAX_REGISTERS,
    WARPGROUP,
    ctas_per_sm,
    instructions,
    mma_loops,
)
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m, prefill_kernel  # noqa: E402

CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32")]  # (KV heads, group, page, causal, out)
# (configuration, compensate, kernel); v3w8 causal, compensated and direct
BUILDS = ([(config, True, "v3") for config in CONFIGS] + [(CONFIGS[0], False, "v3")]
          + [(CONFIGS[0], True, "v3w8"), (CONFIGS[0], False, "v3w8")])
IDS = ["causal-bf16-page128", "noncausal-f32-page64", "causal-bf16-page128-direct", "v3w8-causal-bf16-page128",
       "v3w8-causal-bf16-page128-direct"]
WARPGROUPS = {"v3": 1, "v3w8": 2}
# CTAs per SM: v3 2 (8 warps), v3w8 2 (16 warps: a 2-stage ring, 90 KB, and ptxas bounded to 128 registers)
CTAS_PER_SM = {"v3": 2, "v3w8": 2}
# bytes of stack allowed: v3w8, bounded to 128 registers, parks up to 16 B before the tile loops (never touched
# inside them: checked below; 8 before P's 448 moved into the exponent, session 19)
STACK_BYTES = {"v3": 0, "v3w8": 16}
TILE_LOOPS = 2  # masked tiles, then whole tiles


@pytest.fixture(scope="module")
def wgmma_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    """One cubin (and its PTX beside it) per build."""
    return compile_builds(BUILDS, "PrefillSm90Wgmma", tmp_path_factory.mktemp("prefill_wgmma"))


def _launcher(config, compensate, kernel):
    from mpfa.kernels.sm90.prefill_wgmma import PrefillSm90Wgmma

    return PrefillSm90Wgmma(*config, compensate=compensate, warpgroups=WARPGROUPS[kernel])


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_wgmma_prefill_compiles_for_sm90a(wgmma_cubins, cuobjdump, config, compensate, kernel):
    cubin = str(wgmma_cubins[config, compensate, kernel])
    usage = cuobjdump("--dump-resource-usage", cubin)
    assert re.search(r"LOCAL:0\b", usage) and int(re.search(r"STACK:(\d+)", usage).group(1)) <= STACK_BYTES[kernel], \
        f"the {kernel} prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    smem = _launcher(config, compensate, kernel).smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    fits = ctas_per_sm(registers, WARPGROUP * WARPGROUPS[kernel], smem)
    assert registers <= MAX_REGISTERS and fits >= CTAS_PER_SM[kernel], \
        f"{registers} registers and {smem} B of shared memory per CTA: {fits} CTAs per SM, not {CTAS_PER_SM[kernel]}"

    sass = cuobjdump("--dump-sass", cubin)
    hgmma = re.findall(r"HGMMA\.(\d+x\d+x\d+)\.F32[^;]*", sass)
    qk = [op for op in hgmma if op.startswith("64x64x16")]
    pv = re.findall(r"HGMMA\.64x128x16\.F32 [^;]*tnspB", sass)
    # 8 + 4 per copy of the tile body: one per tile loop, or more where ptxas duplicates a loop body
    copies = len(pv) // 4
    assert copies >= TILE_LOOPS and len(pv) == 4 * copies and len(qk) == 8 * copies, hgmma
    assert len(hgmma) == len(qk) + len(pv), hgmma
    assert "HMMA" not in sass.replace("HGMMA", ""), f"{kernel} should have no mma.sync left"
    # per tile loop (masked, whole) and warpgroup: 8 QK and 4 PV wgmmas, between CTA barriers
    loops = mma_loops(sass)
    assert len(loops) == TILE_LOOPS, [len(body) for body in loops]
    for body in loops:
        assert not any(op.startswith(("STL", "LDL")) for op in body), "local memory traffic in the tile loop"
        assert sum(op.startswith("HGMMA.64x64x16") for op in body) == 8, body
        assert sum(op.startswith("HGMMA.64x128x16") and "tnspB" in op for op in body) == 4, body
        assert sum(op.startswith("BAR.SYNC") for op in body) == 2, "a tile needs its two CTA barriers"


def test_v3w8_shares_the_expansion(wgmma_cubins, cuobjdump):
    """v3w8 (`CONFIGS[0]`): the same wgmmas per tile loop as v3; each thread half of v3's expanded K / V stores
    (v3: 2 K chunks x 4 + 4 V pieces x 2 STS.128 per tile) and half of its ring copies (a warpgroup copies one
    32-key half: v2's 4-warp plan, 5 cp.async per thread, v3 2 x 5); fewer instructions per tile and thread."""
    stats = {}
    for kernel in WARPGROUPS:
        sass = cuobjdump("--dump-sass", str(wgmma_cubins[CONFIGS[0], True, kernel]))
        loops = mma_loops(sass)
        stats[kernel] = dict(
            sts=[sum(op.startswith("STS.128") for op in body) for body in loops],
            copies=[sum(op.startswith("LDGSTS") or " LDGSTS" in op for op in body) for body in loops],
            hgmma=[sum(op.startswith("HGMMA") for op in body) for body in loops],
            size=[len(body) for body in loops])
    v3, v3w8 = stats["v3"], stats["v3w8"]
    assert v3w8["hgmma"] == v3["hgmma"] == [12] * TILE_LOOPS, stats
    assert v3["sts"] == [16] * TILE_LOOPS and v3w8["sts"] == [8] * TILE_LOOPS, stats
    assert v3["copies"] == [10] * TILE_LOOPS and v3w8["copies"] == [5] * TILE_LOOPS, stats
    assert all(a < b for a, b in zip(v3w8["size"], v3["size"])), stats


@pytest.mark.parametrize("kernel", WARPGROUPS)
def test_direct_build_copies_and_reads_no_delta_s(wgmma_cubins, cuobjdump, kernel):
    """``compensate=False`` (`CONFIGS[0]`): the compensated build's HGMMAs and K / V / scale copies, no fewer CTAs
    per SM, less shared memory, and none of its Delta_S copies (4-byte cp.async, one per 32-key half of a copied
    tile) or reads (16 LDS.U16 per copy of the tile body; the 2 of the K scales stay)."""
    counts = {}
    for compensate in (True, False):
        cubin = str(wgmma_cubins[CONFIGS[0], compensate, kernel])
        sass = cuobjdump("--dump-sass", cubin)
        copies = Counter(next((part for part in op.split(".") if part in ("64", "128")), "32")  # bits per copy
                         for op in re.findall(r"\bLDGSTS[\w.]*", sass))
        counts[compensate] = dict(
            hgmma=len(re.findall(r"\bHGMMA\.", sass)), pv=len(re.findall(r"HGMMA\.64x128x16\.F32 [^;]*tnspB", sass)),
            lds16=len(re.findall(r"\bLDS\.U16\b", sass)), copies=copies,
            registers=int(re.search(r"REG:(\d+)", cuobjdump("--dump-resource-usage", cubin))[1]),
            smem=_launcher(CONFIGS[0], compensate, kernel).smem_bytes)
    full, direct = counts[True], counts[False]

    def ctas(build: dict) -> int:
        return ctas_per_sm(build["registers"], WARPGROUP * WARPGROUPS[kernel], build["smem"])

    # no fewer CTAs per SM
    assert direct["hgmma"] == full["hgmma"] and ctas(direct) >= ctas(full), counts
    assert direct["smem"] < full["smem"], counts
    kept = Counter({bits: n for bits, n in full["copies"].items() if bits != "32"})
    assert full["copies"]["32"] > 0 and direct["copies"] == kept, counts
    # PV: 4 HGMMAs per tile body; a v3w8 thread expands 1 K chunk (1 LDS.U16 of its scales) per tile, v3 2
    k_scales = 2 // WARPGROUPS[kernel]
    assert full["lds16"] - direct["lds16"] == 16 * full["pv"] // 4, counts
    assert direct["lds16"] == k_scales * direct["pv"] // 4, counts


@pytest.mark.parametrize("group", [4, 5, 2])
def test_tile_rows_are_the_staged_ctas_warps(group):
    """A 64-row wgmma tile's rows (`tile_row_query`) cover each (query row, head) of the warpgroup once, and row
    16 w + i is warp w's row i in v2's CTA (head ``w % heads``, rows from ``16 (w // heads)``)."""
    from mpfa.kernels.sm90.prefill_staged_layout import cta_shape, warpgroup_rows
    from mpfa.kernels.sm90.prefill_wgmma import tile_row_query

    heads = cta_shape(group)[0]
    coords = [tile_row_query(row, heads) for row in range(64)]
    assert sorted(coords) == [(q, h) for q in range(warpgroup_rows(group)) for h in range(heads)]
    for row, (query, head) in enumerate(coords):
        warp = row // 16
        assert (head, query - row % 16) == (warp % heads, 16 * (warp // heads))


def test_operand_offset_is_cutes_layout():
    """`operand_offset` (where the expansion stores a 16-byte chunk) is CuTe's swizzled wgmma layout of the tile:
    the layout's element offset, in bytes, with the 128-byte swizzle (bits 4-6 ^= bits 7-9) applied."""
    import cutlass
    import cutlass.cute as cute

    from mpfa.kernels.sm90.prefill_wgmma import HEAD_DIM, TILE_KEYS, operand_layout, operand_offset

    found = []

    @cute.jit
    def trace():
        layout = operand_layout()
        found.append(str(layout.inner))
        for row in cutlass.range_constexpr(TILE_KEYS):
            for chunk in cutlass.range_constexpr(HEAD_DIM // 8):
                offset = 2 * layout.outer((row, 8 * chunk))
                found.append((offset ^ (((offset >> 7) & 7) << 4)) == operand_offset(row, chunk))

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    trace()
    assert found[0] == "S<3,4,3>" and len(found) == 1 + TILE_KEYS * HEAD_DIM // 8 and all(found[1:])


def _descriptor(value: int) -> dict:
    """The fields of a wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"), bytes."""
    return {"start": (value & 0x3FFF) << 4, "lbo": ((value >> 16) & 0x3FFF) << 4,
            "sbo": ((value >> 32) & 0x3FFF) << 4, "base": (value >> 49) & 7, "swizzle": value >> 62}


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_wgmma_descriptors_match_operand_tiles(wgmma_cubins, config, compensate, kernel):
    """The descriptors CuTe builds (constant fields OR-ed onto the tile address, then per-k-step start advances, in
    16-byte units) describe the operand tiles `operand_offset` fills: Q and K K-major 128-byte swizzle (SBO 1024 =
    8 rows x 128 bytes; k-steps at +32, +64, +96 bytes, then the second 64-dim half at +8192); V^T MN-major
    128-byte swizzle (LBO 8192 = the second 64-dim half, SBO 1024 = 8 keys; k-steps of 16 keys at +2048 bytes);
    QK untransposed, PV with ``tnspB``; tiles 1024-byte aligned (base offset 0; v3w8's second Q tile too)."""
    ptx = wgmma_cubins[config, compensate, kernel].with_suffix(".ptx").read_text(errors="replace")
    fields = [_descriptor(int(v)) for v in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);", ptx)
              if int(v) >> 62 == 1]
    assert {tuple(sorted(f.items())) for f in fields} == {
        tuple(sorted(dict(start=0, lbo=16, sbo=1024, base=0, swizzle=1).items())),  # Q, K (K-major; LBO unused)
        tuple(sorted(dict(start=0, lbo=8192, sbo=1024, base=0, swizzle=1).items())),  # V^T (MN-major)
    }, fields
    steps = {int(v) for v in re.findall(r"(?:add\.s32|or\.b32)\s+%r\d+, %r\d+, (\d+);\n\s*mov\.b64\s+%rd", ptx)}
    assert steps == {2, 4, 6, 512, 514, 516, 518} | {128, 256, 384}, steps
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16 [^;]*, p, ([^;]*);", ptx)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.f16\.f16 [^;]*\}, %rd\d+, p, ([^;]*);", ptx)
    assert qk and {re.sub(r"\s", "", x) for x in qk} == {"1,1,0,0"}  # scale-a, scale-b, tnsp-a, tnsp-b
    assert pv and {re.sub(r"\s", "", x) for x in pv} == {"1,1,1"}  # A from registers: scale-a, scale-b, tnsp-b


def test_v7i_is_the_default_where_it_applies(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert prefill_kernel(32, 8, 128) == prefill_kernel(32, 8, 64) == "v7i" and kernel_block_m(4, "v3") == 16
    assert prefill_kernel(40, 8, 128) == prefill_kernel(40, 8, 64) == "v7i" and kernel_block_m(5, "v3") == 64
    assert prefill_kernel(32, 8, 256) == "v7i" and kernel_block_m(5, "v3w8c") == 128  # group 5: 1 head x 64 rows
    assert prefill_kernel(32, 8, 32) == prefill_kernel(40, 8, 32) == "v2"  # pages < 64: v2
    assert prefill_kernel(24, 8, 128) == prefill_kernel(64, 8, 128) == "v2"  # groups 3, 8: v2
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v2")
    assert prefill_kernel(32, 8, 128) == "v2" and prefill_kernel(32, 8, 128, "V3") == "v3"
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v3")  # pinned: other shapes fail clearly when compiled
    assert prefill_kernel(40, 8, 128) == "v3"


def test_each_prefill_kernel_says_which_numerics_it_computes():
    from mpfa.kernels.sm90.prefill_launch import PRE_KERNELS, WGMMA_WARPGROUPS, prefill_numerics

    paper = ["v1", "v2", "v2w8", "v3", "v3w8", "v3c", "v3w8c"]
    assert {prefill_numerics(k) for k in paper} == {"mpfa"}
    assert prefill_numerics(prefill_launch.WGMMA_KERNEL) == "mpfa-qk8tile-psum"  # the default: v7i
    psum = ["v6n", *PRE_KERNELS]  # the row sums on the PV wgmma: l sums the e4m3 P
    fp8_qk = [k for k in WGMMA_WARPGROUPS if k not in paper + psum]
    assert "v4" in fp8_qk and "v6i" in fp8_qk and {prefill_numerics(k) for k in fp8_qk} == {"mpfa-qk8tile"}
    assert {prefill_numerics(k) for k in psum} == {"mpfa-qk8tile-psum"}


def test_v3_and_v3w8_when_named(monkeypatch: pytest.MonkeyPatch):
    """Named (``kernel=`` or ``MPFA_PREFILL_KERNEL``), v3 / v3w8 apply also to an odd number of query heads (then
    refused at compile time); v3w8 runs 32 query rows per CTA."""
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert prefill_kernel(32, 8, 128, "V3") == "v3" and prefill_kernel(32, 8, 128, "V3W8") == "v3w8"
    assert kernel_block_m(4, "v3w8") == 32 == 2 * kernel_block_m(4, "v3")
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v3w8")
    assert prefill_kernel(32, 8, 128) == prefill_kernel(40, 8, 128) == prefill_kernel(35, 7, 128) == "v3w8"
    assert prefill_kernel(32, 8, 128, "v3") == "v3"


@pytest.mark.parametrize("kernel", WARPGROUPS)
def test_v3_limits_are_clear_errors(kernel):
    with pytest.raises(ValueError, match=f"the {kernel} .*group 4 or 5 only .*got group 3"):
        compile_prefill_kernel(8, 3, 128, True, "BFloat16", kernel=kernel)
    with pytest.raises(ValueError, match="page_size >= 64"):
        compile_prefill_kernel(8, 4, 32, True, "BFloat16", kernel=kernel)


def test_bench_backend_pins_v3():
    from mpfa.profiles.registry import adapter_for

    assert adapter_for("mpfa-v3").prefill_kernel == "v3" and adapter_for("mpfa-v3w8").prefill_kernel == "v3w8"
