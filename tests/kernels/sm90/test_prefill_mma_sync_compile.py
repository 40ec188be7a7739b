"""The mma-sync prefill kernel (`prefill_mma_sync`) compiles for sm_90a on a CPU-only machine through the launcher's
path (`compile_prefill_kernel(..., kernel="mma-sync")`), without local memory, with registers for 2 CTAs of 4 warps
per SM and the shape of SASS it was designed for, per tile loop (with the blocks ptxas moves out of it): 64 HMMA;
16 LDS.128 of expanded B registers + 8 of V + 1 raw K chunk, 8 + 1 LDS.U16 (Delta_S, the expanded n-tile's scales),
4 STS.128 and 17 HMUL2 (one n-tile's expansion, not four); one CTA barrier, the copy plan's cp.async copies, no
global load of K / V / Delta_S (only the page-table entry of the next tile). Shapes: GQA 32:8 and 40:8, pages of
128 and 64, 5:1 (an odd number of query heads) and 24:8 (GQA group 3) with pages of 32 keys. The direct build
(``compensate=False``) has no Delta_S: 8 fewer LDS.U16 and no 4-byte cp.async."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.sm90 import prefill_staged_layout as sl  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import kernel_block_m  # noqa: E402

# (KV heads, group, page size, causal, output dtype): GQA 32:8 and 40:8, pages of 128 (plugin) and 64; 5:1 (Qwen3-14B
# at tensor parallelism 8) and 24:8, with pages of 32 keys (shapes the wgmma kernels refuse)
CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 4, 64, False, "Float32"), (8, 5, 128, False, "Float32"),
           (8, 5, 64, True, "BFloat16"), (1, 5, 32, True, "BFloat16"), (8, 3, 32, False, "BFloat16")]
BUILDS = [(c, True, "mma-sync") for c in CONFIGS] + [(CONFIGS[0], False, "mma-sync")]  # (config, compensate, kernel)
IDS = ["32:8-causal-bf16-page128", "32:8-noncausal-f32-page64", "40:8-noncausal-f32-page128",
       "40:8-causal-bf16-page64", "5:1-causal-bf16-page32", "24:8-noncausal-bf16-page32",
       "32:8-causal-bf16-page128-direct"]
REGISTERS_PER_SM = 65536
SMEM_PER_SM = 227 * 1024
TILE_LOOP_MAX_INSTRUCTIONS = 800  # ~675 (whole tiles) / ~725 (masked)


@pytest.fixture(scope="module")
def mma_sync_cubins(tmp_path_factory: pytest.TempPathFactory, compile_builds) -> dict[tuple, Path]:
    return compile_builds(BUILDS, "PrefillSm90MmaSync", tmp_path_factory.mktemp("prefill_mma_sync"))


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


@pytest.mark.parametrize("config,compensate,kernel", BUILDS, ids=IDS)
def test_mma_sync_prefill_compiles_for_sm90a(mma_sync_cubins, cuobjdump, config, compensate, kernel):
    from mpfa.kernels.sm90.prefill_mma_sync import PrefillSm90MmaSync

    cubin = mma_sync_cubins[config, compensate, kernel]
    usage = cuobjdump("--dump-resource-usage", str(cubin))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the mma-sync prefill spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    launcher = PrefillSm90MmaSync(*config, compensate=compensate)
    assert launcher.threads == 32 * sl.CTA_WARPS and launcher.block_m == kernel_block_m(config[1], kernel)
    allocated = -(-registers // 8) * 8 * launcher.threads  # registers are allocated per warp, 8 per thread at a time
    ctas = REGISTERS_PER_SM // allocated
    assert ctas * sl.CTA_WARPS == 8, f"{registers} registers: {ctas} CTAs of 4 warps per SM, not 8 warps"
    assert launcher.smem_bytes <= 48 * 1024 and ctas * (launcher.smem_bytes + 1024) <= SMEM_PER_SM  # 42 KB: 26 + 16

    sass = cuobjdump("--dump-sass", str(cubin))
    copies = len(sl.copy_plan(launcher.heads, compensate))
    assert _count(Counter(_opcode(t) for _, t in _instructions(sass)), "LDGSTS") >= copies, "no cp.async copies"
    loops = tile_loops(sass)
    assert len(loops) >= 2, "a masked and a whole-tile loop"
    delta_s = 8 if compensate else 0  # LDS.U16 of Delta_S: 4 n-tiles x 2 keys
    for ops in loops:
        assert _count(ops, "HMMA") == 64, ops  # 4 n-tiles x 8 k-steps QK^T + 2 x 8 m-tiles x 2 (e4m3 k32) PV
        assert (ops["LDS.128"], ops["LDS.U16"], ops["STS.128"], ops["HMUL2"]) == (25, 1 + delta_s, 4, 17), ops
        assert ops["instructions"] <= TILE_LOOP_MAX_INSTRUCTIONS, ops
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


def test_direct_build_copies_no_delta_s(mma_sync_cubins, cuobjdump):
    """``compensate=False`` (`CONFIGS[0]`): the compensated build's HMMAs, K / V / scale copies and registers, and
    none of its 4-byte Delta_S copies (one per copy of a tile: the prologue's and the tile loops')."""
    builds = {compensate: mma_sync_cubins[CONFIGS[0], compensate, "mma-sync"] for compensate in (True, False)}
    sass = {compensate: cuobjdump("--dump-sass", str(cubin)) for compensate, cubin in builds.items()}
    registers = {compensate: int(re.search(r"REG:(\d+)", cuobjdump("--dump-resource-usage", str(cubin)))[1])
                 for compensate, cubin in builds.items()}
    hmma = {compensate: _count(Counter(_opcode(t) for _, t in _instructions(text)), "HMMA")
            for compensate, text in sass.items()}
    full, direct = _cp_async_bytes(sass[True]), _cp_async_bytes(sass[False])
    assert hmma[False] == hmma[True] and registers[False] <= registers[True], (hmma, registers)
    assert full[4] > 0 and direct == Counter({size: n for size, n in full.items() if size != 4}), (full, direct)
