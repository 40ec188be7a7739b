"""v3c / v3w8c (`prefill_wgmma_dscol`: Delta_S as an extra K column of QK) compile for sm_90a on a CPU-only
machine: no local memory, v3's occupancy (v3w8c: 2 CTAs of 2 warpgroups per SM); per tile loop QK has one more
HGMMA.64x64x16 than v3's 8 (the Delta_S k-step), no FMUL by 2**-7 of Delta_S into the accumulator, one FP16 store
of Delta_S per (key, head) spread over the CTA's threads; the whole-tile loop is shorter than v3w8's; the direct
build is v3w8's (no extra k-step)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90.sass import WARPGROUP, ctas_per_sm, mma_loops  # noqa: E402

CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32"),  # (KV heads, group, page, causal, out)
           (8, 5, 128, True, "BFloat16"), (8, 5, 64, False, "Float32")]
BUILDS = [(CONFIGS[0], True, "v3w8c"), (CONFIGS[1], True, "v3c"), (CONFIGS[0], False, "v3w8c"),
          (CONFIGS[2], True, "v3w8c"), (CONFIGS[3], True, "v3c")]
IDS = ["v3w8c-causal-bf16-page128", "v3c-noncausal-f32-page64", "v3w8c-causal-bf16-page128-direct",
       "v3w8c-40:8-causal-bf16-page128", "v3c-40:8-noncausal-f32-page64"]
BASELINE = [(CONFIGS[0], True, "v3w8")]
WARPGROUPS = {"v3c": 1, "v3w8c": 2}
TILE_LOOPS = 2  # masked tiles, then whole tiles
DS_VALUES = {4: 64 * 4, 5: 64 * 2}  # BF16 Delta_S a tile's expansion widens, by group: (key, head) pairs; group
# 5 (one head per CTA): the 4-byte word holding the head, 2 per key


@pytest.fixture(scope="module")
def cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    built = compile_builds(BUILDS, "PrefillSm90WgmmaDsColumn", tmp_path_factory.mktemp("prefill_dscol"))
    return built | compile_builds(BASELINE, "PrefillSm90Wgmma", tmp_path_factory.mktemp("prefill_v3w8"))


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_ds_column_prefill_compiles_for_sm90a(cubins, cuobjdump, config, compensate, kernel):
    from mpfa.kernels.sm90.prefill_wgmma_dscol import PrefillSm90WgmmaDsColumn

    cubin = str(cubins[config, compensate, kernel])
    usage = cuobjdump("--dump-resource-usage", cubin)
    assert re.search(r"LOCAL:0\b", usage), f"{kernel} spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    launcher = PrefillSm90WgmmaDsColumn(*config, compensate=compensate, warpgroups=WARPGROUPS[kernel])
    smem = launcher.smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    assert ctas_per_sm(registers, WARPGROUP * WARPGROUPS[kernel], smem) >= 2, (registers, smem)

    loops = mma_loops(cuobjdump("--dump-sass", cubin))
    assert len(loops) == TILE_LOOPS, [len(body) for body in loops]
    for body in loops:
        qk = [op for op in body if op.startswith("HGMMA.64x64x16.F32")]
        pv = [op for op in body if op.startswith("HGMMA.64x128x16.F32")]
        assert len(qk) == (9 if compensate else 8) and len(pv) == 4, body
        assert not any(op.startswith("FMUL") and op.endswith(", 0.0078125") for op in body), \
            "Delta_S should not be scaled into the accumulator"
        stores = sum(op.startswith("STS.U16") for op in body)
        assert stores == (-(-DS_VALUES[config[1]] // launcher.threads) if compensate else 0), body


def test_ds_column_shortens_the_tile_loop(cubins, cuobjdump):
    """The whole-tile loop (the shorter of the two) against v3w8's, compensated both."""
    ours = min(len(body) for body in mma_loops(cuobjdump("--dump-sass", str(cubins[BUILDS[0]]))))
    v3w8 = min(len(body) for body in mma_loops(cuobjdump("--dump-sass", str(cubins[BASELINE[0]]))))
    assert ours <= v3w8 - 20, (ours, v3w8)
