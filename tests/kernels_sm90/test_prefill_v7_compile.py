"""The prefill on operand images (v7, `prefill_wgmma_pre`) on a CPU-only machine: both kernels compile for sm_90a
through the launcher (`compile_prefill_kernel(..., kernel="v7")`), at GQA 32:8 and 40:8. The operand pass: one
128-thread CTA per tile, v6n's producer work once (the ring copy, the K expansion's HMUL2, the V transpose) and the
image stored with 16-byte stores, no MMA, no local memory. The attention: v6l's consumer checks
(`test_prefill_v6_compile._check_wide`, v6n's m64n136k32 PV without row-sum FADDs) and a producer loop that only
copies (9 x 16-byte cp.async per thread and step, one ``empty`` wait, one ``full`` arrival after a one-group-behind
wait and the proxy fence), with no K / V work."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from siblings import load

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90.prefill_launch import PRE_KERNELS, compile_prefill_kernel, prefill_numerics  # noqa: E402
from mpfa.kernels.sm90 import prefill_wgmma_pre as pre  # noqa: E402
from mpfa.kernels.sm90.ptx import EXP2_POLY  # noqa: E402
from mpfa.kernels.sm90.sass import instructions, loops_issuing, mma_loops  # noqa: E402

v6_tests = load("test_prefill_v6_compile.py", "_prefill_v6_compile_v7")
CONFIG = (8, 4, 128, True, "BFloat16")
OVERLAP_KERNELS = ("v7d", "v7e", "v7f", "v7g")  # each step's PV under the next step's softmax
POLY_EXP_KERNELS = ("v7e", "v7g")  # a quarter of P on the FMA pipe
TURN_KERNELS = ("v7f", "v7g", "v7h")  # the consumers' ping-pong


@pytest.fixture(scope="module", params=[(4, True, "v7"), (5, True, "v7"), (4, False, "v7"), (4, True, "v7b"),
                                        (5, True, "v7c"), (4, True, "v7d"), (5, False, "v7d"), (4, True, "v7e"),
                                        (5, True, "v7e"), (4, True, "v7f"), (5, True, "v7f"), (4, True, "v7g"),
                                        (4, True, "v7h"), (4, True, "v7i"), (5, True, "v7i")],
                ids=["32:8", "40:8", "32:8-direct", "v7b-32:8", "v7c-40:8", "v7d-32:8", "v7d-40:8-direct", "v7e-32:8",
                     "v7e-40:8", "v7f-32:8", "v7f-40:8", "v7g-32:8", "v7h-32:8", "v7i-32:8", "v7i-40:8"])
def v7_cubins(request, tmp_path_factory: pytest.TempPathFactory, compile_sm90) -> dict[str, Path]:
    """The two kernels of GQA 32:8 or 40:8 (at 40:8 the pass stages 5 heads' Delta_S, a CTA reads one), the
    direct build (no Delta_S copied, staged or read), v7b's (v7 with the fold deferred), v7c's (v7b with bulk
    copies), v7d's (v7c with each step's PV under the next step's softmax), v7e's (v7d with a quarter of P on
    the FMA pipe), v7f's (v7d with the consumers' ping-pong), v7g's (v7e with v7f's turns), v7h's (v7c with
    turns around its QKs) and v7i's (v7c with Delta_S loaded ahead of the QK waits)."""
    group, compensate, kernel = request.param
    config = (CONFIG[0], group, *CONFIG[2:])
    dump = tmp_path_factory.mktemp("prefill_v7")
    compile_sm90(f"""
        from pathlib import Path
        from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel
        dump = Path({str(dump)!r})
        compile_prefill_kernel(*{config!r}, kernel={kernel!r}, compensate={compensate})
        for name, class_name in (("pass", "OperandPass"), ("attention", {PRE_KERNELS[kernel]!r})):
            (path,) = dump.glob(f"*{{class_name}}_*.cubin")
            path.rename(dump / f"{{name}}.cubin")
        """, dump)
    return {"group": group, "compensate": compensate, "kernel": kernel,
            **{name: dump / f"{name}.cubin" for name in ("pass", "attention")}}


def test_operand_pass_compiles_for_sm90a(v7_cubins, cuobjdump):
    usage = cuobjdump("--dump-resource-usage", str(v7_cubins["pass"]))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), usage
    sass = cuobjdump("--dump-sass", str(v7_cubins["pass"]))
    ops = [op.strip() for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    assert not any("GMMA" in op or op.startswith(("STL", "LDL")) for op in ops)
    assert sum(op.startswith("STG.E.128") for op in ops) == 9  # the 18 KB image, 16 bytes x 9 per thread
    # v6l's producer: 2 K chunks per thread (ptxas issues half of them as HFMA2.MMA with a -0 addend: a * b + -0 is
    # the product exactly, HMUL2's rounding)
    assert sum(op.startswith(("HMUL2", "HFMA2.MMA")) for op in ops) == 2 * (16 + 2)
    assert sum(op.startswith("LDSM.16.MT88.4") for op in ops) == 4  # the V transpose
    assert sum(op.startswith("F2FP.SATFINITE.E4M3.F16") for op in ops) == 32  # K's 64 values per thread to e4m3
    staged = sum(op.startswith("STS.64") for op in ops)  # Delta_S: 2 keys of a head per store, 4 or 5 heads' 128 / 160
    assert staged == (0 if not v7_cubins["compensate"] else 1 if v7_cubins["group"] == 4 else 2)


def test_attention_compiles_for_sm90a(v7_cubins, cuobjdump):
    kernel = v7_cubins["kernel"]
    usage = cuobjdump("--dump-resource-usage", str(v7_cubins["attention"]))
    assert re.search(r"REG:168\b", usage) and re.search(r"LOCAL:0\b", usage), usage
    overlap = kernel in OVERLAP_KERNELS
    wide_regs = overlap or kernel == "v7i"  # setmaxnreg 240 for the consumers
    # v7d / v7i at 32:8: words live across the walk spilled once before it, reloaded after it (none in the loops)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= (24 if wide_regs else 16)
    sass = cuobjdump("--dump-sass", str(v7_cubins["attention"]))
    producer_regs, consumer_regs = pre.OVERLAP_REGS if wide_regs else (56, 224)
    assert f"USETMAXREG.DEALLOC.CTAPOOL 0x{producer_regs:x}" in sass
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x{consumer_regs:x}" in sass
    consumer_loops = mma_loops(sass)
    assert len(consumer_loops) == 2, [len(body) for body in consumer_loops]
    for whole, body in enumerate(consumer_loops):
        assert not any(op.startswith(("STL", "LDL")) for op in body)
        poly_exps = 64 // pre.PrefillSm90WgmmaPreOverlapPolyExp.poly_exp_every if kernel in POLY_EXP_KERNELS else 0
        v6_tests._check_wide(body, v7_cubins["compensate"], bool(whole), True, pv_waits=int(not overlap),
                             poly_exps=poly_exps, turns=kernel in TURN_KERNELS)
        c2 = f"{float(np.float32(EXP2_POLY[2])):.20f}"  # as the SASS prints an FP32 immediate
        cubic = [op for op in body if op.startswith("FFMA") and op.endswith(c2)]
        assert len(cubic) == poly_exps  # the cubic's first FFMA, c3 f + c2, once per P on the FMA pipe
    if kernel in ("v7c", "v7h", "v7i", *OVERLAP_KERNELS):
        _check_bulk_producer(sass)
        if kernel in ("v7c", "v7h", "v7i"):
            _check_deferred_fold(consumer_loops[1])
            _check_ds_loads(consumer_loops[1], ahead=kernel == "v7i")
        for body in consumer_loops if overlap else ():
            _check_overlap(body)
        for body in consumer_loops if kernel in TURN_KERNELS else ():
            _check_turns(body)
        if kernel in TURN_KERNELS:
            _check_walk_turns(sass)
        return
    (producer,) = loops_issuing(sass, ("LDGSTS",))
    assert sum(op.startswith("LDGSTS.E.BYPASS.128") for op in producer) == 9
    assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in producer) == 1  # wait empty[s]
    assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in producer) == 1  # arrive full[s - 1]
    assert sum(op.startswith("DEPBAR.LE SB0, 0x1") for op in producer) == 1 and "FENCE.VIEW.ASYNC.S" in producer
    assert not any(op.startswith(("HMUL2", "LDSM", "STSM", "LDS", "STS", "BAR.")) for op in producer)
    assert len(producer) < 100
    if v7_cubins["kernel"] == "v7b":
        _check_deferred_fold(consumer_loops[1])


def _check_bulk_producer(sass: str) -> None:
    """v7c's producer: one thread's loop of an ``empty`` wait, the ``arrive.expect_tx`` on ``full`` and one bulk
    copy of the 18 KB image (its size in 16-byte units); no cp.async, no proxy fence (the bulk copy writes through
    the async proxy)."""
    ops = [op for _, op in instructions(sass)]
    (copy,) = [i for i, op in enumerate(ops) if op.startswith("UBLKCP.S.G")]
    assert not any(op.startswith("LDGSTS") for op in ops)
    loop = ops[copy - 30:copy + 1]  # the producer's step: back to its empty wait
    assert not any(op.startswith("FENCE.VIEW.ASYNC.S") for op in loop)
    assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in loop) == 1
    assert sum(op.startswith("SYNCS.ARRIVE.TRANS64 RZ") for op in loop) == 1  # full[s]: arrive.expect_tx
    assert any(op.startswith("UMOV") and op.endswith(f"0x{pre.IMAGE_BYTES // 16:x}") for op in loop)


def _check_ds_loads(body: list[str], ahead: bool) -> None:
    """A whole-tile pair step's Delta_S loads (4 x 16 bytes per tile): v7c's each after its tile's QK wait; v7i's
    one wait earlier, the first tile's before the first wait and the second's between the two (``ds_ahead``)."""
    waits = [i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR")]
    loads = [i for i, op in enumerate(body) if op.startswith("LDS.128")]
    assert len(loads) == 8, loads
    before_first = sum(i < waits[0] for i in loads)
    between = sum(waits[0] < i < waits[1] for i in loads)
    assert (before_first, between) == ((4, 4) if ahead else (0, 4)), (loads, waits)


def _check_deferred_fold(body: list[str]) -> None:
    """v7b's whole-tile step: the previous step's fold (O = O alpha + P V, 68 FFMA) after the first QK's k-steps
    are all issued and before the first wait (ptxas puts most of it between the second QK's first k-step and the
    others), and no wgmma serialized (ptxas inserts a wait after every wgmma of a loop it cannot pipeline: still
    v7's three waits)."""
    qk = [i for i, op in enumerate(body) if op.startswith("QGMMA.64x64x32")]
    first_wait = next(i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR"))
    assert sum(op.startswith("WARPGROUP.DEPBAR") for op in body) == 3
    fold = [op for op in body[qk[3]:first_wait] if op.startswith("FFMA")]
    assert len(fold) >= 64, f"{len(fold)} FFMA between the first QK's last k-step and the first wait"


def _check_overlap(body: list[str]) -> None:
    """v7d's step (masked or whole): both QKs issued, then step j - 2's fold (>= 64 FFMA), then step j - 1's PV (4
    k-steps), all before the first wait; the waits in order for the first QK, the second, the PV (no wgmma
    serialized); between the PV's issue and its wait no instruction writes a register the PV reads (its P operand)
    or writes (its accumulator), and the pending stages are released only after that wait."""
    ops = [re.sub(r"^@!?P\d ", "", op) for op in body]
    gmma = [i for i, op in enumerate(ops) if op.startswith("QGMMA")]
    pv = [i for i in gmma if ops[i].startswith("QGMMA.64x136x32")]
    waits = [(i, op) for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR")]
    assert [op.split()[-1] for _, op in waits] == ["0x2", "0x1", "0x0"], waits
    assert len(pv) == 4 and pv == gmma[-4:] and pv[-1] < waits[0][0]
    assert sum(op.startswith("FFMA") for op in ops[gmma[0]:pv[0]]) >= 64, "the fold before the PV's issue"
    pv_done = waits[2][0]
    busy = set()
    for i in pv:  # QGMMA.64x136x32.F32.E4M3.E4M3 Racc, Ra, gdesc[...]: 68 accumulator and 4 A registers
        acc, a = (int(r) for r in re.match(r"QGMMA\S* R(\d+), R(\d+),", ops[i]).groups())
        busy |= set(range(acc, acc + 68)) | set(range(a, a + 4))
    for op in ops[pv[0] + 1:pv_done]:
        written = re.match(r"(?!QGMMA|ST|SYNCS|WARPGROUP|BRA|BAR)\S+ R(\d+)\b", op)
        width = 2 if re.match(r"\S+\.64 ", op) else 1
        assert not written or not busy & set(range(int(written.group(1)), int(written.group(1)) + width)), op
    assert all(i > pv_done for i, op in enumerate(body) if "SYNCS.ARRIVE.TRANS64" in op and op.startswith("@"))


def test_images_layout():
    from mpfa.kernels.sm90.prefill_wgmma_ws import PrefillSm90WgmmaWsWideTileMmaSum

    v6n = PrefillSm90WgmmaWsWideTileMmaSum(*CONFIG)
    assert pre.IMAGE_BYTES == v6n.operand_stage_bytes == 18432 == 16 * 128 * pre.UNITS_PER_THREAD
    for group in (4, 5):  # the whole group's Delta_S before the exponent, in the image's padding
        assert v6n.qk_bytes + v6n.v_bytes + pre.image_ds_bytes(group) <= pre.EXPONENT_OFFSET < pre.IMAGE_BYTES
        assert pre.PrefillSm90WgmmaPre(8, group, 128, True).operand_stage_bytes == pre.IMAGE_BYTES
        assert pre.OperandPass(8, group, 128).operand_stage_bytes == pre.IMAGE_BYTES
    assert [pre.image_row(start, h, t, 10) for start, h, t in ((0, 0, 0), (3, 0, 4), (0, 1, 0), (5, 1, 2))] == [
        0, 7, 10, 17]
    v7 = pre.PrefillSm90WgmmaPre(*CONFIG)
    assert v7.smem_bytes <= 227 * 1024 and v7.offsets[1] + 8 * pre.IMAGE_BYTES == v7.barrier_offset
    assert prefill_numerics("v7") == "mpfa-qk8tile-psum"


def test_image_layout_packs_the_sequences_tiles():
    """Each sequence's tiles start after the tiles (64 keys, rounded up) of the sequences before it; without the
    host's lengths a KV head gets batch x the page table's tiles (no read-back), with them exactly the sum, and the
    operand pass's grid the longest sequence's tiles."""
    import torch

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


def _check_turns(body: list[str]) -> None:
    """v7f's / v7g's / v7h's step (masked or whole): its ping-pong turn taken (``bar.sync``, 256 threads) after the
    first stage's ``full`` wait and before the first wgmma, handed over (``bar.arrive``) after the last wgmma issued
    before the first wait (v7f, v7g: the PV's last k-step; v7h: the second QK's) and before that wait
    (`v6_tests._check_wide`: once each, no other barrier)."""
    ops = [re.sub(r"^@!?P\d ", "", op) for op in body]
    (sync,) = [i for i, op in enumerate(ops) if op.startswith("BAR.SYNC")]
    (arrive,) = [i for i, op in enumerate(ops) if op.startswith("BAR.ARV")]
    gmma = [i for i, op in enumerate(ops) if op.startswith("QGMMA")]
    full_wait = next(i for i, op in enumerate(ops) if op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT"))
    first_wait = next(i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR"))
    assert ops[sync].endswith("0x100") and ops[arrive].endswith("0x100")
    assert full_wait < sync < gmma[0] and max(i for i in gmma if i < first_wait) < arrive < first_wait


def _check_walk_turns(sass: str) -> None:
    """v7f's / v7g's turns over the whole consumer: 5 ``bar.sync`` and 5 ``bar.arrive`` of 256 threads (consumer 1's
    first hand-over before its walk, an odd walk's first step in its masked and whole forms, the two loops'
    steps, consumer 0's last take after its walk), and every step's turn (its barrier id in a register) handed over
    after at least one wgmma and before the next turn."""
    ops = [re.sub(r"^@!?P\d ", "", op) for _, op in instructions(sass)]
    bars = [(i, op) for i, op in enumerate(ops) if op.startswith("BAR.") and op.endswith("0x100")]
    assert sum(op.startswith("BAR.SYNC") for _, op in bars) == 5, bars
    assert sum(op.startswith("BAR.ARV") for _, op in bars) == 5, bars
    for k, (i, op) in enumerate(bars):
        if re.match(r"BAR.SYNC\S* R\d+,", op):  # a step's turn
            j, after = bars[k + 1]
            assert after.startswith("BAR.ARV") and any(o.startswith("QGMMA") for o in ops[i:j]), (op, after)


def test_v7_limits_are_clear_errors():
    with pytest.raises(ValueError, match="group 4 or 5 only"):
        compile_prefill_kernel(8, 6, 128, True, "BFloat16", kernel="v7")


def _pipeline_completes(tiles: int, stages: int, lag: int, hold: bool = False, pingpong: bool = False) -> bool:
    """Whether the producer / consumers protocol of v6l (``lag`` 0: step p's ``full`` right after its fill) or v7
    (``lag`` 1: step p's ``full`` after step p + 1's copy is issued, the last one after the walk) finishes a walk of
    ``tiles`` steps with ``stages`` operand stages. Both consumers take 128-key pairs (`wide_walk`: an odd walk's
    first step alone) and release a unit's stages once it is done, or (``hold``, v7d) a pair's stages once the next
    pair's wgmmas are issued (the last pair's after the walk). ``pingpong`` (v7f): consumer w takes its turn (a token
    on its barrier) after its unit's first ``full`` wait and hands it to the other after its last; consumer 1 hands
    consumer 0 the first turn, consumer 0 takes the last hand-over after its walk. Step p can be filled once both
    consumers released step p - stages. Runs each party as far as it can until none moves."""
    return _programs_complete(tiles, stages, lag, [_consumer_program(w, _units(tiles), hold, pingpong)
                                                   for w in range(2)])


def _units(tiles: int) -> list[tuple[int, ...]]:
    """The consumers' walk units (`wide_walk`): an odd walk's first step alone, then pairs."""
    lead = tiles & 1
    return [(0,)] * lead + [(lead + 2 * k, lead + 2 * k + 1) for k in range(tiles // 2)]


def _programs_complete(tiles: int, stages: int, lag: int, programs: list[list]) -> bool:
    """`_pipeline_completes` on the consumers' action lists (`_consumer_program`)."""
    full, released, turns = [False] * tiles, [0] * tiles, [0, 0]
    done = [0, 0]  # each consumer's next action
    produced = 0
    while True:
        moved = False
        while produced < tiles and (produced < stages or released[produced - stages] == 2):
            if produced >= lag:  # (lag 1: step p - 1 lands once step p's copy is issued)
                full[produced - lag] = True
            produced, moved = produced + 1, True
        if produced == tiles and tiles:
            full[tiles - 1] = True
        for w, program in enumerate(programs):
            while done[w] < len(program):
                action, arg = program[done[w]]
                if action == "full" and not full[arg] or action == "turn" and not turns[w]:
                    break
                if action == "turn":
                    turns[w] -= 1
                elif action == "hand":
                    turns[1 - w] += 1  # a named barrier holds one phase's arrivals: never two hand-overs pending
                    assert turns[1 - w] <= 1, "a turn handed over twice before its owner took it"
                elif action == "release":
                    released[arg] += 1
                done[w], moved = done[w] + 1, True
        if done == [len(program) for program in programs]:
            return True
        if not moved:
            return False


def _consumer_program(w: int, units: list, hold: bool, pingpong: bool) -> list:
    """Consumer w's actions in `_pipeline_completes`: ("full", step), ("turn", None), ("hand", None),
    ("release", step)."""
    program = [("hand", None)] if pingpong and w == 1 else []
    for k, unit in enumerate(units):
        program.append(("full", unit[0]))
        program += [("turn", None)] if pingpong else []
        program += [("full", p) for p in unit[1:]]
        program += [("hand", None)] if pingpong else []
        if not hold or len(unit) == 1:
            program += [("release", p) for p in unit]
        elif k and len(units[k - 1]) == 2:  # v7d: the previous pair, once this pair's wgmmas are issued
            program += [("release", p) for p in units[k - 1]]
    if hold and units and len(units[-1]) == 2:
        program += [("release", p) for p in units[-1]]
    return program + ([("turn", None)] if pingpong and w == 0 else [])


def test_image_pipeline_never_deadlocks():
    """v7's producer (8 stages, one step behind), v7c's (8 stages, full when the bytes land), v7d's (v7c's, each pair
    held one pair longer), v7f's (v7d's with the consumers' turns) and v6l's (4 stages) finish every walk length; one
    stage (a pair needs two), for v7 two stages (the step behind holds one back) or for v7d / v7f three (two held,
    two waited for) would not."""
    for tiles in range(0, 40):
        assert _pipeline_completes(tiles, 8, lag=1) and _pipeline_completes(tiles, 4, lag=0), tiles
        assert _pipeline_completes(tiles, 8, lag=0), tiles
        assert _pipeline_completes(tiles, 8, lag=0, hold=True) and _pipeline_completes(tiles, 4, lag=0, hold=True)
        assert _pipeline_completes(tiles, 8, lag=0, hold=True, pingpong=True), tiles
        assert _pipeline_completes(tiles, 4, lag=0, hold=True, pingpong=True), tiles
        assert _pipeline_completes(tiles, 8, lag=0, pingpong=True), tiles  # v7h
    assert not _pipeline_completes(5, 1, lag=0) and not _pipeline_completes(5, 2, lag=1)
    assert not _pipeline_completes(6, 3, lag=0, hold=True) and _pipeline_completes(6, 3, lag=0)
    assert not _pipeline_completes(6, 3, lag=0, hold=True, pingpong=True)


def test_pingpong_model_catches_unbalanced_turns():
    """The model fails on the turns alone: without consumer 1's first hand-over neither consumer starts, and a
    consumer that takes a second turn in a step waits for a hand-over that never comes."""
    units = _units(7)
    programs = [_consumer_program(w, units, hold=True, pingpong=True) for w in range(2)]
    assert _programs_complete(7, 8, 0, programs)
    assert not _programs_complete(7, 8, 0, [programs[0], programs[1][1:]])
    twice = programs[0][:3] + [("turn", None)] + programs[0][3:]
    assert not _programs_complete(7, 8, 0, [twice, programs[1]])
