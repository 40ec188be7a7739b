"""The sm90 prefill kernel (v1, `prefill`) compiles for sm_90a on a CPU-only machine (from fake tensors, the path
`mpfa_prefill` takes on the GPU), runs its MMAs on the tensor cores and keeps everything in registers (no local
memory); its direct build (``compensate=False``) loads no Delta_S. The compile runs in a fresh process: the DSL
reads its dump settings once at import. Host-side input checks are tested here too (they fail before anything
touches a device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import mpfa_prefill  # noqa: E402

# (KV heads, group, page size, causal, output dtype): Llama-3.1-8B causal BF16, Qwen3-14B non-causal FP32.
CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 5, 128, False, "Float32")]
BUILDS = [(config, True) for config in CONFIGS] + [(CONFIGS[0], False)]  # (configuration, compensate)
HMMA_PER_TILE = 64  # 4 n-tiles x 8 k-steps of QK^T + 2 query n-tiles x 8 m-tiles of PV (an e4m3 MMA is two FP16)
DELTA_S_LOADS_PER_TILE = 8  # 2-byte loads: 4 n-tiles x 2 keys (the K scales' 4 stay)


@pytest.fixture(scope="module")
def prefill_cubins(tmp_path_factory: pytest.TempPathFactory, compile_sm90) -> dict[tuple, Path]:
    """One v1 cubin per build (the dump's file names come from the argument types only, so each is renamed right
    after its compile)."""
    dump = tmp_path_factory.mktemp("prefill")
    code = f"""
        from pathlib import Path
        from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel
        for i, (config, compensate) in enumerate({BUILDS!r}):
            compile_prefill_kernel(*config, kernel="v1", compensate=compensate)
            (cubin,) = Path({str(dump)!r}).glob("*PrefillSm90_*.cubin")  # v1's class
            cubin.rename(Path({str(dump)!r}) / f"build{{i}}.cubin")
        """
    compile_sm90(code, dump)
    return {build: dump / f"build{i}.cubin" for i, build in enumerate(BUILDS)}


def _build_id(build: tuple) -> str:
    config, compensate = build
    return "hkv{}-g{}-page{}-causal{}-{}".format(*config) + ("" if compensate else "-direct")


@pytest.mark.parametrize("build", BUILDS, ids=_build_id)
def test_prefill_kernel_compiles_for_sm90a(prefill_cubins, cuobjdump, build):
    sass = cuobjdump("--dump-sass", str(prefill_cubins[build]))
    # Per 32-key tile, in the masked and the unpredicated tile loop (the compiler may peel an iteration).
    hmma = sass.count("HMMA.16816.F32")
    assert hmma >= 2 * HMMA_PER_TILE and hmma % HMMA_PER_TILE == 0, f"QK^T and PV must run on the tensor cores: {hmma}"
    usage = cuobjdump("--dump-resource-usage", str(prefill_cubins[build]))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the prefill kernel spills: {usage}"


def test_direct_build_loads_no_delta_s(prefill_cubins, cuobjdump):
    """``compensate=False``: the same MMAs and K / V loads, no more registers, and none of the 8 Delta_S loads per
    copy of the tile body."""
    counts = {}
    for compensate in (True, False):
        cubin = str(prefill_cubins[CONFIGS[0], compensate])
        sass = cuobjdump("--dump-sass", cubin)
        counts[compensate] = dict(hmma=sass.count("HMMA.16816.F32"), ldg128=len(re.findall(r"\bLDG\.E\.128\b", sass)),
                                  ldg16=len(re.findall(r"\bLDG\.E\.U16\b", sass)),
                                  registers=int(re.search(r"REG:(\d+)", cuobjdump("--dump-resource-usage", cubin))[1]))
    full, direct = counts[True], counts[False]
    assert (direct["hmma"], direct["ldg128"]) == (full["hmma"], full["ldg128"]), counts
    assert direct["registers"] <= full["registers"], counts
    assert full["ldg16"] - direct["ldg16"] == DELTA_S_LOADS_PER_TILE * full["hmma"] // HMMA_PER_TILE, counts


def _inputs(total_q=5, hq=8, hkv=2, page_size=128, batch=2):
    query = CenteredQuery.allocate(total_q, hq, 128, "cpu")
    cache = MpfaKVCache.allocate(4, page_size, hq, hkv, 128, "cpu")
    return dict(query=query, cache=cache, page_table=torch.zeros((batch, 2), dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 2, total_q], dtype=torch.int32),
                seq_lens_k=torch.tensor([2, 3], dtype=torch.int32))


@pytest.mark.parametrize("change,message", [
    (dict(seq_lens_k=torch.tensor([2, 3])), "seq_lens_k must be int32"),
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens_q must be int32 \[3\]"),
    (dict(page_table=torch.zeros((2, 2), dtype=torch.int64)), "page_table must be int32"),
    (dict(cache=MpfaKVCache.allocate(4, 16, 8, 2, 128, "cpu")), "page_size >= 32"),
    (dict(cache=MpfaKVCache.allocate(4, 128, 16, 2, 128, "cpu")), "query has 8 heads, the cache 16"),
    (dict(out=torch.empty((5, 8, 128), dtype=torch.float16)), "out must be contiguous BF16 or FP32"),
    (dict(sm_scale=-1.0), "sm_scale must be positive"),
])
def test_bad_inputs_raise_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        mpfa_prefill(**{**_inputs(), **change})


@pytest.mark.parametrize("kernel", ["v1", "v2", "v3", "v3w8"])
def test_compensate_reaches_the_compile(monkeypatch: pytest.MonkeyPatch, kernel):
    """``mpfa_prefill(..., compensate=False)`` compiles the direct build (the flag is part of the compile key), as
    the ablation path does for v1; the default is the compensated kernel."""
    from mpfa.kernels.sm90 import prefill_launch
    from mpfa.kernels.sm90.ablation import FULL

    calls = []

    def compile_prefill_kernel(*args):
        calls.append(args)
        return lambda *_: None  # no launch on the CPU

    monkeypatch.setattr(prefill_launch, "compile_prefill_kernel", compile_prefill_kernel)
    inputs = {**_inputs(), "max_seqlen_q": 3}
    mpfa_prefill(**inputs, kernel=kernel, compensate=False)
    mpfa_prefill(**inputs, kernel=kernel)
    config = (2, 4, 128, True, "BFloat16", None, kernel)  # (KV heads, group, page, causal, out, ablation, kernel)
    if kernel == "v1":
        prefill_launch.mpfa_prefill_ablated(FULL, **inputs, kernel="v1", compensate=False)
    assert calls == [(*config, False), (*config, True)] + [(*config, False)] * (kernel == "v1")


def test_no_queries_launch_nothing():
    inputs = _inputs(total_q=0)
    inputs["query"] = CenteredQuery.allocate(0, 8, 128, "cpu")
    inputs["cu_seqlens_q"] = torch.zeros(3, dtype=torch.int32)
    out = mpfa_prefill(**inputs)
    assert out.shape == (0, 8, 128) and out.dtype == torch.bfloat16
