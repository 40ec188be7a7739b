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
# count, which v2 handles since Delta_S rows are padded per KV head).
CONFIGS = [(8, 4, 1), (8, 5, 16), (8, 4, 128), (1, 5, 16)]


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def decode_cubins(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[tuple[int, int, int], str], list[Path]]:
    """Compile the split and merge kernels of every config and split-kernel version (v2 with both output dtypes)
    -> the cubins of each (config, version); v2 and v3 are one class, so each version gets its own dump."""
    found = {}
    for config in CONFIGS:
        for kernel in ("v1", "v2", "v3", "v4", "v2-direct", "v4-direct") if config == CONFIGS[0] else ("v1", "v2", "v3", "v4"):
            dump = tmp_path_factory.mktemp("hkv{}-g{}-page{}-".format(*config) + kernel)
            dtypes = ("BFloat16", "Float32") if kernel == "v2" else ("BFloat16",)
            _python(f"""
                from mpfa.kernels.sm90.decode_launch import compile_decode_kernels
                for out_dtype in {dtypes!r}:
                    compile_decode_kernels({config[0]}, {config[1]}, {config[2]}, out_dtype, kernel={kernel[:2]!r},
                                           compensate={not kernel.endswith("direct")})
                """, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(dump))
            found[config, kernel] = sorted(dump.glob("*.cubin"))
    return found


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


SPLIT_CLASS = {"v1": "SplitKVDecodeSm90_", "v2": "SplitKVDecodeSm90Pipelined", "v3": "SplitKVDecodeSm90Pipelined",
               "v4": "SplitKVDecodeSm90Lean"}


@pytest.mark.parametrize("kernel", ["v4", "v3", "v2", "v1"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}".format(*c))
def test_decode_kernels_compile_for_sm90a(decode_cubins, config, kernel):
    from mpfa.kernels.sm90.decode_launch import STAGES, WARPS_PER_SM

    cubins = decode_cubins[config, kernel]
    split = [c for c in cubins if SPLIT_CLASS[kernel] in c.name]
    assert split and any("DecodeMerge" in c.name for c in cubins), f"missing cubins: {[c.name for c in cubins]}"
    sass = _cuobjdump("--dump-sass", str(split[0]))
    # 8 k-steps x 4 n-tiles of QK^T, and 8 m-tiles of PV (an e4m3 m16n8k32 is two FP16 MMAs on sm_90; v4 issues
    # the two FP16 MMAs itself). v4 puts the keys in M (8 k-steps x 2 m-tiles of QK^T) and peels its first tile off
    # the loop: 32 MMAs in the loop, 64 in all.
    tile_copies = 3 if kernel == "v4" else STAGES.get(kernel, 0)
    per_tile = 32 if kernel == "v4" else 48
    assert sass.count("HMMA.16816.F32") == per_tile * (2 if kernel == "v4" else 1), "MMAs must run on the tensor cores"
    assert [sum(op.startswith("HMMA.16816.F32") for op in loop) for loop in _tile_loops(sass)] == [per_tile]
    usage = _cuobjdump("--dump-resource-usage", str(split[0]))
    assert re.search(r"LOCAL:0\b", usage), f"the decode kernel spills: {usage}"
    # WARPS_PER_SM one-warp CTAs per SM (12 for v1 / v2, 9 for v3) need <= 65,536 / (32 x warps) registers.
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert registers <= 65536 // (32 * WARPS_PER_SM[kernel]) // 8 * 8, f"{registers} registers: too few warps fit"
    if tile_copies:
        # Prologue (stages - 1 tiles; v4 also its peeled tile) + loop: 12 16-byte and 12 4-byte cp.async per tile
        # copy (v4: 8 4-byte, one Delta_S word per key of its lane, two heads each), one commit each, one wait in
        # the loop that leaves stages - 1 tiles in flight.
        words = 8 if kernel == "v4" else 12
        assert (sass.count("LDGSTS.E.BYPASS.LTC128B.128") == 12 * tile_copies
                and sass.count("LDGSTS.E.LTC128B ") == words * tile_copies), \
            "the pipelined kernels must copy each tile global -> shared with cp.async"
        assert sass.count("LDGDEPBAR") == tile_copies, "one commit per tile copy"
        in_flight = STAGES.get(kernel, 2) - 1
        assert f"DEPBAR.LE SB0, 0x{in_flight}" in sass, f"{kernel} must keep {in_flight} tiles in flight"


@pytest.mark.parametrize("kernel,tile_copies,ds_words", [("v2", 2, 8), ("v4", 3, 4)])
def test_direct_decode_reads_no_delta_s(decode_cubins, kernel, tile_copies, ds_words):
    """The direct build (``compensate=False``) drops the Delta_S word copies (v2: 8, one per score key; v4: 4, one
    per key of the lane's S^T rows) of each tile copy (v2: prologue and loop; v4: prologue, peeled tile and loop),
    nothing else."""
    def split_sass(kernel: str) -> str:
        cubin = next(c for c in decode_cubins[CONFIGS[0], kernel] if "SplitKVDecode" in c.name)
        return _cuobjdump("--dump-sass", str(cubin))

    compensated, direct = split_sass(kernel), split_sass(kernel + "-direct")
    assert (direct.count("LDGSTS.E.BYPASS.LTC128B.128") == compensated.count("LDGSTS.E.BYPASS.LTC128B.128")
            == 12 * tile_copies)
    assert compensated.count("LDGSTS.E.LTC128B ") - direct.count("LDGSTS.E.LTC128B ") == tile_copies * ds_words
    assert direct.count("HMMA.16816.F32") == compensated.count("HMMA.16816.F32")


def _tile_loops(sass: str) -> list[list[str]]:
    from mpfa.kernels.sm90.sass import mma_loops

    return mma_loops(sass, ("HMMA",))


# SASS instructions per lane in the tile loop (one 32-key tile; the loop body between backward branches, the
# predicated-off rescale included), measured with nvidia-cutlass-dsl 4.5.2 / ptxas of CUDA 12.9: v4 at most this
# (+2% slack), and at least V4_SAVES fewer than v2 at the same config.
V4_TILE_SASS = {(8, 4, 128): 646, (8, 4, 1): 730, (8, 5, 16): 741, (1, 5, 16): 741}
V4_SAVES = {(8, 4, 128): 280, (8, 4, 1): 230, (8, 5, 16): 230, (1, 5, 16): 230}


def test_decode_v4w14_fits_14_warps_per_sm(decode_cubins):
    """``v4w14`` is v4 with its workspace partitioned for 14 warps per SM: at pages of >= 32 keys v4 takes <= 144
    registers and 15 KB of shared memory per warp, so 14 one-warp CTAs fit an SM (shared memory allows no 15th)."""
    from mpfa.kernels.sm90.decode_launch import WARPS_PER_SM
    from mpfa.kernels.sm90.decode_pipelined import SMEM_BYTES
    from mpfa.kernels.sm90.sass import ctas_per_sm

    cubin = next(c for c in decode_cubins[(8, 4, 128), "v4"] if SPLIT_CLASS["v4"] in c.name)
    usage = _cuobjdump("--dump-resource-usage", str(cubin))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert WARPS_PER_SM["v4w14"] == 14 == ctas_per_sm(registers, 32, SMEM_BYTES), f"{registers} registers"


def test_decode_merge_fits_its_threads_without_spilling(tmp_path):
    """The merge runs `WARPS` (32) warps per CTA: its registers must fit that many threads (64), with no local
    memory (session 18's running fold spilled at 32 warps)."""
    from mpfa.kernels.sm90.decode_merge import WARPS

    _python("""
        from mpfa.kernels.sm90.decode_launch import compile_decode_kernels
        compile_decode_kernels(8, 4, 128, "BFloat16")
        """, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(tmp_path))
    [merge] = [c for c in tmp_path.glob("*.cubin") if "DecodeMerge" in c.name]
    registers = int(re.search(r"REG:(\d+)", _cuobjdump("--dump-resource-usage", str(merge))).group(1))
    assert registers <= 65536 // (32 * WARPS), f"{registers} registers"
    assert not re.search(r"\b(LDL|STL)\b", _cuobjdump("--dump-sass", str(merge))), "the merge spills"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}".format(*c))
def test_decode_v4_issues_fewer_instructions_per_tile(decode_cubins, config):
    """Decode v4 (`decode_lean`) is v2 with fewer instructions per tile: the split kernel is issue-bound
    (profiles/NOTES.md, "Decode v3"), so the per-tile count is its figure of merit."""
    def tile_loop(kernel: str) -> list[str]:
        cubin = next(c for c in decode_cubins[config, kernel] if SPLIT_CLASS[kernel] in c.name)
        [loop] = _tile_loops(_cuobjdump("--dump-sass", str(cubin)))
        return loop

    v2, v4 = tile_loop("v2"), tile_loop("v4")
    assert len(v4) <= V4_TILE_SASS[config] * 1.02, f"v4's tile loop grew: {len(v4)} instructions"
    assert len(v2) - len(v4) >= V4_SAVES[config], f"v2 {len(v2)} vs v4 {len(v4)} instructions per tile"
    assert not any(op.startswith(("LDL", "STL")) for op in v4), "v4 spills in its tile loop"


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
