"""Compile-time ablations of the sm90 prefill kernels (`kernels/sm90/ablation.py`, timing only): every step of v1's
ladder and of the v7 kernels' (the default, v7i) compiles for sm_90a on a CPU-only machine, removes what it says
(SASS instruction counts) while keeping every load (the loop is not deleted), and the ablation parameter leaves
the real kernel's code unchanged. Each compile runs in a fresh process with its own dump folder (the DSL reads its
dump settings once at import and names the files after the class, so two ablations in one process would overwrite
each other's dumps)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90.ablation import FULL, LADDER, OCCUPANCY_PAD_BYTES, PRE_LADDER, Ablation  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import (PRE_KERNELS, ablation_ladder, compile_prefill_kernel,  # noqa: E402
                                              mpfa_prefill, mpfa_prefill_ablated)
from mpfa.kernels.sm90.sass import mma_loops  # noqa: E402

CONFIG = (8, 4, 128, True, "BFloat16")  # Llama-3.1-8B causal, the characterize shape


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


def _compile(dump: Path, call: str, kernel_class: str = "Prefill") -> tuple[str, Path]:
    """Run ``call`` (a compile_prefill_kernel call) in a fresh process -> (PTX text, cubin path) of the kernel
    whose class name starts with ``kernel_class``; the host MLIR stays in ``dump``."""
    dump.mkdir(parents=True, exist_ok=True)
    code = ("from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel\n"
            "from mpfa.kernels.sm90.ablation import Ablation\n" + call + "\n")
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env = {**clean, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin,ir", "CUTE_DSL_DUMP_DIR": str(dump)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (ptx,), (cubin,) = list(dump.glob(f"*{kernel_class}*.ptx")), list(dump.glob(f"*{kernel_class}*.cubin"))
    return ptx.read_text(), cubin


def _counts(cubin: Path) -> dict[str, int]:
    sass = _cuobjdump("--dump-sass", str(cubin))
    return {"hmma": sass.count("HMMA.16816.F32"), "ex2": sass.count("MUFU.EX2"), "ldg": len(re.findall(r"\bLDG\b", sass)),
            "instructions": len(re.findall(r"/\*[0-9a-f]{4}\*/ ", sass))}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """PTX and cubin of the real v1 kernel built without an ablation (what `MPFA_PREFILL_KERNEL=v1` runs; the ladder
    exists for v1 only) and of every ladder step."""
    root = tmp_path_factory.mktemp("ablation")
    found = {"default": _compile(root / "default", f"compile_prefill_kernel(*{CONFIG!r}, kernel='v1')")}
    for _label, ablation, _removed in LADDER:
        found[ablation.name] = _compile(root / ablation.name,
                                        f"compile_prefill_kernel(*{CONFIG!r}, {ablation!r}, kernel='v1')")
    return found


@pytest.fixture(scope="module")
def pre_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """SASS of v7i's attention kernel (the default prefill) at every rung of `PRE_LADDER` but the full one (the
    real kernel: `test_prefill_v7_compile.py`)."""
    root = tmp_path_factory.mktemp("pre_ablation")
    found = {}
    for _label, ablation, _removed in PRE_LADDER[1:]:
        _, cubin = _compile(root / ablation.name, f"compile_prefill_kernel(*{CONFIG!r}, {ablation!r}, kernel='v7i')",
                            "PrefillSm90WgmmaPre")
        found[ablation.name] = _cuobjdump("--dump-sass", str(cubin)), _cuobjdump("--dump-resource-usage", str(cubin))
    return found


@pytest.mark.parametrize("step", [ablation for _label, ablation, _removed in PRE_LADDER[1:]], ids=lambda a: a.name)
def test_v7_ablations_remove_their_piece(pre_builds, step):
    """v7i's loops (masked, whole) at each rung: no local memory; exp2 off, no MUFU (one FMNMX clamp each
    instead); row statistics off, fewer instructions than the rung before; PV off, no PV wgmma (its k-steps
    m64n136k32), the QK's 8 wgmmas kept."""
    sass, usage = pre_builds[step.name]
    assert re.search(r"LOCAL:0\b", usage), usage
    loops = mma_loops(sass)
    assert len(loops) == 2
    for body in loops:
        assert not any(op.startswith(("STL", "LDL", "MUFU")) for op in body)
        assert sum(op.startswith("QGMMA.64x64x32") for op in body) == 8
        assert sum(op.startswith("QGMMA.64x136x32") for op in body) == (4 if step.pv else 0)
    if not step.rowstats:
        before = [len(body) for body in mma_loops(pre_builds[Ablation(exp2=False).name][0])]
        assert all(len(body) < n for body, n in zip(loops, before))


def test_v7_ladder_and_its_limits():
    """The v7 kernels' ladder (no dequantization: their K is expanded in the operand pass) and clear errors for the
    kernels without ablations or a piece the kernel has not."""
    assert all(ablation_ladder(kernel) is PRE_LADDER for kernel in PRE_KERNELS) and ablation_ladder("v1") is LADDER
    assert PRE_LADDER[0][1] == FULL and [removed for *_, removed in PRE_LADDER] == [None, "exp2", "rowstats", "pv"]
    with pytest.raises(ValueError, match="ablations exist for the v1, v7, v7b, .* prefill kernels, got v3w8c"):
        ablation_ladder("v3w8c")
    with pytest.raises(ValueError, match="no dequantization to ablate: its K is expanded in the operand pass"):
        compile_prefill_kernel(*CONFIG, Ablation(dequant=False), "v7c")
    with pytest.raises(ValueError, match="got v2"):
        compile_prefill_kernel(*CONFIG, Ablation(exp2=False), "v2")


def test_default_build_is_unchanged_by_the_ablation_parameter(builds):
    # the explicit FULL ablation traces exactly the default path: same PTX text, same SASS
    assert builds["full"][0] == builds["default"][0]
    assert _cuobjdump("--dump-sass", str(builds["full"][1])) == _cuobjdump("--dump-sass", str(builds["default"][1]))
    full = _counts(builds["default"][1])
    assert full["ex2"] > 0 and full["hmma"] >= 128
    assert _launch_smem(builds["default"][1]) == _launch_smem(builds["full"][1]) == [0]


def _launch_smem(cubin: Path) -> list[int]:
    """Dynamic shared memory bytes of the kernel launches in the host MLIR beside ``cubin``."""
    (mlir,) = list(cubin.parent.glob("*Prefill*.mlir"))
    return [int(size) for size in re.findall(r"dynamicSmemBytes = %c(\d+)_i64", mlir.read_text())]


@pytest.mark.parametrize("step", [ablation for _label, ablation, _removed in LADDER[1:]], ids=lambda a: a.name)
def test_each_ablation_compiles_removes_its_piece_and_keeps_the_loads(builds, step):
    full, ablated = _counts(builds["default"][1]), _counts(builds[step.name][1])
    usage = _cuobjdump("--dump-resource-usage", str(builds[step.name][1]))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), usage  # no spills skew the timing
    assert ablated["ldg"] == full["ldg"], "an ablation must keep every K / V / Delta_S load (the loop stays)"
    assert ablated["instructions"] < full["instructions"]
    assert _launch_smem(builds[step.name][1]) == [OCCUPANCY_PAD_BYTES]  # held to the full kernel's 2 CTAs per SM
    if not step.exp2:
        assert ablated["ex2"] == 0
    if step.pv:
        assert ablated["hmma"] == full["hmma"]
    else:  # only the QK^T MMAs are left: half of the HMMAs (PV's e4m3 m16n8k32 counts as two)
        assert 0 < ablated["hmma"] < full["hmma"]


def test_ladder_is_cumulative_and_starts_full():
    assert LADDER[0][1] == FULL and FULL.is_full and FULL.name == "full"
    off = set()
    for _label, ablation, removed in LADDER[1:]:
        off.add(removed)
        assert {name for name in ("exp2", "rowstats", "dequant", "pv") if not getattr(ablation, name)} == off
    assert Ablation(exp2=False, pv=False).name == "no-exp2-pv" and hash(Ablation(exp2=False)) == hash(Ablation(exp2=False))


def test_ablations_are_not_reachable_from_the_public_prefill():
    assert "ablation" not in inspect.signature(mpfa_prefill).parameters
    with pytest.raises(ValueError, match="ablation must be an Ablation"):
        mpfa_prefill_ablated("no-exp2", None, None, None, None, None)
