"""Every sm90 kernel compiles for sm_90a on a CPU-only machine, so a broken kernel fails CI.

The CuTe DSL kernels compile from fake tensors (the very path `mpfa_decode` takes on the GPU), the Triton kernels
through Triton's ahead-of-time compiler for a CUDA 9.0 target. Both run in a fresh process: the DSL reads its
dump settings once at import, and this test session runs Triton in interpreter mode on machines without a GPU.
The decode SASS must use the tensor cores and must not spill; the Triton PTX must divide with IEEE rounding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

# (KV heads, group, page size): Llama-3.1-8B, Qwen3-14B, and Qwen3-14B at tensor parallelism 8 (5 query heads: an odd
# count, which the decode takes since Delta_S rows are padded per KV head).
CONFIGS = [(8, 4, 1), (8, 5, 16), (8, 4, 128), (1, 5, 16)]
BUILDS = ("compensated", "direct")


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def decode_cubins(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[tuple[int, int, int], str], list[Path]]:
    """Compile the split and merge kernels of every config (the first also with an FP32 output and as the direct
    build), all in one interpreter -> the cubins of each (config, build)."""
    dump = tmp_path_factory.mktemp("decode")
    builds = [(config, build) for config in CONFIGS for build in (BUILDS if config == CONFIGS[0] else BUILDS[:1])]
    _python(f"""
        from pathlib import Path
        from mpfa.kernels.sm90.decode_launch import compile_decode_kernels
        dump = Path({str(dump)!r})
        for config, build in {builds!r}:
            first = config == {CONFIGS[0]!r} and build == "compensated"
            for out_dtype in ("BFloat16", "Float32") if first else ("BFloat16",):
                compile_decode_kernels(*config, out_dtype, compensate=build == "compensated")
            folder = dump / ("hkv{{}}-g{{}}-page{{}}-".format(*config) + build)
            folder.mkdir()
            for path in [*dump.glob("*.cubin"), *dump.glob("*.ptx")]:  # this build's files, out of the next one's way
                path.rename(folder / path.name)
        """, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(dump))
    return {(config, build): sorted((dump / ("hkv{}-g{}-page{}-".format(*config) + build)).glob("*.cubin"))
            for config, build in builds}


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


def _split_sass(decode_cubins, config: tuple[int, int, int], build: str = "compensated") -> str:
    return _cuobjdump("--dump-sass", str(next(c for c in decode_cubins[config, build] if "SplitKVDecode" in c.name)))


TILE_COPIES = 3  # prologue, peeled first tile, loop


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}".format(*c))
def test_decode_kernels_compile_for_sm90a(decode_cubins, config):
    from mpfa.kernels.sm90.decode_launch import WARPS_PER_SM

    cubins = decode_cubins[config, "compensated"]
    split = [c for c in cubins if "SplitKVDecode" in c.name]
    assert split and any("DecodeMerge" in c.name for c in cubins), f"missing cubins: {[c.name for c in cubins]}"
    sass = _split_sass(decode_cubins, config)
    # Keys in M: 8 k-steps x 2 m-tiles of QK^T and 8 m-tiles x 2 of PV per tile, the first tile peeled off the loop.
    assert sass.count("HMMA.16816.F32") == 64, "MMAs must run on the tensor cores"
    assert [sum(op.startswith("HMMA.16816.F32") for op in loop) for loop in _tile_loops(sass)] == [32]
    usage = _cuobjdump("--dump-resource-usage", str(split[0]))
    assert re.search(r"LOCAL:0\b", usage), f"the decode kernel spills: {usage}"
    # WARPS_PER_SM one-warp CTAs per SM need <= 65,536 / (32 x warps) registers.
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert registers <= 65536 // (32 * WARPS_PER_SM) // 8 * 8, f"{registers} registers: too few warps fit"
    # Per tile copy 12 16-byte cp.async (4 K, 8 V chunks) and 8 4-byte ones (4 scale words, 4 Delta_S words: one
    # per key of the lane's S^T rows, two heads each), one commit each; the loop leaves one tile in flight.
    assert (sass.count("LDGSTS.E.BYPASS.LTC128B.128") == 12 * TILE_COPIES
            and sass.count("LDGSTS.E.LTC128B ") == 8 * TILE_COPIES), "each tile must be copied global -> shared"
    assert sass.count("LDGDEPBAR") == TILE_COPIES, "one commit per tile copy"
    assert "DEPBAR.LE SB0, 0x1" in sass, "one tile must stay in flight"


def test_direct_decode_reads_no_delta_s(decode_cubins):
    """The direct build (``compensate=False``) drops the 4 Delta_S word copies of each tile copy, nothing else."""
    compensated, direct = _split_sass(decode_cubins, CONFIGS[0]), _split_sass(decode_cubins, CONFIGS[0], "direct")
    assert (direct.count("LDGSTS.E.BYPASS.LTC128B.128") == compensated.count("LDGSTS.E.BYPASS.LTC128B.128")
            == 12 * TILE_COPIES)
    assert compensated.count("LDGSTS.E.LTC128B ") - direct.count("LDGSTS.E.LTC128B ") == 4 * TILE_COPIES
    assert direct.count("HMMA.16816.F32") == compensated.count("HMMA.16816.F32")


def _tile_loops(sass: str) -> list[list[str]]:
    from mpfa.kernels.sm90.sass import mma_loops

    return mma_loops(sass, ("HMMA",))


# SASS instructions per lane in the tile loop (one 32-key tile; the loop body between backward branches, the
# predicated-off rescale included), measured with nvidia-cutlass-dsl 4.5.2 / ptxas of CUDA 12.9: the split kernel
# is bound by its warps' issue (docs/kernels.md), so the per-tile count is its figure of merit; at most this + 2%.
TILE_SASS = {(8, 4, 128): 646, (8, 4, 1): 730, (8, 5, 16): 741, (1, 5, 16): 741}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}".format(*c))
def test_decode_tile_loop_stays_lean(decode_cubins, config):
    [loop] = _tile_loops(_split_sass(decode_cubins, config))
    assert len(loop) <= TILE_SASS[config] * 1.02, f"the decode tile loop grew: {len(loop)} instructions"
    assert not any(op.startswith(("LDL", "STL")) for op in loop), "the decode spills in its tile loop"


def test_decode_merge_fits_its_threads_without_spilling(decode_cubins):
    """The merge runs `WARPS` (32) warps per CTA: its registers must fit that many threads (64), with no local
    memory."""
    from mpfa.kernels.sm90.decode_merge import WARPS

    for merge in (c for c in decode_cubins[CONFIGS[0], "compensated"] if "DecodeMerge" in c.name):
        registers = int(re.search(r"REG:(\d+)", _cuobjdump("--dump-resource-usage", str(merge))).group(1))
        assert registers <= 65536 // (32 * WARPS), f"{registers} registers"
        assert not re.search(r"\b(LDL|STL)\b", _cuobjdump("--dump-sass", str(merge))), "the merge spills"


def test_triton_kernels_compile_for_sm90():
    ptx_by_kernel = _python("""
        import json
        from triton import compile
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from mpfa.kernels.sm90.quantize_cache import _quantize_cache_kernel
        from mpfa.kernels.sm90.sequence_means import _sequence_means_kernel

        byte_args = {"k_codes_ptr", "k_scales_ptr", "v_cache_ptr", "q_codes_ptr", "q_scales_ptr"}
        quantize = {n: "*u8" if n in byte_args else "*fp32" if n.endswith("_ptr") else "i32"
                    for n in _quantize_cache_kernel.arg_names}
        quantize.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64", req_ptr="*i32",
                        delta_s_ptr="*i16")
        kernels = {
            "quantize_cache": (_quantize_cache_kernel, quantize,
                               dict(NUM_KV_HEADS=8, GROUP=5, GROUP_POW2=8, DS_ROW=8, HEAD_DIM=128)),
            "sequence_means": (_sequence_means_kernel, dict(x_ptr="*bf16", cu_ptr="*i32", out_ptr="*fp32",
                               x_stride="i32"), dict(NUM_HEADS=8, HEAD_DIM=128, TOKENS=32, SPLITS=16)),
        }
        ptx = {}
        for name, (kernel, signature, constants) in kernels.items():
            signature.update({c: "constexpr" for c in constants})
            ptx[name] = compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(json.dumps(ptx))
        """)
    import json

    for name, ptx in json.loads(ptx_by_kernel).items():
        assert ".target sm_90" in ptx, name
        assert "div.full" not in ptx and "div.approx" not in ptx, f"{name}: format rounding needs IEEE division"
