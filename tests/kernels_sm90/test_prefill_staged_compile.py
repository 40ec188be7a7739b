"""The staged prefill (v2, `prefill_staged`) compiles for sm_90a on a CPU-only machine through the launcher's path
(`compile_prefill_kernel(..., staged=True)`), without local memory, with v1's registers (2 CTAs of 4 warps per
SM) and the shape of SASS it was designed for, per tile loop: 64 HMMA; with K expanded once per CTA
(``shared_dequant``, the default) 16 LDS.128 of B registers + 8 of V + 1 raw K chunk, 8 + 1 LDS.U16 (Delta_S, the
expanded n-tile's scales), 4 STS.128 and 17 HMUL2 (one n-tile's expansion, not four); without it 4 + 8 LDS.128
and 4 + 8 LDS.U16; one CTA barrier, no global load of K / V / Delta_S (only the page-table entry of the next
tile), cp.async copies. Also the kernel switch (`MPFA_PREFILL_KERNEL`) and the benchmark backends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_launch  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m, use_staged  # noqa: E402

# (KV heads, group, page size, causal, output dtype): GQA 32:8 and 40:8, pages of 128 (plugin) and 64.
CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32"), (8, 5, 128, False, "Float32"),
           (8, 5, 64, True, "BFloat16")]
PER_WARP_DEQUANT = (8, 4, 128, False, "BFloat16")  # also compiled with shared_dequant=False
REGISTERS_PER_SM = 65536
SMEM_PER_SM = 227 * 1024
TILE_LOOP_MAX_INSTRUCTIONS = 800  # ~600 (whole tiles) / ~650 (masked) + ~85 copying: a regression guard
PER_WARP_DEQUANT_MAX_INSTRUCTIONS = 1000  # ~790 / ~815 + the copy block


def _tool(name: str) -> Path:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not tool.exists():
        pytest.skip(f"{name} (shipped with triton) not found to inspect the SASS")
    return tool


def _cuobjdump(*args: str) -> str:
    return subprocess.run([str(_tool("cuobjdump")), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def staged_cubins(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """One cubin per configuration (the dump's file names come from the argument types only, so each is renamed
    right after its compile)."""
    dump = tmp_path_factory.mktemp("prefill_staged")
    code = f"""
        from pathlib import Path
        from mpfa.kernels.sm90 import prefill_staged
        from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel
        for i, config in enumerate({CONFIGS!r} + [{PER_WARP_DEQUANT!r}]):
            prefill_staged.SHARED_DEQUANT = i < {len(CONFIGS)}
            compile_prefill_kernel(*config, staged=True)
            (cubin,) = Path({str(dump)!r}).glob("*PrefillSm90Staged*.cubin")
            cubin.rename(Path({str(dump)!r}) / f"config{{i}}.cubin")
        """
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", prefill_launch.KERNEL_ENV)}
    env = {**clean, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(dump)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return {(config, i < len(CONFIGS)): dump / f"config{i}.cubin"
            for i, config in enumerate(CONFIGS + [PER_WARP_DEQUANT])}


def _instructions(sass: str) -> list[tuple[int, str]]:
    found = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2).strip()))
    return found


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def tile_loops(sass: str) -> list[Counter]:
    """Opcode counts (full opcodes, e.g. ``LDS.128``) of every loop body (a backward branch) that runs MMAs."""
    instructions = _instructions(sass)
    index = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        match = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if match and int(match.group(1), 16) < address:
            body = [t for _, t in instructions[index[int(match.group(1), 16)]:i + 1]]
            ops = Counter(_opcode(t) for t in body if not t.startswith("@!PT "))  # ptxas' never-executed padding
            ops["instructions"] = len(body)
            if any(op.startswith("HMMA") for op in ops):
                loops.append(ops)
    return loops


def _count(ops: Counter, prefix: str) -> int:
    return sum(n for op, n in ops.items() if op == prefix or op.startswith(prefix + "."))


@pytest.mark.parametrize("config,shared_dequant", [(c, True) for c in CONFIGS] + [(PER_WARP_DEQUANT, False)],
                         ids=["hkv{}-g{}-page{}-causal{}-{}".format(*c) for c in CONFIGS] + ["per-warp-dequant"])
def test_staged_prefill_compiles_for_sm90a(staged_cubins, config, shared_dequant):
    from mpfa.kernels.sm90.prefill_staged import PrefillSm90Staged

    cubin = staged_cubins[config, shared_dequant]
    usage = _cuobjdump("--dump-resource-usage", str(cubin))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the staged prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    kernel = PrefillSm90Staged(*config, shared_dequant=shared_dequant)
    allocated = -(-registers // 8) * 8 * kernel.threads  # registers are allocated per warp, 8 per thread at a time
    assert kernel.threads == 128 and 2 * allocated <= REGISTERS_PER_SM, f"{registers} registers: < 2 CTAs per SM"
    assert kernel.smem_bytes <= 48 * 1024 and 2 * (kernel.smem_bytes + 1024) <= SMEM_PER_SM  # 42 KB: 26 ring + 16

    sass = _cuobjdump("--dump-sass", str(cubin))
    assert _count(Counter(_opcode(t) for _, t in _instructions(sass)), "LDGSTS") >= 5, "no cp.async copies"
    loops = tile_loops(sass)
    assert len(loops) >= 2, "a masked and a whole-tile loop"
    for ops in loops:
        assert _count(ops, "HMMA") == 64, ops  # 4 n-tiles x 8 k-steps QK^T + 2 x 8 m-tiles x 2 (e4m3 k32) PV
        if shared_dequant:
            assert (ops["LDS.128"], ops["LDS.U16"], ops["STS.128"], ops["HMUL2"]) == (25, 9, 4, 17), ops
            assert ops["instructions"] <= TILE_LOOP_MAX_INSTRUCTIONS, ops
        else:
            assert (ops["LDS.128"], ops["LDS.U16"], ops["HMUL2"]) == (12, 12, 68), ops
            assert ops["instructions"] <= PER_WARP_DEQUANT_MAX_INSTRUCTIONS, ops
        assert _count(ops, "LDG") <= 1, f"global loads in the tile loop (only the next page entry may be): {ops}"
        assert _count(ops, "BAR") <= 1, ops
    assert sum(_count(ops, "BAR") for ops in loops) >= 1


def test_kernel_switch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    assert use_staged(32) and not use_staged(31)  # v2 is the default (validated on the H200), even Hq only
    assert use_staged(32, "v2") and not use_staged(32, "v1") and not use_staged(33, "v2")  # v2: even Hq only
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "V2")
    assert use_staged(40) and not use_staged(40, "v1")
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v3")
    with pytest.raises(ValueError, match="must be v1 or v2"):
        use_staged(32)
    assert kernel_block_m(4, True) == 16 and kernel_block_m(5, True) == 64 and kernel_block_m(4, False) == 64


def test_ablations_stay_on_v1():
    from mpfa.kernels.sm90.ablation import Ablation

    with pytest.raises(ValueError, match="v1 prefill kernel only"):
        compile_prefill_kernel(8, 4, 128, True, "BFloat16", Ablation(exp2=False), True)


def test_bench_backends_pin_the_prefill_kernel():
    """``--backend mpfa-v1,mpfa-v2`` times both prefill kernels in one run (the decode is the same)."""
    from mpfa.profiles.bench_kernels import bytes_read
    from mpfa.profiles.registry import adapter_for
    from mpfa.profiles.workload import AttentionWorkload

    assert adapter_for("mpfa").prefill_kernel is None
    assert [adapter_for(f"mpfa-{v}").prefill_kernel for v in ("v1", "v2")] == ["v1", "v2"]
    decode = AttentionWorkload("decode", 131072, 1, 32, 8, 128)
    assert bytes_read("mpfa-v2", decode, 132) == bytes_read("mpfa-v1", decode, 132) == bytes_read("mpfa", decode, 132)
