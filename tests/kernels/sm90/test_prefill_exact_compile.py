"""The exact prefill kernel (`prefill_exact`) compiles for sm_90a on a CPU-only machine through the launcher's path
(`compile_prefill_kernel(..., kernel="exact")`): both GEMMs on warpgroup MMA (per copy of the tile body 8 + 1
HGMMA.64x64x16 for QK, the last one Delta_S's k-step, and 4 HGMMA.64x128x16 with V^T read transposed, ``tnspB``,
for PV; no mma.sync), no local memory, registers and shared memory for 2 CTAs of 2 warpgroups per SM
(``.minnctapersm 2``), two CTA barriers per tile, no FMUL of Delta_S by 2**-7 and one FP16 store of Delta_S per
(key, head) spread over the CTA's threads; the wgmma descriptors describe the operand tiles the expansion fills.
The direct build (``compensate=False``) has no Delta_S k-step, copies and stores no Delta_S. GQA 32:8 and 40:8,
pages of 128 and 64."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90.prefill_launch import kernel_block_m  # noqa: E402
from mpfa.kernels.sm90.sass import MAX_REGISTERS, WARPGROUP, ctas_per_sm, mma_loops  # noqa: E402

CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32"),  # (KV heads, group, page, causal, out)
           (8, 5, 128, True, "BFloat16"), (8, 5, 64, False, "Float32")]
BUILDS = [(CONFIGS[0], True, "exact"), (CONFIGS[1], True, "exact"), (CONFIGS[0], False, "exact"),
          (CONFIGS[2], True, "exact"), (CONFIGS[3], True, "exact")]
IDS = ["32:8-causal-bf16-page128", "32:8-noncausal-f32-page64", "32:8-causal-bf16-page128-direct",
       "40:8-causal-bf16-page128", "40:8-noncausal-f32-page64"]
TILE_LOOPS = 2  # masked tiles, then whole tiles
DS_VALUES = {4: 64 * 4, 5: 64 * 2}  # BF16 Delta_S a tile's expansion widens, by group: (key, head) pairs; group
# 5 (one head per CTA): the 4-byte word holding the head, 2 per key


@pytest.fixture(scope="module")
def cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    return compile_builds(BUILDS, "PrefillSm90Exact", tmp_path_factory.mktemp("prefill_exact"))


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_exact_prefill_compiles_for_sm90a(cubins, cuobjdump, config, compensate, kernel):
    from mpfa.kernels.sm90.prefill_exact import PrefillSm90Exact

    cubin = str(cubins[config, compensate, kernel])
    usage = cuobjdump("--dump-resource-usage", cubin)
    assert re.search(r"LOCAL:0\b", usage), f"the exact prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    launcher = PrefillSm90Exact(*config, compensate=compensate)
    assert launcher.threads == 2 * WARPGROUP and launcher.block_m == kernel_block_m(config[1], kernel)
    smem = launcher.smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    assert registers <= MAX_REGISTERS and ctas_per_sm(registers, launcher.threads, smem) >= 2, (registers, smem)
    ptx = Path(cubin).with_suffix(".ptx").read_text(errors="replace")
    assert re.search(r"\.minnctapersm\s+2\b", ptx)

    sass = cuobjdump("--dump-sass", cubin)
    assert "HMMA" not in sass.replace("HGMMA", ""), "the exact kernel should have no mma.sync"
    loops = mma_loops(sass)
    assert len(loops) == TILE_LOOPS, [len(body) for body in loops]
    for body in loops:
        assert not any(op.startswith(("STL", "LDL")) for op in body), "local memory traffic in the tile loop"
        qk = [op for op in body if op.startswith("HGMMA.64x64x16.F32")]
        pv = [op for op in body if op.startswith("HGMMA.64x128x16.F32") and "tnspB" in op]
        assert len(qk) == (9 if compensate else 8) and len(pv) == 4, body
        assert sum(op.startswith("HGMMA") for op in body) == len(qk) + len(pv)
        assert not any(op.startswith("FMUL") and op.endswith(", 0.0078125") for op in body), \
            "Delta_S should not be scaled into the accumulator"
        stores = sum(op.startswith("STS.U16") for op in body)
        assert stores == (-(-DS_VALUES[config[1]] // launcher.threads) if compensate else 0), body
        assert sum(op.startswith("BAR.SYNC") for op in body) == 2, "a tile needs its two CTA barriers"


def test_direct_build_copies_no_delta_s(cubins, cuobjdump):
    """``compensate=False`` (`CONFIGS[0]`): the compensated build's K / V / scale copies, less shared memory, no
    fewer CTAs per SM, and none of its Delta_S copies (4-byte cp.async, one per 32-key half of a copied tile)."""
    from mpfa.kernels.sm90.prefill_exact import PrefillSm90Exact

    counts = {}
    for compensate in (True, False):
        cubin = str(cubins[CONFIGS[0], compensate, "exact"])
        sass = cuobjdump("--dump-sass", cubin)
        launcher = PrefillSm90Exact(*CONFIGS[0], compensate=compensate)
        registers = int(re.search(r"REG:(\d+)", cuobjdump("--dump-resource-usage", cubin))[1])
        counts[compensate] = dict(
            copies=Counter(next((part for part in op.split(".") if part in ("64", "128")), "32")  # bits per copy
                           for op in re.findall(r"\bLDGSTS[\w.]*", sass)),
            smem=launcher.smem_bytes, ctas=ctas_per_sm(registers, launcher.threads, launcher.smem_bytes))
    full, direct = counts[True], counts[False]
    assert direct["smem"] < full["smem"] and direct["ctas"] >= full["ctas"], counts
    kept = Counter({bits: n for bits, n in full["copies"].items() if bits != "32"})
    assert full["copies"]["32"] > 0 and direct["copies"] == kept, counts


def _descriptor(value: int) -> tuple:
    """The fields of a wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"), bytes."""
    fields = {"start": (value & 0x3FFF) << 4, "lbo": ((value >> 16) & 0x3FFF) << 4,
              "sbo": ((value >> 32) & 0x3FFF) << 4, "base": (value >> 49) & 7, "swizzle": value >> 62}
    return tuple(sorted(fields.items()))


QK_DESCRIPTOR = _descriptor(1 << 62 | (1024 >> 4) << 32 | (16 >> 4) << 16)  # K-major SW128 (LBO unused)
VT_DESCRIPTOR = _descriptor(1 << 62 | (1024 >> 4) << 32 | (8192 >> 4) << 16)  # MN-major SW128


@pytest.mark.parametrize("compensate", [True, False], ids=["compensated", "direct"])
def test_wgmma_descriptors_match_operand_tiles(cubins, compensate):
    """The descriptors CuTe builds (constant fields OR-ed onto the tile address, then per-k-step start advances, in
    16-byte units) describe the operand tiles `operand_offset` fills: Q and K K-major 128-byte swizzle (SBO 1024 =
    8 rows x 128 bytes; k-steps at +32, +64, +96 bytes, then the second 64-dim half at +8192); V^T MN-major
    128-byte swizzle (LBO 8192 = the second 64-dim half, SBO 1024 = 8 keys; k-steps of 16 keys at +2048 bytes);
    QK untransposed, PV with ``tnspB``; tiles 1024-byte aligned (base offset 0)."""
    ptx = cubins[CONFIGS[0], compensate, "exact"].with_suffix(".ptx").read_text(errors="replace")
    fields = {_descriptor(int(v)) for v in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);", ptx) if int(v) >> 62}
    assert fields == {QK_DESCRIPTOR, VT_DESCRIPTOR}, fields
    steps = {int(v) for v in re.findall(r"(?:add\.s32|or\.b32)\s+%r\d+, %r\d+, (\d+);\n\s*mov\.b64\s+%rd", ptx)}
    assert steps == {2, 4, 6, 512, 514, 516, 518} | {128, 256, 384}, steps
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16 [^;]*, p, ([^;]*);", ptx)
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.f16\.f16 [^;]*\}, %rd\d+, p, ([^;]*);", ptx)
    assert qk and {re.sub(r"\s", "", x) for x in qk} == {"1,1,0,0"}  # scale-a, scale-b, tnsp-a, tnsp-b
    assert pv and {re.sub(r"\s", "", x) for x in pv} == {"1,1,1"}  # A from registers: scale-a, scale-b, tnsp-b
