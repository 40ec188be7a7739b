"""The fp8 prefill kernel (`prefill_fp8` on the images of `prefill_fp8_pass`) on a CPU-only machine: both kernels
compile for sm_90a through the launcher (`compile_prefill_kernel(..., kernel="fp8")`), at GQA 32:8 and 40:8 and as
the direct build.

* The operand pass: one 128-thread CTA per tile, the ring copy, the K expansion (2 chunks per thread: 16 HMUL2 by
  the block scale and 2 for its 2**-e), the V transpose (4 LDSM.T), the Delta_S staging and the image stored with
  16-byte stores, no MMA, no local memory.
* The attention: 3 warpgroups (``.reqntid 384``: 168 registers), ``setmaxnreg`` 24 for the producer and 240 for the
  consumers, no local memory in any loop. Each consumer loop is one 128-key step: 2 x 4 QK k-steps
  (QGMMA.64x64x32) both issued before the first wait, 2 x 2 PV k-steps (QGMMA.64x136x32: the row sums on the
  tensor cores, no FADD per score), 3 wgmma waits, 2 ``full`` waits and 2 ``empty`` arrivals, no other barrier, P's
  448 in the exponent (no FMUL by 448), lam 2**-7 once, the previous step's fold (>= 64 FFMA) under the QKs and
  each tile's Delta_S (4 16-byte loads) loaded before the wait for its QK. The producer: one thread's loop of an
  ``empty`` wait, the ``arrive.expect_tx`` on ``full`` and one bulk copy of the 18 KB image, no cp.async.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_fp8 as fp8  # noqa: E402
from mpfa.kernels.sm90.prefill_fp8_layout import IMAGE_BYTES  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m  # noqa: E402
from mpfa.kernels.sm90.sass import instructions, mma_loops  # noqa: E402

CONFIG = (8, 4, 128, True, "BFloat16")


@pytest.fixture(scope="module", params=[(4, True), pytest.param((5, True), marks=pytest.mark.slow),
                                        pytest.param((4, False), marks=pytest.mark.slow)],
                ids=["32:8", "40:8", "32:8-direct"])
def fp8_cubins(request, tmp_path_factory: pytest.TempPathFactory, compile_sm90) -> dict:
    """The two kernels of GQA 32:8 or 40:8 (at 40:8 the pass stages 5 heads' Delta_S, a CTA reads one) and the
    direct build (no Delta_S copied, staged or read)."""
    group, compensate = request.param
    config = (CONFIG[0], group, *CONFIG[2:])
    dump = tmp_path_factory.mktemp("prefill_fp8")
    compile_sm90(f"""
        from pathlib import Path
        from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel
        dump = Path({str(dump)!r})
        compile_prefill_kernel(*{config!r}, kernel="fp8", compensate={compensate})
        for name, class_name in (("pass", "OperandPass"), ("attention", "PrefillSm90Fp8")):
            for suffix in ("cubin", "ptx"):
                (path,) = dump.glob(f"*{{class_name}}_*.{{suffix}}")
                path.rename(dump / f"{{name}}.{{suffix}}")
        """, dump)
    cubins = {name: dump / f"{name}.cubin" for name in ("pass", "attention")}
    return {"group": group, "compensate": compensate, **cubins}


def test_operand_pass_compiles_for_sm90a(fp8_cubins, cuobjdump):
    usage = cuobjdump("--dump-resource-usage", str(fp8_cubins["pass"]))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), usage
    ops = [op for _, op in instructions(cuobjdump("--dump-sass", str(fp8_cubins["pass"])))]
    assert not any("GMMA" in op or op.startswith(("STL", "LDL")) for op in ops)
    assert sum(op.startswith("STG.E.128") for op in ops) == 9  # the 18 KB image, 16 bytes x 9 per thread
    # 2 K chunks per thread (ptxas issues half of the multiplies as HFMA2.MMA with a -0 addend: a * b + -0 is the
    # product exactly, HMUL2's rounding)
    assert sum(op.startswith(("HMUL2", "HFMA2.MMA")) for op in ops) == 2 * (16 + 2)
    assert sum(op.startswith("LDSM.16.MT88.4") for op in ops) == 4  # the V transpose
    assert sum(op.startswith("F2FP.SATFINITE.E4M3.F16") for op in ops) == 32  # K's 64 values per thread to e4m3
    staged = sum(op.startswith("STS.64") for op in ops)  # Delta_S: 2 keys of a head per store, 4 or 5 heads' 128 / 160
    assert staged == (0 if not fp8_cubins["compensate"] else 1 if fp8_cubins["group"] == 4 else 2)


def test_attention_compiles_for_sm90a(fp8_cubins, cuobjdump):
    compensate = fp8_cubins["compensate"]
    usage = cuobjdump("--dump-resource-usage", str(fp8_cubins["attention"]))
    assert re.search(r"REG:168\b", usage) and re.search(r"LOCAL:0\b", usage), usage
    # at 32:8 a few words live across the walk spilled once before it, reloaded after it (none in the loops)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 24
    sass = cuobjdump("--dump-sass", str(fp8_cubins["attention"]))
    assert f"USETMAXREG.DEALLOC.CTAPOOL 0x{fp8.PRODUCER_REGS:x}" in sass
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x{fp8.CONSUMER_REGS:x}" in sass
    assert "HGMMA" not in sass and "HMMA" not in sass, "every MMA should be an e4m3 wgmma"
    consumer_loops = mma_loops(sass)
    assert len(consumer_loops) == 2, [len(body) for body in consumer_loops]  # masked steps, then whole ones
    for whole, body in enumerate(consumer_loops):
        assert not any(op.startswith(("STL", "LDL")) for op in body)
        _check_step(body, compensate, bool(whole))
    _check_deferred_fold(consumer_loops[1])
    if compensate:
        _check_ds_loads(consumer_loops[1])
    _check_bulk_producer(sass)
    ptx = Path(fp8_cubins["attention"]).with_suffix(".ptx").read_text(errors="replace")
    assert re.search(r"\.reqntid\s+384, 1, 1", ptx) and re.search(r"\.minnctapersm\s+1\b", ptx)
    assert fp8.PrefillSm90Fp8(CONFIG[0], fp8_cubins["group"], *CONFIG[2:]).block_m == kernel_block_m(
        fp8_cubins["group"], "fp8")


def _check_step(body: list[str], compensate: bool, whole: bool) -> None:
    """A consumer loop: one 128-key step (module docstring). In the whole steps' loop both stages' QK are in flight
    together; in the masked loop ptxas may wait for the first before setting the second's accumulator to its mask."""
    qk = [op for op in body if re.match(r"QGMMA.64x64x32.F32.E4M3.E4M3 R\d+, gdesc", op)]
    pv = [op for op in body if re.match(r"QGMMA.64x136x32.F32.E4M3.E4M3 R\d+, R\d+, gdesc", op)]
    assert len(qk) == 8 and len(pv) == 4 and sum(op.startswith("QGMMA") for op in body) == 12, body
    waits = sum(op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") for op in body)
    assert waits == 2 if whole else waits in (2, 3), body  # the QKs', the PV's
    if whole:
        last_qk = max(i for i, op in enumerate(body) if op in qk)
        first_wait = next(i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR"))
        assert last_qk < first_wait, "both stages' QK issued before the first wait"
    assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in body) == 2  # wait full[s0], full[s1]
    assert sum(op.startswith("SYNCS.ARRIVE.TRANS64") for op in body) == 2  # arrive empty[s0], empty[s1]
    assert not any(op.startswith(("VOTE", "LDSM", "STSM", "LDGSTS", "BAR.")) for op in body)
    assert not any(op.startswith("FMUL") and op.endswith(", 448") for op in body)
    assert sum(op.startswith("FMUL") and op.endswith(", 0.0078125") for op in body) == 1  # lam 2**-7
    assert sum("F2FP.SATFINITE.E4M3.F32" in op for op in body) == 32  # P of 128 keys
    # the scores' scale (and Delta_S), the exponent, the fold O = O alpha + P V
    assert sum(op.startswith("FFMA") for op in body) >= (2 if compensate else 1) * 64 + 64
    assert sum(op.startswith("MUFU.EX2") for op in body) == 64 + 2  # P, and one alpha per row
    assert sum(op.startswith("FADD") for op in body) == 2  # the row sums are the PV wgmma's: only alpha's adds
    loads = [op for op in body if op.startswith("LDS")]  # Delta_S (FP32, 4 keys a load), the 2 tiles' K exponents
    assert len(loads) == (8 if compensate else 0) + 2
    assert sum(op.startswith("LDS.128") for op in loads) == len(loads) - 2


def _check_deferred_fold(body: list[str]) -> None:
    """A whole step: the previous step's fold (O = O alpha + P V, 68 FFMA) after the first QK's k-steps are all
    issued and before the first wait (ptxas puts most of it between the second QK's first k-step and the others),
    and no wgmma serialized (ptxas inserts a wait after every wgmma of a loop it cannot pipeline: still 3 waits)."""
    qk = [i for i, op in enumerate(body) if op.startswith("QGMMA.64x64x32")]
    first_wait = next(i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR"))
    assert sum(op.startswith("WARPGROUP.DEPBAR") for op in body) == 3
    fold = [op for op in body[qk[3]:first_wait] if op.startswith("FFMA")]
    assert len(fold) >= 64, f"{len(fold)} FFMA between the first QK's last k-step and the first wait"


def _check_ds_loads(body: list[str]) -> None:
    """A whole step's Delta_S loads (4 x 16 bytes per tile): the first tile's before the first QK wait, the
    second's between the two waits."""
    waits = [i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR")]
    loads = [i for i, op in enumerate(body) if op.startswith("LDS.128")]
    assert len(loads) == 8, loads
    before_first = sum(i < waits[0] for i in loads)
    between = sum(waits[0] < i < waits[1] for i in loads)
    assert (before_first, between) == (4, 4), (loads, waits)


def _check_bulk_producer(sass: str) -> None:
    """The producer: one thread's loop of an ``empty`` wait, the ``arrive.expect_tx`` on ``full`` and one bulk copy
    of the 18 KB image (its size in 16-byte units); no cp.async, no proxy fence (the bulk copy writes through the
    async proxy)."""
    ops = [op for _, op in instructions(sass)]
    (copy,) = [i for i, op in enumerate(ops) if op.startswith("UBLKCP.S.G")]
    assert not any(op.startswith("LDGSTS") for op in ops)
    loop = ops[copy - 30:copy + 1]  # the producer's step: back to its empty wait
    assert not any(op.startswith("FENCE.VIEW.ASYNC.S") for op in loop)
    assert sum(op.startswith("SYNCS.PHASECHK.TRANS64.TRYWAIT") for op in loop) == 1
    assert sum(op.startswith("SYNCS.ARRIVE.TRANS64 RZ") for op in loop) == 1  # full[s]: arrive.expect_tx
    assert any(op.startswith("UMOV") and op.endswith(f"0x{IMAGE_BYTES // 16:x}") for op in loop)


def test_limits_are_clear_errors():
    """GQA groups above 8, pages of fewer than 64 keys and an odd number of query heads are the mma-sync
    kernel's (`dispatch.check_wgmma_shape`), refused before compiling."""
    for config in ((8, 9, 128, True, "BFloat16"), (8, 4, 32, True, "BFloat16"), (1, 5, 128, True, "BFloat16")):
        with pytest.raises(ValueError, match="the fp8 prefill kernel needs a GQA group of 1 to 8, an even number of "
                                             "query heads and pages of >= 64 keys.*use mma-sync"):
            compile_prefill_kernel(*config, kernel="fp8")


@pytest.mark.slow
@pytest.mark.parametrize("kernel,class_name", [("fp8", "PrefillSm90Fp8"), ("exact", "PrefillSm90Exact")])
def test_other_gqa_groups_compile_without_local_memory(kernel, class_name, tmp_path, compile_builds, cuobjdump):
    """Groups 1-3 and 6-8 (a CTA of 1, 2 or 4 of the group's heads): each build fits its registers with no local
    memory."""
    builds = [((8, group, 128, True, "BFloat16"), True, kernel) for group in (1, 2, 3, 6, 7, 8)]
    for build, cubin in compile_builds(builds, class_name, tmp_path).items():
        usage = cuobjdump("--dump-resource-usage", str(cubin))
        assert re.search(r"LOCAL:0\b", usage), (build, usage)
