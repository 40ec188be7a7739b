"""Compile-time ablations of the fp8 prefill kernel (`kernels/sm90/ablation.py`, timing only): every rung of the
ladder compiles for sm_90a on a CPU-only machine and removes what it says (SASS instruction counts) while keeping
the QK wgmmas and the loop; the ablation parameter leaves the real kernel's code unchanged; only the fp8 kernel has
ablations, and only `mpfa_prefill_ablated` reaches them. Each compile runs in a fresh process with its own dump
folder (the DSL reads its dump settings once at import and names the files after the class, so two ablations in
one process would overwrite each other's dumps)."""

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

from mpfa.kernels.sm90.ablation import FULL, LADDER, Ablation  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import ablation_ladder, compile_prefill_kernel, mpfa_prefill, mpfa_prefill_ablated
from mpfa.kernels.sm90.sass import mma_loops  # noqa: E402

CONFIG = (8, 4, 128, True, "BFloat16")  # Llama-3.1-8B causal, the characterize shape


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


def _compile(dump: Path, call: str) -> Path:
    """Run ``call`` (a compile_prefill_kernel call) in a fresh process -> the cubin of the fp8 kernel's attention."""
    dump.mkdir(parents=True, exist_ok=True)
    code = ("from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel\n"
            "from mpfa.kernels.sm90.ablation import Ablation\n" + call + "\n")
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env = {**clean, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(dump)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (cubin,) = list(dump.glob("*PrefillSm90Fp8_*.cubin"))
    return cubin


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """(SASS, resource usage) of the fp8 kernel's attention built without an ablation (what `mpfa_prefill` runs)
    and at every rung of `LADDER` (the first, `FULL`, explicitly)."""
    root = tmp_path_factory.mktemp("ablation")
    calls = {"default": f"compile_prefill_kernel(*{CONFIG!r}, kernel='fp8')"}
    calls |= {ablation.name: f"compile_prefill_kernel(*{CONFIG!r}, {ablation!r}, kernel='fp8')"
              for _label, ablation, _removed in LADDER}
    found = {}
    for name, call in calls.items():
        cubin = _compile(root / name, call)
        found[name] = _cuobjdump("--dump-sass", str(cubin)), _cuobjdump("--dump-resource-usage", str(cubin))
    return found


@pytest.mark.slow
def test_the_full_build_is_the_real_kernel(builds):
    """The explicit `FULL` ablation traces exactly the default path: the same SASS."""
    assert builds[FULL.name][0] == builds["default"][0]


@pytest.mark.slow
@pytest.mark.parametrize("step", [ablation for _label, ablation, _removed in LADDER[1:]], ids=lambda a: a.name)
def test_each_rung_removes_its_piece(builds, step):
    """The kernel's loops (masked, whole) at each rung: no local memory; exp2 off, no MUFU (one FMNMX clamp each
    instead); row statistics off, fewer instructions than the rung before; PV off, no PV wgmma (its k-steps
    m64n136k32), the QK's 8 wgmmas kept."""
    sass, usage = builds[step.name]
    assert re.search(r"LOCAL:0\b", usage), usage
    loops = mma_loops(sass)
    assert len(loops) == 2
    for body in loops:
        assert not any(op.startswith(("STL", "LDL", "MUFU")) for op in body)
        assert sum(op.startswith("QGMMA.64x64x32") for op in body) == 8
        assert sum(op.startswith("QGMMA.64x136x32") for op in body) == (4 if step.pv else 0)
    if not step.rowstats:
        before = [len(body) for body in mma_loops(builds[Ablation(exp2=False).name][0])]
        assert all(len(body) < n for body, n in zip(loops, before))


def test_the_ladder_and_its_limits():
    """The ladder is cumulative from `FULL` (no dequantization rung: the fp8 kernel's K is expanded in its operand
    pass); the kernels without ablations are a clear error."""
    assert ablation_ladder("fp8") is LADDER
    assert LADDER[0][1] == FULL and FULL.is_full and FULL.name == "full"
    assert [removed for *_, removed in LADDER] == [None, "exp2", "rowstats", "pv"]
    off = set()
    for _label, ablation, removed in LADDER[1:]:
        off.add(removed)
        assert {name for name in ("exp2", "rowstats", "pv") if not getattr(ablation, name)} == off
    assert Ablation(exp2=False, pv=False).name == "no-exp2-pv"
    assert hash(Ablation(exp2=False)) == hash(Ablation(exp2=False))
    for kernel in ("exact", "mma-sync"):
        with pytest.raises(ValueError, match=f"ablations exist for the fp8 prefill kernel only, got {kernel}"):
            ablation_ladder(kernel)
        with pytest.raises(ValueError, match=f"got {kernel}"):
            compile_prefill_kernel(*CONFIG, Ablation(exp2=False), kernel)
    with pytest.raises(ValueError, match="ablation must be an Ablation"):
        compile_prefill_kernel(*CONFIG, "no-exp2", "fp8")


def test_ablations_are_not_reachable_from_the_public_prefill():
    assert "ablation" not in inspect.signature(mpfa_prefill).parameters
    with pytest.raises(ValueError, match="ablation must be an Ablation"):
        mpfa_prefill_ablated("no-exp2", None, None, None, None, None)
