"""The warp-specialized prefill (v6, `prefill_wgmma_ws`) on a CPU-only machine: it compiles for sm_90a through the
launcher (`compile_prefill_kernel(..., kernel="v6")`) as 3 warpgroups (384 threads, ``.reqntid 384``, 1 CTA per SM)
with ``setmaxnreg`` giving the producer ``PRODUCER_REGS`` and each consumer ``CONSUMER_REGS`` (within the launch's
registers), no local memory anywhere; the consumers' tile loops hold both GEMMs on e4m3 wgmma (v5's 4 + 2 x 2
QGMMA) and no barrier but one mbarrier wait and one arrive, the producer's tile loops the copies, the K expansion
and all of the V transpose (4 LDSM.T + 4 STSM per thread), its named barrier and one arrive, and no MMA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_launch  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m, prefill_kernel  # noqa: E402
from mpfa.kernels.sm90.sass import SMEM_PER_CTA, WARPGROUP, ctas_per_sm, loops_issuing, mma_loops  # noqa: E402

CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32")]  # (KV heads, group, page, causal, out)
BUILDS = [(CONFIGS[0], True, "v6"), (CONFIGS[0], False, "v6"), (CONFIGS[1], True, "v6")]
IDS = ["v6-causal-bf16-page128", "v6-causal-bf16-page128-direct", "v6-noncausal-f32-page64"]
TILE_LOOPS = 2  # masked tiles, then whole tiles: in the producer and in each consumer
PRODUCER_LOOP = "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80"  # the producer's named barrier (its 128 threads)


@pytest.fixture(scope="module")
def v6_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    return compile_builds(BUILDS, "PrefillSm90WgmmaWs", tmp_path_factory.mktemp("prefill_v6"))


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_v6_prefill_compiles_for_sm90a(v6_cubins, cuobjdump, config, compensate, kernel):
    from mpfa.kernels.sm90 import prefill_wgmma_ws as ws

    cubin = str(v6_cubins[config, compensate, kernel])
    usage = cuobjdump("--dump-resource-usage", cubin)
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the v6 prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    launcher = ws.PrefillSm90WgmmaWs(*config, compensate=compensate)
    threads = ws.WARPGROUPS * WARPGROUP
    assert launcher.threads == threads == 384 and launcher.block_m == kernel_block_m(4, "v6") == 32
    smem = launcher.smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    assert smem <= SMEM_PER_CTA and ctas_per_sm(registers, threads, smem) == 1, (registers, smem)
    # setmaxnreg moves registers within the CTA's launch allocation: 128 (p + 2c) <= 384 x launch registers
    assert registers == ws.LAUNCH_REGS
    assert launcher.producer_regs + ws.CONSUMERS * launcher.consumer_regs <= ws.WARPGROUPS * registers
    ptx = Path(cubin).with_suffix(".ptx").read_text()
    assert re.search(r"\.reqntid\s+384, 1, 1", ptx) and re.search(r"\.minnctapersm\s+1\b", ptx)

    sass = cuobjdump("--dump-sass", cubin)
    assert f"USETMAXREG.DEALLOC.CTAPOOL {launcher.producer_regs:#x}" in sass
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {launcher.consumer_regs:#x}" in sass
    assert "HGMMA" not in sass and "HMMA" not in sass, "every MMA should be an e4m3 wgmma"
    assert not re.search(r"\b(STL|LDL)\b", sass), "local memory traffic"
    consumer_loops = mma_loops(sass)
    assert len(consumer_loops) == TILE_LOOPS, [len(body) for body in consumer_loops]
    for body in consumer_loops:
        qgmma = [op for op in body if op.startswith("QGMMA.64x64x32.F32.E4M3.E4M3")]
        assert len(qgmma) == 8, body  # QK: 4 (smem x smem); PV: 2 halves x 2 k-steps, A from registers
        assert sum(re.match(r"QGMMA\S* R\d+, R\d+, gdesc", op) is not None for op in qgmma) == 4, qgmma
        assert not any(op.startswith("BAR.") for op in body), "a consumer tile needs no CTA or named barrier"
        assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in body) == 1  # wait full[s]
        assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in body) == 1  # arrive empty[s]
        assert not any(op.startswith(("LDSM", "STSM", "LDGSTS")) for op in body), "the producer's work"
        assert sum("F2FP.SATFINITE.E4M3.F32" in op for op in body) == 16  # P: 2 cvt per 4 keys, 32 per thread
    producer_loops = loops_issuing(sass, (PRODUCER_LOOP,))
    assert len(producer_loops) == TILE_LOOPS, [len(body) for body in producer_loops]
    for body in producer_loops:
        assert not any("GMMA" in op for op in body)
        assert sum(op.startswith(PRODUCER_LOOP) for op in body) == 1
        assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in body) == 1  # wait empty[s]
        assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in body) == 1  # arrive full[s]
        assert sum(op.startswith("LDSM.16.MT88.4") for op in body) == 4  # the whole V transpose: 4 per thread
        assert sum(op.startswith("STSM.16.M88.4") for op in body) == 4
        assert sum(op.startswith("DEPBAR.LE SB0, 0x6") for op in body) == 1  # 6 tiles of copies in flight


def test_v6_is_opt_in(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert prefill_kernel(32, 8, 128) == "v3" and prefill_kernel(32, 8, 128, "V6") == "v6"
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v6")
    assert prefill_kernel(32, 8, 128) == "v6"


def test_v6_limits_are_clear_errors():
    with pytest.raises(ValueError, match="group 4 only"):
        compile_prefill_kernel(8, 5, 128, True, "BFloat16", kernel="v6")
    with pytest.raises(ValueError, match="page_size >= 64"):
        compile_prefill_kernel(8, 4, 32, True, "BFloat16", kernel="v6")


def test_v6_ring_schedule():
    """The producer's ring on the CPU: every walk step copied exactly once, into a stage no step in flight or
    still readable by the consumers (steps p - 1 .. p + 5 at step p) holds; operand stages and parities alternate."""
    from mpfa.kernels.sm90 import prefill_staged_layout as sl
    from mpfa.kernels.sm90.prefill_wgmma_ws import RING_STAGES, stage_parity, ws_ring_copy

    for tiles in (1, 2, 3, 7, 8, 9, 40):
        stage_of = {}
        for index in range(RING_STAGES - 2):
            tile_index, stage = sl.ring_prologue(index, tiles)
            if tile_index >= 0:
                stage_of[tiles - 1 - tile_index] = stage
        for step in range(tiles):
            tile_index, stage = ws_ring_copy(step, tiles, RING_STAGES)
            if tile_index >= 0:
                walk_step = tiles - 1 - tile_index
                assert walk_step == step + RING_STAGES - 2 and walk_step not in stage_of
                live = {stage_of[p] for p in range(step - 1, walk_step) if p in stage_of}
                assert stage not in live, (tiles, step)
                stage_of[walk_step] = stage
            assert sl.ring_compute(step, tiles, RING_STAGES)[1] == stage_of[step]
        assert sorted(stage_of) == list(range(tiles))
    assert [stage_parity(p) for p in range(5)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0)]


def test_bench_backend_pins_v6():
    from mpfa.profiles.registry import adapter_for

    assert adapter_for("mpfa-v6").prefill_kernel == "v6"
