"""The FP8-QK prefill (v4, `prefill_wgmma_fp8qk`) on a CPU-only machine: it compiles for sm_90a through the launcher
(`compile_prefill_kernel(..., kernel="v4" / "v4w8")`) with QK on e4m3 wgmma (per tile body 4 QGMMA.64x64x32 E4M3)
and PV unchanged (4 HGMMA.64x128x16 with ``tnspB``), no local memory, registers and shared memory for v3's
occupancy; its e4m3 operand-tile mapping is CuTe's; the requantization it does (exponent from the NVFP4 block
scales, two exact power-of-two steps on the block scale in FP16, e4m3 per pair) is `formats.fake_quant_fp8_pow2`
per query row and per 64-key tile, bit for bit (a torch model of the kernel's arithmetic); the switch and the
benchmark backend."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels import formats  # noqa: E402
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
BUILDS = ([(config, True, "v4") for config in CONFIGS] + [(CONFIGS[0], False, "v4")]
          + [(CONFIGS[0], True, "v4w8"), (CONFIGS[0], False, "v4w8")])
IDS = ["causal-bf16-page128", "noncausal-f32-page64", "causal-bf16-page128-direct", "v4w8-causal-bf16-page128",
       "v4w8-causal-bf16-page128-direct"]
WARPGROUPS = {"v4": 1, "v4w8": 2}
# CTAs per SM: v4 2 (8 warps; shared memory allows no third), v4w8 2 (16 warps: 2 x 92 KB fit, and <= 128 registers
# per thread let 2 x 256 threads share the register file; measured 1.4x v3 at 64K, where v3 / v3w8 / v4 hold 8 warps)
CTAS_PER_SM = {"v4": 2, "v4w8": 2}
TILE_LOOPS = 2  # masked tiles, then whole tiles


@pytest.fixture(scope="module")
def v4_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    """One cubin (and its PTX beside it) per build."""
    return compile_builds(BUILDS, "PrefillSm90WgmmaFp8Qk", tmp_path_factory.mktemp("prefill_v4"))


def _launcher(config, compensate, kernel):
    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import PrefillSm90WgmmaFp8Qk

    return PrefillSm90WgmmaFp8Qk(*config, compensate=compensate, warpgroups=WARPGROUPS[kernel])


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_v4_prefill_compiles_for_sm90a(v4_cubins, cuobjdump, config, compensate, kernel):
    cubin = str(v4_cubins[config, compensate, kernel])
    usage = cuobjdump("--dump-resource-usage", cubin)
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the {kernel} prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    launcher = _launcher(config, compensate, kernel)
    smem = launcher.smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    fits = ctas_per_sm(registers, WARPGROUP * WARPGROUPS[kernel], smem)
    assert registers <= MAX_REGISTERS and fits >= CTAS_PER_SM[kernel], \
        f"{registers} registers and {smem} B of shared memory per CTA: {fits} CTAs per SM, not {CTAS_PER_SM[kernel]}"
    # e4m3 Q / K tiles: 8 KB each, 16 KB less than v3's operand tiles (v4w8: 24 KB)
    from mpfa.kernels.sm90.prefill_wgmma import PrefillSm90Wgmma
    v3 = PrefillSm90Wgmma(*config, compensate=compensate, warpgroups=WARPGROUPS[kernel])
    assert v3.offsets[3] - launcher.offsets[3] == 8192 * (WARPGROUPS[kernel] + 1)

    sass = cuobjdump("--dump-sass", cubin)
    qk = re.findall(r"QGMMA\.64x64x32\.F32\.E4M3\.E4M3[^;]*", sass)
    pv = re.findall(r"HGMMA\.64x128x16\.F32 [^;]*tnspB", sass)
    copies = len(pv) // 4
    assert copies >= TILE_LOOPS and len(pv) == 4 * copies and len(qk) == 4 * copies, (qk, pv)
    assert len(re.findall(r"\b[QH]GMMA\.", sass)) == len(qk) + len(pv)
    assert "HMMA" not in sass.replace("HGMMA", ""), f"{kernel} should have no mma.sync left"
    loops = mma_loops(sass)
    assert len(loops) == TILE_LOOPS, [len(body) for body in loops]
    for body in loops:
        assert sum(op.startswith("QGMMA.64x64x32") for op in body) == 4, body
        assert sum(op.startswith("HGMMA.64x128x16") and "tnspB" in op for op in body) == 4, body
        assert sum(op.startswith("BAR.SYNC") for op in body) == 2, "a tile needs its two CTA barriers"
        # K requantization: e4m3 pairs from f16x2 (16 per K chunk: v4 2 chunks per thread, v4w8 1)
        cvt = sum("F2FP.SATFINITE.E4M3.F16" in op for op in body)
        assert cvt == 32 // WARPGROUPS[kernel], cvt


def test_v4_expands_half_the_k_bytes(v4_cubins, cuobjdump):
    """v4 (`CONFIGS[0]`): the e4m3 K chunk is 2 STS.128 (v3's FP16 one 4); V's 4 pieces x 2 as v3: 12 per tile."""
    sass = cuobjdump("--dump-sass", str(v4_cubins[CONFIGS[0], True, "v4"]))
    for body in mma_loops(sass):
        assert sum(op.startswith("STS.128") for op in body) == 2 * 2 + 4 * 2, body


def test_fp8_operand_offset_is_cutes_layout():
    """`fp8_operand_offset` (where the expansion stores a 16-byte unit) is CuTe's swizzled e4m3 wgmma layout of the
    tile: the layout's element (= byte) offset with the 128-byte swizzle (bits 4-6 ^= bits 7-9) applied."""
    import cutlass
    import cutlass.cute as cute

    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import (FP8_ROW_UNITS, HEAD_DIM, TILE_KEYS, fp8_operand_layout,
                                                        fp8_operand_offset)

    found = []

    @cute.jit
    def trace():
        layout = fp8_operand_layout()
        found.append(str(layout.inner))
        found.append(cute.cosize(layout.outer))
        for row in cutlass.range_constexpr(TILE_KEYS):
            for unit in cutlass.range_constexpr(FP8_ROW_UNITS):
                for byte in cutlass.range_constexpr(0, 16, 5):
                    offset = layout.outer((row, 16 * unit + byte))
                    found.append((offset ^ (((offset >> 7) & 7) << 4)) == fp8_operand_offset(row, unit) + byte)

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    trace()
    assert found[0] == "S<3,4,3>" and found[1] == TILE_KEYS * HEAD_DIM, found[:2]
    assert len(found) == 2 + TILE_KEYS * FP8_ROW_UNITS * 4 and all(found[2:])


def _descriptor(value: int) -> dict:
    return {"start": (value & 0x3FFF) << 4, "lbo": ((value >> 16) & 0x3FFF) << 4,
            "sbo": ((value >> 32) & 0x3FFF) << 4, "base": (value >> 49) & 7, "swizzle": value >> 62}


def test_v4_descriptors(v4_cubins):
    """QK's descriptors: K-major 128-byte swizzle (SBO 1024 = 8 rows x 128 bytes), k-steps of 32 bytes in one
    128-byte row; the e4m3 wgmma is m64n64k32 untransposed; PV's as v3."""
    ptx = v4_cubins[CONFIGS[0], True, "v4"].with_suffix(".ptx").read_text(errors="replace")
    fields = {tuple(sorted(_descriptor(int(v)).items()))
              for v in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);", ptx) if int(v) >> 62 == 1}
    assert tuple(sorted(dict(start=0, lbo=16, sbo=1024, base=0, swizzle=1).items())) in fields, fields
    assert tuple(sorted(dict(start=0, lbo=8192, sbo=1024, base=0, swizzle=1).items())) in fields, fields
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3 [^;]*, p, ([^;]*);", ptx)
    assert qk and {re.sub(r"\s", "", x) for x in qk} == {"1,1"}, qk  # scale-a, scale-b (no transpose for FP8)
    assert "m64n64k16" not in ptx


# --- the requantization, modelled on the CPU ------------------------------------------------------------------------

def _kernel_requantize(values: torch.Tensor, group_dims: tuple) -> torch.Tensor:
    """What the kernel computes from NVFP4 ``values`` (FP32, last dim a multiple of 16) requantized with one
    power-of-two scale per group (``group_dims``): the exponent from the group's largest block scale
    (`exponent_from_scale`), the block scale times 2**-e in two FP16 power-of-two steps (`factor_exponents`), e2m1
    times that in FP16, e4m3 (round to nearest even, saturating), times 2**e."""
    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import exponent_from_scale, factor_exponents

    t = formats.quantize_nvfp4(values)
    codes = formats.decode_e2m1(formats.unpack_e2m1(t.codes)).unflatten(-1, (-1, 16))
    scales = t.scales.float()  # [..., blocks]
    top = scales.abs().amax(dim=group_dims, keepdim=True)
    e = torch.tensor([exponent_from_scale(x) for x in top.flatten().tolist()]).reshape(top.shape)
    steps = [factor_exponents(x) for x in e.flatten().tolist()]
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
    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import exponent_from_scale

    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    reference = formats.e4m3_pow2_scale((6 * scales).unsqueeze(-1)).squeeze(-1)
    assert [exponent_from_scale(float(s)) for s in scales] == torch.log2(reference).int().tolist()
    assert exponent_from_scale(0.0) == 0


# --- the switch ----------------------------------------------------------------------------------------------------

def test_v4_is_opt_in(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert prefill_kernel(32, 8, 128) == "v7i" and prefill_kernel(32, 8, 128, "V4") == "v4"
    assert prefill_kernel(32, 8, 128, "v4w8") == "v4w8"
    assert kernel_block_m(4, "v4") == 16 and kernel_block_m(4, "v4w8") == 32
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v4")
    assert prefill_kernel(32, 8, 128) == prefill_kernel(40, 8, 128) == "v4"


@pytest.mark.parametrize("kernel", WARPGROUPS)
def test_v4_limits_are_clear_errors(kernel):
    with pytest.raises(ValueError, match="group 4 only"):
        compile_prefill_kernel(8, 5, 128, True, "BFloat16", kernel=kernel)
    with pytest.raises(ValueError, match="page_size >= 64"):
        compile_prefill_kernel(8, 4, 32, True, "BFloat16", kernel=kernel)


def test_bench_backend_pins_v4():
    from mpfa.profiles.registry import adapter_for

    assert adapter_for("mpfa-v4").prefill_kernel == "v4" and adapter_for("mpfa-v4w8").prefill_kernel == "v4w8"
