"""The warp-specialized prefill (v6, `prefill_wgmma_ws`) on a CPU-only machine: it compiles for sm_90a through the
launcher (`compile_prefill_kernel(..., kernel="v6")`) as 3 warpgroups (384 threads, ``.reqntid 384``, 1 CTA per SM)
with ``setmaxnreg`` giving the producer ``PRODUCER_REGS`` and each consumer ``CONSUMER_REGS`` (within the launch's
registers), no local memory anywhere; the consumers' tile loops hold both GEMMs on e4m3 wgmma (v5's 4 + 2 x 2
QGMMA) and no barrier but one mbarrier wait and one arrive, the producer's tile loops the copies, the K expansion
and all of the V transpose (4 LDSM.T + 4 STSM per thread; v6g's two producers 2 each, 512 threads, 128 registers),
its named barrier and one arrive, and no MMA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels import formats  # noqa: E402
from mpfa.kernels.sm90 import prefill_launch  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m, prefill_kernel  # noqa: E402
from mpfa.kernels.sm90.sass import SMEM_PER_CTA, WARPGROUP, ctas_per_sm, loops_issuing, mma_loops  # noqa: E402

CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32"),  # (KV heads, group, page, causal, out)
           (8, 5, 128, True, "BFloat16")]  # GQA 40:8: v6l .. v6n only (a consumer warpgroup = one head x 64 rows)
BUILDS = [(CONFIGS[0], True, "v6"), (CONFIGS[0], False, "v6"), (CONFIGS[1], True, "v6")]
IDS = ["v6-causal-bf16-page128", "v6-causal-bf16-page128-direct", "v6-noncausal-f32-page64"]
# the variants (`prefill_launch.WS_KERNELS`): each causal BF16; v6f (every change), v6i and v6l (their own walks)
# non-causal FP32 too, v6i's and v6l's direct builds
VARIANTS = ("v6a", "v6b", "v6c", "v6d", "v6e", "v6f", "v6g", "v6h", "v6i", "v6j", "v6k", "v6l", "v6m", "v6n")
VARIANT_BUILDS = ([(CONFIGS[0], True, k) for k in VARIANTS] + [(CONFIGS[1], True, "v6f"), (CONFIGS[1], True, "v6i"),
                                                                (CONFIGS[0], False, "v6i"), (CONFIGS[1], True, "v6l"),
                                                                (CONFIGS[0], False, "v6l"), (CONFIGS[2], True, "v6l"),
                                                                (CONFIGS[2], True, "v6n")])
VARIANT_IDS = [f"{kernel}-{'causal-bf16-page128' if config[3] else 'noncausal-f32-page64'}{'' if comp else '-direct'}"
               f"{'-40:8' if config[1] == 5 else ''}" for config, comp, kernel in VARIANT_BUILDS]
# PV as one m64n128k32 into a fresh accumulator (v6j / v6k: onto the pair's accumulator on a pair's second tile)
ONE_PV_WGMMA = ("v6a", "v6b", "v6d", "v6e", "v6f", "v6g", "v6h", "v6i", "v6j", "v6k", "v6l", "v6m", "v6n")
# O = O alpha + P V in one FFMA, no vote
FOLDED_RESCALE = ("v6b", "v6d", "v6e", "v6f", "v6g", "v6h", "v6i", "v6l", "v6m", "v6n")
PAIR_FOLD = ("v6j", "v6k")  # O = O alpha_1 alpha_2 + the pair's P V, on a pair's second tile only: the loop has a
# branch per position in the pair (2 PV wgmmas each), one fold and the pending accumulator's vote-skipped rescale
# the K expansion's e2m1 by table look-up
LUT_K = ("v6c", "v6d", "v6e", "v6f", "v6g", "v6h", "v6i", "v6j", "v6k", "v6l", "v6m", "v6n")
# Delta_S not multiplied by 2**-7 (16 FMUL per tile); lam 2**-7 once per tile instead
UNSCALED = ("v6e", "v6f", "v6g", "v6h", "v6i", "v6j", "v6k", "v6l", "v6m", "v6n")
P_IN_EXPONENT = ("v6k", "v6l", "v6m", "v6n")  # e4m3(448 P)'s 448 in the exponent's bias: no FMUL by 448
# 128-key consumer steps: 2 stages' QK (8 k-steps, one wait), 2 stages' PV (4, one wait), one fold, 2 full waits and
# 2 empty arrivals, 64 keys' P (32 cvt), Delta_S as 8 16-byte loads of the producer's FP32 copy; up to 8 words
# spilled outside the loops (the epilogue's rows across the consumers' walk, a few of the producer's around its
# loops: stored once, loaded once per CTA), none in any loop
WIDE = ("v6l", "v6m", "v6n")
ROW_SUMS_ON_MMA = ("v6n",)  # PV m64n136k32 (V^T's row of ones): no FADD per score
PINGPONG = ("v6f",)  # the consumers take turns at QK: named barriers 4 / 5 of 256 threads
TWO_PRODUCERS = ("v6g", "v6h", "v6m")  # 2 producer warpgroups (512 threads): each copies and expands half of every tile
OVERLAP = ("v6i",)  # QK of tile p and PV of tile p - 1 issued together; one wait for QK, one for PV, then release
TILE_LOOPS = 2  # masked tiles, then whole tiles: in the producer and in each consumer
PRODUCER_LOOP = "BAR.SYNC.DEFER_BLOCKING 0x1, {:#x}"  # the producers' named barrier (all their threads)


@pytest.fixture(scope="module")
def v6_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    return compile_builds(BUILDS, "PrefillSm90WgmmaWs", tmp_path_factory.mktemp("prefill_v6"))


@pytest.fixture(scope="module")
def variant_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    """One compiling interpreter per variant class (`compile_builds` keeps one class's files per call)."""
    cubins = {}
    for kernel, class_name in prefill_launch.WS_KERNELS.items():
        builds = [build for build in VARIANT_BUILDS if build[2] == kernel]
        if builds:
            cubins.update(compile_builds(builds, class_name, tmp_path_factory.mktemp(f"prefill_{kernel}")))
    return cubins


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_v6_prefill_compiles_for_sm90a(v6_cubins, cuobjdump, config, compensate, kernel):
    _check_ws_build(str(v6_cubins[config, compensate, kernel]), cuobjdump, config, compensate, kernel)


@pytest.mark.parametrize("config,compensate,kernel", VARIANT_BUILDS, ids=VARIANT_IDS)
def test_v6_variants_compile_for_sm90a(variant_cubins, cuobjdump, config, compensate, kernel):
    """v6's checks (roles, registers, barriers, no local memory), with each variant's own MMAs and arithmetic."""
    _check_ws_build(str(variant_cubins[config, compensate, kernel]), cuobjdump, config, compensate, kernel)


def _check_ws_build(cubin: str, cuobjdump, config, compensate, kernel):
    from mpfa.kernels.sm90 import prefill_wgmma_ws as ws

    launcher = getattr(ws, prefill_launch.WS_KERNELS[kernel])(*config, compensate=compensate)
    usage = cuobjdump("--dump-resource-usage", cubin)
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert re.search(r"LOCAL:0\b", usage) and stack <= (32 if kernel in WIDE else 0), f"the v6 prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    producers = 2 if kernel in TWO_PRODUCERS else 1
    threads = (producers + ws.CONSUMERS) * WARPGROUP
    assert launcher.producer_warpgroups == producers and launcher.producer_threads == producers * WARPGROUP
    block_m = {4: 32, 5: 128}[config[1]]  # 2 consumer warpgroups of 4 heads x 16 rows or of 1 head x 64 rows
    assert launcher.threads == threads and launcher.block_m == kernel_block_m(config[1], kernel) == block_m
    smem = launcher.smem_bytes + int(re.search(r"SHARED:(\d+)", usage).group(1))
    assert smem <= SMEM_PER_CTA and ctas_per_sm(registers, threads, smem) == 1, (registers, smem)
    # setmaxnreg moves registers within the CTA's launch allocation: 128 (producers p + 2c) <= threads x launch
    # registers, ptxas' cap under .reqntid (168 for 384 threads, 128 for 512)
    assert registers == {384: 168, 512: 128}[threads]
    assert (producers * launcher.producer_regs + ws.CONSUMERS * launcher.consumer_regs
            <= threads // WARPGROUP * registers)
    ptx = Path(cubin).with_suffix(".ptx").read_text()
    assert re.search(rf"\.reqntid\s+{threads}, 1, 1", ptx) and re.search(r"\.minnctapersm\s+1\b", ptx)

    sass = cuobjdump("--dump-sass", cubin)
    assert f"USETMAXREG.DEALLOC.CTAPOOL {launcher.producer_regs:#x}" in sass
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {launcher.consumer_regs:#x}" in sass
    assert "HGMMA" not in sass and "HMMA" not in sass, "every MMA should be an e4m3 wgmma"
    spills = len(re.findall(r"\bSTL\b", sass))
    assert spills <= (8 if kernel in WIDE else 0), "local memory traffic"
    consumer_loops = mma_loops(sass)
    assert len(consumer_loops) == TILE_LOOPS, [len(body) for body in consumer_loops]
    for whole, body in enumerate(consumer_loops):
        assert not any(op.startswith(("STL", "LDL")) for op in body), "local memory traffic in the tile loop"
        if kernel in WIDE:
            _check_wide(body, compensate, bool(whole), kernel in ROW_SUMS_ON_MMA)
            continue
        qk = [op for op in body if re.match(r"QGMMA.64x64x32.F32.E4M3.E4M3 R\d+, gdesc", op)]
        assert len(qk) == 4, body  # QK: 4 k-steps, smem x smem
        pv_shape = "64x128x32" if kernel in ONE_PV_WGMMA else "64x64x32"  # v6: 2 halves of the dims
        pv = [op for op in body if re.match(rf"QGMMA.{pv_shape}.F32.E4M3.E4M3 R\d+, R\d+, gdesc", op)]
        # 2 k-steps each, A (P) from registers (v6j / v6k: in each of the two branches)
        assert len(pv) == (4 if kernel in PAIR_FOLD or kernel not in ONE_PV_WGMMA else 2), body
        assert sum(op.startswith("QGMMA") for op in body) == len(qk) + len(pv)
        waits = sum(op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") for op in body)
        if kernel in OVERLAP:
            _check_overlap(body)
        else:  # one wgmma wait per GEMM (v6: per PV half; v6j / v6k: per branch)
            assert waits == (2 if kernel in ONE_PV_WGMMA and kernel not in PAIR_FOLD else 3), body
        assert (kernel in P_IN_EXPONENT) == (not any(op.startswith("FMUL") and op.endswith(", 448") for op in body))
        if kernel in PAIR_FOLD:  # the fold once (64 FFMA), the pending accumulator's rescale vote-skipped
            assert sum(op.startswith("VOTE.ANY") for op in body) == 1
            assert sum(op.startswith("FFMA") for op in body) >= (2 if compensate else 1) * 32 + 64
        elif kernel in FOLDED_RESCALE:  # O = O alpha + P V: 64 FFMA, no vote, no FMUL by alpha (+ 32 FFMA for P, and
            # 32 for the scores where Delta_S is added)
            assert not any(op.startswith("VOTE") for op in body)
            assert sum(op.startswith("FFMA") for op in body) >= (2 if compensate else 1) * 32 + 64
        else:
            assert sum(op.startswith("VOTE.ANY") for op in body) == 1  # O's rescale, vote-skipped
        two_pow_minus_7 = sum(op.startswith("FMUL") and op.endswith(", 0.0078125") for op in body)
        assert two_pow_minus_7 == (1 if kernel in UNSCALED else 16 if compensate else 0), body
        bars = [op for op in body if op.startswith("BAR.")]
        if kernel in PINGPONG:  # its turn right before the QK issue, the other's turn right after (and on a skip)
            syncs = [i for i, op in enumerate(body) if op.startswith("BAR.SYNC.DEFER_BLOCKING R")]
            arrives = [i for i, op in enumerate(body) if op.startswith("BAR.ARV R")]
            assert all(op.endswith(", 0x100") for op in bars) and len(bars) == len(syncs) + len(arrives), bars
            assert len(syncs) == len(arrives) in (1, 2), bars  # 2 in the masked loop: the skipped tile's turn
            first_qk = next(i for i, op in enumerate(body) if op.startswith("QGMMA"))
            last_qk = max(i for i, op in enumerate(body) if op.startswith("QGMMA.64x64x32"))
            first_wait = next(i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR"))
            assert syncs[0] < first_qk and last_qk < arrives[0] < first_wait, bars
        else:
            assert not bars, "a consumer tile needs no CTA or named barrier"
        assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in body) == 1  # wait full[s]
        assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in body) == 1  # arrive empty[s]
        assert not any(op.startswith(("LDSM", "STSM", "LDGSTS")) for op in body), "the producer's work"
        assert sum("F2FP.SATFINITE.E4M3.F32" in op for op in body) == 16  # P: 2 cvt per 4 keys, 32 per thread
    producer_loop = PRODUCER_LOOP.format(launcher.producer_threads)
    producer_loops = loops_issuing(sass, (producer_loop,))
    assert len(producer_loops) == TILE_LOOPS, [len(body) for body in producer_loops]
    chunks = 2 // producers  # K chunks per producer thread and tile (v6g: the two producers share them)
    for body in producer_loops:
        assert not any("GMMA" in op or op.startswith(("STL", "LDL")) for op in body)
        assert sum(op.startswith(producer_loop) for op in body) == 1
        assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in body) == 1  # wait empty[s]
        assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in body) == 1  # arrive full[s]
        assert sum(op.startswith("LDSM.16.MT88.4") for op in body) == 2 * chunks  # the V transpose: 4 per thread of
        assert sum(op.startswith("STSM.16.M88.4") for op in body) == 2 * chunks  # one producer, 2 of two
        lead = ws.RING_STAGES - launcher.operand_stages  # tiles of copies in flight: 6 (v6h: 5)
        assert sum(op.startswith(f"DEPBAR.LE SB0, {lead:#x}") for op in body) == 1
        # K: 2 chunks (v6g 1) x 16 registers x the block scale (+ 2 per chunk for the block scales' 2**-e); v6 also
        # x 2**14
        assert sum(op.startswith("HMUL2") for op in body) == chunks * (16 + 2) + (0 if kernel in LUT_K else chunks * 16)


def _check_wide(body: list[str], compensate: bool, whole: bool, row_sums_on_mma: bool, pv_waits: int = 1,
                poly_exps: int = 0, turns: bool = False) -> None:
    """v6l's consumer loop: one 128-key step (`prefill_wgmma_ws.PrefillSm90WgmmaWsWideTile`). In the whole tiles'
    loop both stages' QK are in flight together; in the masked loop ptxas may wait for the first before setting the
    second's accumulator to its mask (seen in the non-causal build, whose masked loop runs once per CTA at most).
    ``pv_waits``: full waits for the PV wgmma per step (v7d's one wait covers the second QK's too: 0);
    ``poly_exps``: P values per thread and step on the FMA pipe instead of MUFU.EX2 (v7e: 16, 3 FADD each);
    ``turns``: the step takes a ping-pong turn (v7f: one ``bar.sync`` and one ``bar.arrive``, no other barrier)."""
    qk = [op for op in body if re.match(r"QGMMA.64x64x32.F32.E4M3.E4M3 R\d+, gdesc", op)]
    pv_n = 136 if row_sums_on_mma else 128
    pv = [op for op in body if re.match(rf"QGMMA.64x{pv_n}x32.F32.E4M3.E4M3 R\d+, R\d+, gdesc", op)]
    assert len(qk) == 8 and len(pv) == 4 and sum(op.startswith("QGMMA") for op in body) == 12, body
    waits = sum(op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") for op in body)
    assert waits == 1 + pv_waits if whole else waits in (1 + pv_waits, 2 + pv_waits), body  # QK's, PV's
    if whole:
        last_qk = max(i for i, op in enumerate(body) if op in qk)
        first_wait = next(i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR"))
        assert last_qk < first_wait, "both stages' QK issued before the first wait"
    assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in body) == 2  # wait full[s0], full[s1]
    arrives = [re.sub(r"^@!?P\d ", "", op) for op in body]  # (v7d's are predicated: only stages held)
    assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in arrives) == 2  # arrive empty[s0], empty[s1]
    assert not any(op.startswith(("VOTE", "LDSM", "STSM", "LDGSTS")) for op in body)
    bars = sorted(op.split(".")[1].split()[0] for op in body if op.startswith("BAR."))
    assert bars == (["ARV", "SYNC"] if turns else []), bars
    assert not any(op.startswith("FMUL") and op.endswith(", 448") for op in body)
    assert sum(op.startswith("FMUL") and op.endswith(", 0.0078125") for op in body) == 1  # lam 2**-7
    assert sum("F2FP.SATFINITE.E4M3.F32" in op for op in body) == 32  # P of 128 keys
    # the scores' scale (and Delta_S), the exponent, the fold O = O alpha + P V
    assert sum(op.startswith("FFMA") for op in body) >= (2 if compensate else 1) * 64 + 64
    assert sum(op.startswith("MUFU.EX2") for op in body) == 64 - poly_exps + 2  # P, and one alpha per row
    row_sum_adds = sum(op.startswith("FADD") for op in body) - 3 * poly_exps  # the row sums' 64, or 2 (alpha's)
    assert row_sum_adds == 2 if row_sums_on_mma else row_sum_adds >= 64
    loads = [op for op in body if op.startswith("LDS")]  # Delta_S (FP32, 4 keys a load), the 2 tiles' K exponents
    assert len(loads) == (8 if compensate else 0) + 2
    assert sum(op.startswith("LDS.128") for op in loads) == len(loads) - 2


def test_v6_is_opt_in(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert prefill_kernel(32, 8, 128) == "v7i" and prefill_kernel(32, 8, 128, "V6") == "v6"
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v6")
    assert prefill_kernel(32, 8, 128) == "v6"


def test_v6_limits_are_clear_errors():
    with pytest.raises(ValueError, match="group 4 only"):
        compile_prefill_kernel(8, 5, 128, True, "BFloat16", kernel="v6")
    with pytest.raises(ValueError, match="group 4 or 5 only"):  # the 128-key kernels take 40:8 too
        compile_prefill_kernel(8, 6, 128, True, "BFloat16", kernel="v6l")
    with pytest.raises(ValueError, match="page_size >= 64"):
        compile_prefill_kernel(8, 4, 32, True, "BFloat16", kernel="v6")


@pytest.mark.parametrize("operand_stages", [2, 3, 4])
def test_v6_ring_schedule(operand_stages: int):
    """The producer's ring on the CPU: every walk step copied exactly once, into a stage no step in flight or
    still readable by the consumers (steps p - n + 1 .. p + 7 - n at step p, n operand stages: v6 2, v6h 3, v6l 4)
    holds; operand stages cycle and each one's parity flips on every use."""
    from mpfa.kernels.sm90 import prefill_staged_layout as sl
    from mpfa.kernels.sm90.prefill_wgmma_ws import RING_STAGES, stage_parity, ws_ring_copy

    n = operand_stages
    for tiles in (1, 2, 3, 7, 8, 9, 40):
        stage_of = {}
        for index in range(RING_STAGES - n):
            tile_index, stage = sl.ring_prologue(index, tiles)
            if tile_index >= 0:
                stage_of[tiles - 1 - tile_index] = stage
        for step in range(tiles):
            tile_index, stage = ws_ring_copy(step, tiles, RING_STAGES, n)
            if tile_index >= 0:
                walk_step = tiles - 1 - tile_index
                assert walk_step == step + RING_STAGES - n and walk_step not in stage_of
                live = {stage_of[p] for p in range(step - n + 1, walk_step) if p in stage_of}
                assert stage not in live, (tiles, step)
                stage_of[walk_step] = stage
            assert sl.ring_compute(step, tiles, RING_STAGES)[1] == stage_of[step]
        assert sorted(stage_of) == list(range(tiles))
    uses = [stage_parity(p, n) for p in range(4 * n)]
    assert uses == [(p % n, (p // n) % 2) for p in range(4 * n)]
    assert [stage_parity(p) for p in range(5)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0)]


@pytest.mark.parametrize("tiles", range(12))
def test_wide_walk(tiles: int):
    """v6l's 128-key steps on the CPU: every walk step in exactly one consumer step, each step's 64-key tiles one of
    the sequence's 128-key tiles (indices 2j, 2j + 1: the reference's ``block_n`` 128), every masked tile in a step
    taken by the masked body, at most one whole tile there (the partner of a masked tile)."""
    from mpfa.kernels.sm90.prefill_wgmma_ws import wide_walk

    for masked in range(tiles + 1):
        lead, masked_pairs, pairs = wide_walk(tiles, masked)
        units = [((0,), masked > 0)] if lead else []
        units += [((lead + 2 * pair, lead + 2 * pair + 1), pair < masked_pairs) for pair in range(pairs)]
        steps = [(step, masked_body) for unit, masked_body in units for step in unit]
        assert sorted(step for step, _ in steps) == list(range(tiles)), (tiles, masked)
        assert all(len({(tiles - 1 - step) // 2 for step in unit}) == 1 for unit, _ in units), (tiles, masked)
        assert all(masked_body for step, masked_body in steps if step < masked), (tiles, masked)
        assert sum(masked_body for step, masked_body in steps if step >= masked) <= 1, (tiles, masked)


def test_staged_delta_s_layout():
    """v6l's FP32 Delta_S tile on the CPU: the producer's (head, key) slots fill the 1 KB tile once each, and consumer
    lane c of head h finds key 16 i + 8 b + 2c + half at slot 2b + half of its i-th 16-byte word."""
    from mpfa.kernels.sm90.prefill_wgmma import TILE_KEYS
    from mpfa.kernels.sm90.prefill_wgmma_ws import PrefillSm90WgmmaWsWideTile, ds_staged_offset, ds_staged_read

    heads, keys = 4, TILE_KEYS
    offsets = {ds_staged_offset(h, k): (h, k) for h in range(heads) for k in range(keys)}
    assert sorted(offsets) == list(range(0, 4 * heads * keys, 4))
    assert PrefillSm90WgmmaWsWideTile(8, 4, 128, True).staged_ds_bytes() == 4 * heads * keys
    assert PrefillSm90WgmmaWsWideTile(8, 5, 128, True).staged_ds_bytes() == 4 * keys  # one head per CTA
    for h in range(heads):
        for c in range(4):
            for i in range(keys // 16):
                word = ds_staged_read(h, c, i)
                assert word % 16 == 0
                for b in range(2):
                    for half in range(2):
                        assert offsets[word + 4 * (2 * b + half)] == (h, 16 * i + 8 * b + 2 * c + half)
    for k in range(0, keys, 2):  # a producer lane's two keys: one 8-byte store
        assert ds_staged_offset(0, k + 1) == ds_staged_offset(0, k) + 4 and ds_staged_offset(0, k) % 8 == 0


def test_bench_backend_pins_v6():
    from mpfa.profiles.registry import adapter_for

    assert adapter_for("mpfa-v6").prefill_kernel == "v6"


# --- v6c / v6d's K expansion on the CPU: the table look-up gives v4's FP16 values, so v4's e4m3 operand bytes ---------

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
    import numpy as np

    value = np.array([bits], dtype=np.uint16).view(np.float16).astype(np.float32) * np.float32(factor)
    return int(value.astype(np.float16).view(np.uint16)[0])


def _lut_regs(word: int) -> list[int]:
    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import e2m1_word_f16x2_lut

    return list(e2m1_word_f16x2_lut(word, lookup=_prmt, permute=_prmt))


def test_lut_decode_gives_the_shift_decodes_fp16_bits():
    """For every code pair (j, j + 4) of a word in every register j, among random other codes: the table look-up
    (`e2m1_word_f16x2_lut`) gives exactly the bits of v4's `e2m1_word_to_f16x2` x 2**14 (-0 for code 8 included),
    the FP16 of the code's value."""
    import random

    from mpfa.kernels.sm90 import decode_layout as lay

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
    """The whole v6c K element path, modelled bit by bit: every e2m1 code x every positive e4m3 block scale x every
    tile exponent that block can meet (the tile's largest block scale from the block's own up to 448): the looked-up
    FP16 value times the block scale times 2**-e in FP16 (`factor_exponents`' two exact steps), to e4m3 (round to
    nearest even, saturating) -- equal to `formats.fake_quant_fp8` of the exact value with the scale 2**e."""
    import numpy as np

    from mpfa.kernels.sm90.prefill_wgmma_fp8qk import exponent_from_scale, factor_exponents

    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = list(range(16))
    words = [sum(code << (4 * n) for n in range(8)) for code in codes]  # every position holds the code
    f16_of_code = np.array([_lut_regs(w)[0] & 0xFFFF for w in words], dtype=np.uint16).view(np.float16)
    values = torch.tensor(f16_of_code.astype(np.float32))  # the kernel's FP16 of each code
    grid = torch.tensor([(-1.0 if code & 8 else 1.0) * formats.E2M1_GRID[code & 7] for code in codes])
    checked = 0
    for top in scales.tolist():
        e = exponent_from_scale(top)
        a, b = factor_exponents(e)
        blocks = scales[scales <= top]
        factors = ((blocks.half() * torch.tensor(2.0**a).half()).half() * torch.tensor(2.0**b).half()).half()
        product = (values.half()[:, None] * factors[None, :]).half()  # HMUL2: exact product, one rounding
        got = product.float().to(torch.float8_e4m3fn).float() * 2.0**e
        exact = grid[:, None] * blocks[None, :]
        assert torch.equal(got, formats.fake_quant_fp8(exact, 2.0**e)), top
        checked += got.numel()
    assert checked == 16 * 126 * 127 // 2


def _check_overlap(body: list[str]) -> None:
    """v6i's tile loop: QK (4 QGMMA) then the previous tile's PV (2) issued before any wait; ``wait_group 1`` (QK
    done) and then ``wait_group 0`` (PV done) with the scores between them (at least their 32 FFMA, FMUL in the
    direct build: the overlap),
    and the release of the previous tile's stage after the PV wait."""
    first = {name: next(i for i, op in enumerate(body) if op.startswith(prefix)) for name, prefix in (
        ("qk", "QGMMA.64x64x32"), ("pv", "QGMMA.64x128x32"), ("wait_qk", "WARPGROUP.DEPBAR.LE gsb0, 0x1"),
        ("wait_pv", "WARPGROUP.DEPBAR.LE gsb0, 0x0"), ("release", "SYNCS.ARRIVE.TRANS64"))}
    last_mma = max(i for i, op in enumerate(body) if op.startswith("QGMMA"))
    assert first["qk"] < first["pv"] and last_mma < first["wait_qk"] < first["wait_pv"] < first["release"], first
    assert sum(op.startswith("WARPGROUP.DEPBAR") for op in body) == 2, "one wait per GEMM"
    scores = [op for op in body[first["wait_qk"]:first["wait_pv"]] if op.startswith(("FFMA", "FMUL"))]
    assert len(scores) >= 32, f"the PV wait should come after the scores, {len(scores)} FFMA / FMUL before it"

