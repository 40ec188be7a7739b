"""The ``split-kv-fused`` decode (the merge folded into the split kernel) compiles for sm_90a on a CPU-only machine:
the split kernel's tile loop unchanged, no local memory, registers within the 12 one-warp CTAs an SM holds, one
arrival atomic with its fences, and the other warps' partials read through L2 (never the read-only path).

Compiled in a fresh process (`compile_sm90`), next to the default build of the same
shape (GQA 32:8 and 40:8, pages of 128 as SGLang serves)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

CONFIGS = [(8, 4, 128), (8, 5, 128)]  # (KV heads, group, page size): 32:8 and 40:8
KERNELS = ("split-kv", "split-kv-fused")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory: pytest.TempPathFactory, compile_sm90) -> dict[tuple[tuple[int, int, int], str], Path]:
    """The split kernel's cubin of each (config, decode kernel)."""
    dump = tmp_path_factory.mktemp("decode-fused")
    builds = [(config, kernel) for config in CONFIGS for kernel in KERNELS]
    compile_sm90(f"""
        from pathlib import Path
        from mpfa.kernels.sm90.decode_launch import compile_decode_kernels
        dump = Path({str(dump)!r})
        for config, kernel in {builds!r}:
            compile_decode_kernels(*config, "BFloat16", kernel=kernel)
            folder = dump / ("hkv{{}}-g{{}}-page{{}}-".format(*config) + kernel)
            folder.mkdir()
            for path in [*dump.glob("*.cubin"), *dump.glob("*.ptx")]:
                path.rename(folder / path.name)
        """, dump)
    return {(config, kernel): next(c for c in (dump / ("hkv{}-g{}-page{}-".format(*config) + kernel)).glob("*.cubin")
                                   if "SplitKVDecode" in c.name)
            for config, kernel in builds}


def _tile_loops(sass: str) -> list[list[str]]:
    from mpfa.kernels.sm90.sass import mma_loops

    return mma_loops(sass, ("HMMA",))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}".format(*c))
def test_fused_decode_compiles_without_local_memory(cubins, cuobjdump, config):
    from mpfa.kernels.sm90.decode_launch import WARPS_PER_SM

    usage = cuobjdump("--dump-resource-usage", str(cubins[config, "split-kv-fused"]))
    assert re.search(r"LOCAL:0\b", usage), f"the fused decode spills: {usage}"
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    print(f"split-kv-fused {config}: {registers} registers, no local memory")
    assert registers <= 65536 // (32 * WARPS_PER_SM) // 8 * 8, f"{registers} registers: too few warps fit"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}".format(*c))
def test_fused_decode_keeps_the_split_loop_and_counts_once(cubins, cuobjdump, config):
    """The tile loop is the default build's (same MMAs, within 2% of its instructions); one atomic per warp, with
    a fence before it (release) and after it (acquire); the merge reads each query head's partials as
    2 x `MERGE_ROWS` 16-byte rows through L2 per 32 partitions and writes no partials of its own."""
    from mpfa.kernels.sm90.decode import MERGE_ROWS

    fused = cuobjdump("--dump-sass", str(cubins[config, "split-kv-fused"]))
    default = cuobjdump("--dump-sass", str(cubins[config, "split-kv"]))
    assert fused.count("HMMA.16816.F32") == default.count("HMMA.16816.F32") == 64
    [fused_loop], [default_loop] = _tile_loops(fused), _tile_loops(default)
    assert len(fused_loop) <= len(default_loop) * 1.02, (len(fused_loop), len(default_loop))
    assert not any(op.startswith(("LDL", "STL")) for op in fused_loop)
    assert fused.count("ATOMG.E.ADD.STRONG.GPU") == 1 and "ATOM" not in default
    assert fused.count("MEMBAR.ALL.GPU") >= 2 and "MEMBAR" not in default
    group = config[1]
    assert fused.count("LDG.E.128.STRONG.GPU") == group * 2 * MERGE_ROWS, "the partials must be read through L2"
    # the default build's read-only loads (Q), none more: the merge never reads through the non-coherent path
    assert fused.count("LDG.E.128.CONSTANT") == default.count("LDG.E.128.CONSTANT")
    assert "STG.E.U16" in fused and "STG.E.U16" not in default  # the BF16 output, written by the merging warp
