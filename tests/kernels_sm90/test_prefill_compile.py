"""The sm90 prefill kernel compiles for sm_90a on a CPU-only machine (from fake tensors, the path `mpfa_prefill`
takes on the GPU), runs its MMAs on the tensor cores and keeps everything in registers (no local memory). The
compile runs in a fresh process: the DSL reads its dump settings once at import. Host-side input checks are
tested here too (they fail before anything touches a device)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install '.[kernels-compile]')")
pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed (pip install '.[kernels-compile]')")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[kernels-compile]')")

from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache  # noqa: E402
from mpfa.kernels.sm90.prefill_launch import mpfa_prefill  # noqa: E402

# (KV heads, group, page size, causal, output dtype): Llama-3.1-8B causal BF16, Qwen3-14B non-causal FP32.
CONFIGS = [(8, 4, 128, True, "BFloat16"), (8, 5, 128, False, "Float32")]


def _cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump (shipped with triton) not found to inspect the SASS")
    return subprocess.run([str(tool), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def prefill_cubins(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    dump = tmp_path_factory.mktemp("prefill")
    code = "from mpfa.kernels.sm90.prefill_launch import compile_prefill_kernel\n" + "".join(
        f"compile_prefill_kernel{config!r}\n" for config in CONFIGS)
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env = {**clean, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(dump)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    cubins = sorted(dump.glob("*Prefill*.cubin"), key=lambda p: p.stat().st_mtime)
    assert len(cubins) == len(CONFIGS), [c.name for c in cubins]
    return dict(zip(CONFIGS, cubins))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hkv{}-g{}-page{}-causal{}-{}".format(*c))
def test_prefill_kernel_compiles_for_sm90a(prefill_cubins, config):
    sass = _cuobjdump("--dump-sass", str(prefill_cubins[config]))
    # Per 32-key tile: 4 n-tiles x 8 k-steps of QK^T and 2 query n-tiles x 8 m-tiles of PV (an e4m3 m16n8k32 is
    # two FP16 MMAs on sm_90), in the masked and the unpredicated tile loop (the compiler may peel an iteration).
    hmma = sass.count("HMMA.16816.F32")
    assert hmma >= 128 and hmma % 64 == 0, f"QK^T and PV must run on the tensor cores ({hmma} HMMA)"
    usage = _cuobjdump("--dump-resource-usage", str(prefill_cubins[config]))
    assert re.search(r"LOCAL:0\b", usage) and re.search(r"STACK:0\b", usage), f"the prefill kernel spills: {usage}"


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


def test_no_queries_launch_nothing():
    inputs = _inputs(total_q=0)
    inputs["query"] = CenteredQuery.allocate(0, 8, 128, "cpu")
    inputs["cu_seqlens_q"] = torch.zeros(3, dtype=torch.int32)
    out = mpfa_prefill(**inputs)
    assert out.shape == (0, 8, 128) and out.dtype == torch.bfloat16
