"""With SGLang installed (the H200 host): the entry point registers both backends once however often it runs,
its hooks resolve against SGLang 0.5.15, and the MpFA pool builds with SGLang's MHA-pool arguments (GPU)."""

from __future__ import annotations

import pkgutil

import pytest
import torch

# SGLang's serving stack is installed where the GPUs are (the devkit), never on a CPU machine.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
sglang = pytest.importorskip("sglang") if torch.cuda.is_available() else None

from mpfa.backends.sglang_plugin import BACKEND_NAMES, register  # noqa: E402
from mpfa.backends.sglang_plugin.pool_sizing import cell_size  # noqa: E402
from mpfa.backends.sglang_plugin.hooks import hook_table  # noqa: E402


def test_register_is_idempotent():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    register()
    register()
    for name in BACKEND_NAMES:
        assert ATTENTION_BACKEND_CHOICES.count(name) == 1
        assert callable(ATTENTION_BACKENDS[name])
    for target, (hook, _) in hook_table().items():
        assert sum(h is hook for _, h, _ in HookRegistry._hooks[target]) == 1


def test_hook_targets_exist():
    for target in hook_table():
        owner, _, attr = target.rpartition(".")
        assert hasattr(pkgutil.resolve_name(owner), attr), target


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pool_builds_with_sglang_arguments():
    from mpfa.backends.sglang_plugin.sglang_pool import MpfaTokenToKVPool

    pool = MpfaTokenToKVPool(1024, page_size=128, dtype=torch.bfloat16, head_num=8, head_dim=128, v_head_dim=128,
                             layer_num=2, device="cuda", enable_memory_saver=False, start_layer=0, end_layer=1,
                             enable_alt_stream=True, enable_kv_cache_copy=False, backend="mpfa", num_q_heads=32,
                             smoothing=True)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes + v_bytes == (1024 + 128) * cell_size(pool.store.geometry)
    assert k_bytes + v_bytes + pool.store.means_bytes() == (1024 + 128) * cell_size(pool.store.geometry, 128, True)
    assert pool.dtype == torch.uint8 and pool.layer_cache(1).num_slots == 1024 + 128
    with pytest.raises(NotImplementedError, match="no BF16 K/V buffers"):
        pool.get_key_buffer(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backend_extend_decode_and_graph(paged, monkeypatch):
    """`MpfaAttnBackend` on a stand-in model runner: prefill (slow reference path, pinned here: the default prefill
    kernel tiles keys by 32 and is checked in test_gpu_prefill), eager decode and a captured decode graph, against
    `mpfa.kernels.reference`; outputs NaN-poisoned before every launch."""
    monkeypatch.setenv("MPFA_PREFILL", "reference")
    import math
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from mpfa.backends.sglang_plugin.sglang_backend import MpfaAttnBackend
    from mpfa.backends.sglang_plugin.sglang_pool import MpfaTokenToKVPool
    from mpfa.backends.sglang_plugin.variants import variant_of
    from mpfa.kernels import SmoothingMeans, attention, decode_partials, merge_partials
    from mpfa.kernels.sm90.decode_layout import TILE_KEYS

    lengths, hq, hkv, ps, d = [300, 37], 32, 8, 128, 128
    p = paged(lengths, hq, hkv, ps, "cuda")
    pool = MpfaTokenToKVPool(p.num_slots - ps, page_size=ps, dtype=torch.bfloat16, head_num=hkv, head_dim=d,
                             layer_num=2, device="cuda", enable_memory_saver=False, backend="mpfa", num_q_heads=hq,
                             smoothing=True)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=p.req_to_token),
                             page_size=ps, device="cuda", model=torch.nn.Module())
    backend = MpfaAttnBackend(runner, variant_of("mpfa"))
    layer = SimpleNamespace(layer_id=1, scaling=d**-0.5)
    rows = torch.tensor(p.rows, device="cuda")

    s = p.step([(0, n - 1) for n in lengths], "cuda")
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=rows, out_cache_loc=s["slots"],
                             extend_prefix_lens_cpu=s["prefix"], extend_seq_lens_cpu=s["extend"], batch_size=2)
    backend.init_forward_metadata(extend)
    out = backend.forward_extend(s["q"].flatten(1), s["k"], s["v"], layer, extend)
    first_pages = torch.tensor([int(p.req_to_token[row, 0]) // ps for row in p.rows], device="cuda")
    means = SmoothingMeans(pool.store.q_mean[1][first_pages].cpu(), pool.store.k_mean[1][first_pages].cpu())
    cu = torch.tensor([0, *[n - 1 for n in lengths]]).cumsum(0)
    ref = attention(s["q"].cpu(), s["k"].cpu(), s["v"].cpu(), variant="mpfa", causal=True, cu_seqlens_q=cu,
                    cu_seqlens_k=cu, means=means)
    got = out.view(-1, hq, d).float().cpu()
    assert bool(torch.isfinite(got).all())
    assert float((got - ref.bfloat16().float()).norm() / ref.norm()) <= 1e-3

    s = p.step([(n - 1, n) for n in lengths], "cuda")
    seq_lens = torch.tensor(lengths, device="cuda")
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=rows, out_cache_loc=s["slots"],
                             seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(), batch_size=2)
    backend.init_forward_metadata(decode)
    eager = backend.forward_decode(s["q"].flatten(1), s["k"], s["v"], layer, decode)
    cu_k = torch.tensor([0, *lengths]).cumsum(0)
    expected = merge_partials(decode_partials(
        s["q"].cpu(), torch.cat(p.k), torch.cat(p.v), variant="mpfa", cu_seqlens_k=cu_k,
        partition_size=backend.forward_metadata.workspace.partition_size, block_n=TILE_KEYS, means=means))
    got = eager.view(-1, hq, d).float().cpu()
    assert bool(torch.isfinite(got).all())
    assert float((got - expected).norm() / expected.norm()) <= 4e-3

    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_out_graph(decode, in_capture=True)
    direct = backend.forward_decode(s["q"].flatten(1), s["k"], s["v"], layer, decode).clone()
    graph, holder = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        holder["out"] = backend.forward_decode(s["q"].flatten(1), s["k"], s["v"], layer, decode)
    backend.init_forward_metadata_out_graph(decode)  # replay-prep
    holder["out"].fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(holder["out"], direct)
    assert float((direct.view(-1, hq, d).float().cpu() - expected).norm() / expected.norm()) <= 4e-3
