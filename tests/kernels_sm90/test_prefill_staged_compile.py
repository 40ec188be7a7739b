"""The staged prefill (v2, `prefill_staged`) compiles for sm_90a on a CPU-only machine through the launcher's path
(`compile_prefill_kernel(..., kernel="v2" / "v2w8")`), without local memory, with v1's registers (8 warps per SM:
2 CTAs of 4 warps, or 1 of 8) and the shape of SASS it was designed for, per tile loop (with the blocks ptxas
moves out of it): 64 HMMA; with K expanded once per CTA (``shared_dequant``, the default) 16 LDS.128 of B
registers + 8 of V + 1 raw K chunk, 8 + 1 LDS.U16 (Delta_S, the expanded n-tile's scales), 4 STS.128 and 17 HMUL2
(one n-tile's expansion, not four; 8 warps: half an n-tile, 2 STS.128 and 9 HMUL2); without it 4 + 8 LDS.128 and
4 + 8 LDS.U16; one CTA barrier, the copy plan's cp.async copies, no global load of K / V / Delta_S (only the
page-table entry of the next tile). The direct build (``compensate=False``) has no Delta_S: 8 fewer LDS.U16 and
no 4-byte cp.async. Also the kernel switch (`MPFA_PREFILL_KERNEL`) and the benchmark backends."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_launch  # noqa: E402
from mpfa.kernels.sm90 import prefill_staged_layout as sl  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel, kernel_block_m, prefill_kernel  # noqa: E402

# (KV heads, group, page size, causal, output dtype): GQA 32:8 and 40:8, pages of 128 (plugin) and 64.
CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32"), (8, 5, 128, False, "Float32"),
           (8, 5, 64, True, "BFloat16")]
PER_WARP_DEQUANT = (8, 4, 128, False, "BFloat16")  # also compiled with shared_dequant=False
# (configuration, kernel, shared_dequant, compensate); v2w8 only where it has 8 warps (40:8 keeps v2's 4-warp
# shape); the direct build (no Delta_S) of the first configuration
BUILDS = ([(c, "v2", True, True) for c in CONFIGS] + [(PER_WARP_DEQUANT, "v2", False, True)]
          + [(c, "v2w8", True, True) for c in CONFIGS if c[1] == 4] + [(CONFIGS[0], "v2", True, False)])
REGISTERS_PER_SM = 65536
SMEM_PER_SM = 227 * 1024
TILE_LOOP_MAX_INSTRUCTIONS = 800  # ~675 (whole tiles) / ~725 (masked) with 4 warps, ~660 / ~710 with 8
PER_WARP_DEQUANT_MAX_INSTRUCTIONS = 1000  # ~855 / ~880


@pytest.fixture(scope="module")
def staged_cubins(tmp_path_factory: pytest.TempPathFactory, compile_sm90) -> dict[tuple, Path]:
    """One cubin per build (the dump's file names come from the argument types only, so each is renamed right
    after its compile)."""
    dump = tmp_path_factory.mktemp("prefill_staged")
    code = f"""
        from pathlib import Path
        from mpfa.kernels.sm90 import prefill_staged
        from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel
        for i, (config, kernel, shared_dequant, compensate) in enumerate({BUILDS!r}):
            prefill_staged.SHARED_DEQUANT = shared_dequant
            compile_prefill_kernel(*config, kernel=kernel, compensate=compensate)
            (cubin,) = Path({str(dump)!r}).glob("*PrefillSm90Staged*.cubin")
            cubin.rename(Path({str(dump)!r}) / f"build{{i}}.cubin")
        """
    compile_sm90(code, dump)
    return {build: dump / f"build{i}.cubin" for i, build in enumerate(BUILDS)}


def _instructions(sass: str) -> list[tuple[int, str]]:
    found = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2).strip()))
    return found


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def _branch_target(text: str) -> int | None:
    match = re.search(r"\bBRA (0x[0-9a-f]+)", text)
    return int(match.group(1), 16) if match else None


def _outlined_block(instructions: list, index: dict, start: int, first: int, last: int) -> range:
    """The block at ``start`` if it ends with an unconditional branch back into the loop [first, last] (a piece of
    the loop ptxas placed elsewhere), else an empty range."""
    for i in range(index[start], len(instructions)):
        text = instructions[i][1]
        if text.startswith("BRA ") or "EXIT" in text:
            target = _branch_target(text)
            return range(index[start], i + 1) if target is not None and first <= target <= last else range(0)
    return range(0)


def tile_loops(sass: str) -> list[Counter]:
    """Opcode counts (full opcodes, e.g. ``LDS.128``) of every loop (a backward branch) that runs MMAs, with the
    blocks it branches out to and back from; ``instructions``: their number (what a warp may run per tile)."""
    instructions = _instructions(sass)
    index = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        head = _branch_target(text)
        if head is None or head >= address:
            continue
        lines = set(range(index[head], i + 1))
        for j in sorted(lines):
            target = _branch_target(instructions[j][1])
            if target is not None and not head <= target <= address:
                lines.update(_outlined_block(instructions, index, target, head, address))
        body = [instructions[j][1] for j in sorted(lines) if not instructions[j][1].startswith("@!PT ")]
        ops = Counter(_opcode(t) for t in body)  # without ptxas' never-executed padding (@!PT)
        ops["instructions"] = len(body)
        if any(op.startswith("HMMA") for op in ops):
            loops.append(ops)
    return loops


def _count(ops: Counter, prefix: str) -> int:
    return sum(n for op, n in ops.items() if op == prefix or op.startswith(prefix + "."))


@pytest.mark.parametrize("config,kernel_name,shared_dequant,compensate", BUILDS,
                         ids=["{}-hkv{}-g{}-page{}-causal{}-{}".format(k, *c) + ("" if d else "-per-warp-dequant")
                              + ("" if comp else "-direct") for c, k, d, comp in BUILDS])
def test_staged_prefill_compiles_for_sm90a(staged_cubins, cuobjdump, config, kernel_name, shared_dequant,
                                           compensate):
    from mpfa.kernels.sm90.prefill_staged import PrefillSm90Staged

    cubin = staged_cubins[config, kernel_name, shared_dequant, compensate]
    usage = cuobjdump("--dump-resource-usage", str(cubin))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the staged prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    warps = prefill_launch.STAGED_WARPS[kernel_name]
    kernel = PrefillSm90Staged(*config, warps=warps, shared_dequant=shared_dequant, compensate=compensate)
    assert kernel.threads == 32 * warps
    allocated = -(-registers // 8) * 8 * kernel.threads  # registers are allocated per warp, 8 per thread at a time
    ctas = REGISTERS_PER_SM // allocated
    assert ctas * warps == 8, f"{registers} registers: {ctas} CTAs of {warps} warps per SM, not 8 warps"
    assert kernel.smem_bytes <= 48 * 1024 and ctas * (kernel.smem_bytes + 1024) <= SMEM_PER_SM  # 42 KB: 26 + 16

    sass = cuobjdump("--dump-sass", str(cubin))
    copies = len(sl.copy_plan(kernel.heads, warps, compensate))
    assert _count(Counter(_opcode(t) for _, t in _instructions(sass)), "LDGSTS") >= copies, "no cp.async copies"
    loops = tile_loops(sass)
    assert len(loops) >= 2, "a masked and a whole-tile loop"
    expanded = {4: (4, 17), 8: (2, 9)}[warps]  # STS.128 and HMUL2 of an n-tile's / half an n-tile's expansion
    delta_s = 8 if compensate else 0  # LDS.U16 of Delta_S: 4 n-tiles x 2 keys
    for ops in loops:
        assert _count(ops, "HMMA") == 64, ops  # 4 n-tiles x 8 k-steps QK^T + 2 x 8 m-tiles x 2 (e4m3 k32) PV
        if shared_dequant:
            assert (ops["LDS.128"], ops["LDS.U16"], ops["STS.128"], ops["HMUL2"]) == (25, 1 + delta_s, *expanded), ops
            assert ops["instructions"] <= TILE_LOOP_MAX_INSTRUCTIONS, ops
        else:
            assert (ops["LDS.128"], ops["LDS.U16"], ops["HMUL2"]) == (12, 12, 68), ops
            assert ops["instructions"] <= PER_WARP_DEQUANT_MAX_INSTRUCTIONS, ops
        assert _count(ops, "LDGSTS") == copies, ops  # the copy plan's copies, in the loop
        assert _count(ops, "LDG") <= 1, f"global loads in the tile loop (only the next page entry may be): {ops}"
        assert _count(ops, "BAR") == 1, ops


def _cp_async_bytes(sass: str) -> Counter:
    """cp.async (LDGSTS) instructions by copy size in bytes (a size suffix is in bits; none: 4 bytes)."""
    sizes = Counter()
    for _, text in _instructions(sass):
        parts = _opcode(text).split(".")
        if parts[0] == "LDGSTS":
            sizes[next((int(p) for p in parts if p in ("64", "128")), 32) // 8] += 1
    return sizes


def test_direct_build_copies_no_delta_s(staged_cubins, cuobjdump):
    """``compensate=False`` (`CONFIGS[0]`, v2): the compensated build's HMMAs, K / V / scale copies and registers,
    and none of its 4-byte Delta_S copies (one per copy of a tile: the prologue's and the tile loops')."""
    builds = {compensate: staged_cubins[CONFIGS[0], "v2", True, compensate] for compensate in (True, False)}
    sass = {compensate: cuobjdump("--dump-sass", str(cubin)) for compensate, cubin in builds.items()}
    registers = {compensate: int(re.search(r"REG:(\d+)", cuobjdump("--dump-resource-usage", str(cubin)))[1])
                 for compensate, cubin in builds.items()}
    hmma = {compensate: _count(Counter(_opcode(t) for _, t in _instructions(text)), "HMMA")
            for compensate, text in sass.items()}
    full, direct = _cp_async_bytes(sass[True]), _cp_async_bytes(sass[False])
    assert hmma[False] == hmma[True] and registers[False] <= registers[True], (hmma, registers)
    assert full[4] > 0 and direct == Counter({size: n for size, n in full.items() if size != 4}), (full, direct)


def test_kernel_switch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(prefill_launch.KERNEL_ENV, raising=False)
    # the default: v7i where it applies (groups 4 and 5, pages >= 64, an even Hq), else v2, v1 for an odd Hq
    assert prefill_kernel(32, 8, 128) == "v7i" and prefill_kernel(32, 8, 16) == "v2"
    assert prefill_kernel(40, 8, 128) == "v7i" and prefill_kernel(40, 8, 16) == "v2"
    assert prefill_kernel(5, 1, 128) == "v1" and prefill_kernel(48, 8, 128) == "v2"
    assert [prefill_kernel(32, 8, 128, k) for k in ("v1", "v2", "V2W8")] == ["v1", "v2", "v2w8"]
    assert prefill_kernel(35, 7, 128, "v2") == prefill_kernel(35, 7, 128, "v2w8") == "v1"  # v2: even Hq only
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "V2w8")
    assert prefill_kernel(32, 8, 128) == "v2w8" and prefill_kernel(40, 8, 128, "v1") == "v1"
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v9")
    names = ("v1, v2, v2w8, v3, v3w8, v3c, v3w8c, v4, v4w8, v5, v5w8, v6, v6a, v6b, v6c, v6d, v6e, v6f, v6g, v6h, v6i, "
             "v6j, v6k, v6l, v6m, v6n, v7, v7b, v7c, v7d, v7e, v7f, v7g, v7h or v7i")
    with pytest.raises(ValueError, match=f"must be {names}"):
        prefill_kernel(32, 8, 128)
    assert kernel_block_m(4, "v2") == 16 and kernel_block_m(4, "v2w8") == 32 and kernel_block_m(4, "v1") == 64
    assert kernel_block_m(5, "v2") == kernel_block_m(5, "v2w8") == 64  # 40:8 keeps the 4-warp shape


def test_bench_backends_pin_the_prefill_kernel():
    """``--backend mpfa-v1,mpfa-v2,mpfa-v2w8`` times the prefill kernels in one run (the decode is the same)."""
    from mpfa.profiles.bench_kernels import bytes_read
    from mpfa.profiles.registry import adapter_for
    from mpfa.profiles.workload import AttentionWorkload

    assert adapter_for("mpfa").prefill_kernel is None
    versions = ("v1", "v2", "v2w8")
    assert [adapter_for(f"mpfa-{v}").prefill_kernel for v in versions] == list(versions)
    decode = AttentionWorkload("decode", 131072, 1, 32, 8, 128)
    assert len({bytes_read(name, decode, 132) for name in ("mpfa", *(f"mpfa-{v}" for v in versions))}) == 1
