"""The FP8-PV prefill (v5, `prefill_wgmma_fp8pv`) on a CPU-only machine: it compiles for sm_90a through the
launcher (`compile_prefill_kernel(..., kernel="v5" / "v5w8")`) with both GEMMs on e4m3 wgmma (per tile body 4
QGMMA.64x64x32 for QK and 2 x 2 QGMMA.64x64x32 with A from registers for PV, no HGMMA), the V transpose as 2
LDSM.T + 2 STSM per v5w8 thread and no FP8 -> FP16 V conversion, registers and shared memory for the CTAs per SM
the design needs (v5w8: 2 CTAs of 256 threads, ``.minnctapersm 2``), the switch and the benchmark backends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_launch  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m, prefill_kernel  # noqa: E402
from mpfa.kernels.sm90.sass import MAX_REGISTERS, WARPGROUP, ctas_per_sm, mma_loops  # noqa: E402

CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32")]  # (KV heads, group, page, causal, out)
BUILDS = [(CONFIGS[0], True, "v5"), (CONFIGS[1], True, "v5"), (CONFIGS[0], True, "v5w8"),
          (CONFIGS[0], False, "v5w8"), (CONFIGS[1], True, "v5w8")]
IDS = ["v5-causal-bf16-page128", "v5-noncausal-f32-page64", "v5w8-causal-bf16-page128",
       "v5w8-causal-bf16-page128-direct", "v5w8-noncausal-f32-page64"]
WARPGROUPS = {"v5": 1, "v5w8": 2}
CTAS_PER_SM = {"v5": 2, "v5w8": 2}  # v5w8: 16 warps per SM, v4w8's occupancy (the reason v4w8 is 1.41x v3)
# Stack bytes: v5w8 at 128 registers (.minnctapersm 2; unbounded ptxas takes 173) parks 5 values the epilogue needs
# (24 B) in local memory before the tile loops: stored and reloaded once per thread, never inside a loop
STACK_BYTES = {"v5": 0, "v5w8": 24}
TILE_LOOPS = 2  # masked tiles, then whole tiles


@pytest.fixture(scope="module")
def v5_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    return compile_builds(BUILDS, "PrefillSm90WgmmaFp8Pv", tmp_path_factory.mktemp("prefill_v5"))


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_v5_prefill_compiles_for_sm90a(v5_cubins, cuobjdump, config, compensate, kernel):
    from mpfa.kernels.sm90.prefill_wgmma_fp8pv import PrefillSm90WgmmaFp8Pv
    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import PrefillSm90WgmmaFp8Qk

    cubin = str(v5_cubins[config, compensate, kernel])
    usage = cuobjdump("--dump-resource-usage", cubin)
    assert re.search(r"LOCAL:0\b", usage) and int(re.search(r"STACK:(\d+)", usage).group(1)) <= STACK_BYTES[kernel], \
        f"the {kernel} prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    launcher = PrefillSm90WgmmaFp8Pv(*config, compensate=compensate, warpgroups=WARPGROUPS[kernel])
    smem = launcher.smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    fits = ctas_per_sm(registers, WARPGROUP * WARPGROUPS[kernel], smem)
    assert registers <= MAX_REGISTERS and fits >= CTAS_PER_SM[kernel], \
        f"{registers} registers and {smem} B of shared memory per CTA: {fits} CTAs per SM, not {CTAS_PER_SM[kernel]}"
    v4 = PrefillSm90WgmmaFp8Qk(*config, compensate=compensate, warpgroups=WARPGROUPS[kernel])
    assert v4.smem_bytes - launcher.smem_bytes == 8192  # the e4m3 V^T tile: half v4's FP16 V tile

    sass = cuobjdump("--dump-sass", cubin)
    assert "HGMMA" not in sass and "HMMA" not in sass, f"{kernel}: every MMA should be an e4m3 wgmma"
    assert re.search(r"\.minnctapersm\s+2", Path(cubin).with_suffix(".ptx").read_text()) or kernel == "v5"
    loops = mma_loops(sass)
    assert len(loops) == TILE_LOOPS, [len(body) for body in loops]
    for body in loops:
        qgmma = [op for op in body if op.startswith("QGMMA.64x64x32.F32.E4M3.E4M3")]
        assert len(qgmma) == 8, body  # QK: 4 (smem x smem); PV: 2 halves x 2 k-steps, A from registers
        assert sum(re.match(r"QGMMA\S* R\d+, R\d+, gdesc", op) is not None for op in qgmma) == 4, qgmma
        assert sum(op.startswith("BAR.SYNC") for op in body) == 2, "a tile needs its two CTA barriers"
        assert sum(op.startswith("LDSM.16.MT88.4") for op in body) == 4 // WARPGROUPS[kernel]
        assert sum(op.startswith("STSM.16.M88.4") for op in body) == 4 // WARPGROUPS[kernel]
        # e4m3 -> FP16 only for K block-scale pairs (1-2 per K chunk): none of v4's 8 per V piece
        assert sum("F2FP.F16.E4M3" in op for op in body) <= 4
        assert sum("F2FP.SATFINITE.E4M3.F32" in op for op in body) == 16  # P: 2 cvt per 4 keys, 32 per thread
        assert not any(op.startswith(("STL", "LDL")) for op in body), "local memory traffic in the tile loop"


def test_v5_is_opt_in(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert prefill_kernel(32, 8, 128) == "v7i" and prefill_kernel(32, 8, 128, "V5") == "v5"
    assert prefill_kernel(32, 8, 128, "v5w8") == "v5w8"
    assert kernel_block_m(4, "v5") == 16 and kernel_block_m(4, "v5w8") == 32
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v5w8")
    assert prefill_kernel(32, 8, 128) == "v5w8"


@pytest.mark.parametrize("kernel", WARPGROUPS)
def test_v5_limits_are_clear_errors(kernel):
    with pytest.raises(ValueError, match="group 4 only"):
        compile_prefill_kernel(8, 5, 128, True, "BFloat16", kernel=kernel)
    with pytest.raises(ValueError, match="page_size >= 64"):
        compile_prefill_kernel(8, 4, 32, True, "BFloat16", kernel=kernel)


def test_bench_backend_pins_v5():
    from mpfa.profiles.registry import adapter_for

    assert adapter_for("mpfa-v5").prefill_kernel == "v5" and adapter_for("mpfa-v5w8").prefill_kernel == "v5w8"
