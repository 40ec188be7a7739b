"""``MPFA_NUMERICS=had128-k46`` through the plugin on the GPU: the plugin rotates Q and K (FP32 GEMM) before the means
and the KV write, which writes K's 4/6 block scales; the sm90 kernels, unchanged, then read rotated operands.

* Prefill, each kernel pinned (``MPFA_PREFILL_KERNEL``), one chunk then a second over the first: against the plugin's
  reference path in the same numerics (same cache contents) and float64 truth, with test_gpu_prefill's tolerances.
* Decode (split-KV kernel) after a reference-path prefill: against `decode_partials` of the served variant
  (``mpfa-had128-k46``, ``qk4-pv8-direct-had128-k46``) with the kernel's tiling and the stored (rotated) means, and
  float64 truth, with test_gpu_decode's tolerances.
* The decode step captured in a CUDA graph replays as it runs eagerly (the rotation's constants live on the GPU).

Not yet run on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from mpfa.backends.sglang_plugin.attention import ExtendBatch, MpfaAttention  # noqa: E402
from mpfa.backends.sglang_plugin.decode_plan import GraphDecodeBuffers, eager_decode_batch  # noqa: E402
from mpfa.backends.sglang_plugin.kv_store import MpfaKVStore  # noqa: E402
from mpfa.backends.sglang_plugin.pool_sizing import PoolGeometry  # noqa: E402
from mpfa.backends.sglang_plugin.variants import variant_of  # noqa: E402
from mpfa.kernels import SmoothingMeans, attention_float64, decode_partials, merge_partials  # noqa: E402
from mpfa.kernels.served_numerics import SERVED_NUMERICS  # noqa: E402
from mpfa.kernels.sm90.decode_layout import TILE_KEYS  # noqa: E402
from mpfa.kernels.sm90.dispatch import PREFILL_KERNEL_ENV, PREFILL_KERNELS  # noqa: E402

D, LAYER = 128, 1
NUMERICS = SERVED_NUMERICS["had128-k46"]


def _core(p, hq, hkv, backend, prefill="reference"):
    variant = variant_of(backend)
    store = MpfaKVStore.allocate(p.num_slots, p.page_size, PoolGeometry(hq, hkv, D, 2), variant.smoothing, "cuda")
    for cache in store.caches:
        cache.fill_(0xFF)
    return store, MpfaAttention(store, variant, prefill, NUMERICS)


def _extend(core, p, spans, hq):
    s = p.step(spans, "cuda")
    batch = ExtendBatch.build(p.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], p.page_size)
    out = torch.full((s["q"].shape[0], hq * D), math.nan, dtype=torch.bfloat16, device="cuda")
    out.copy_(core.extend(LAYER, s["q"].flatten(1), s["k"], s["v"], batch, D**-0.5).flatten(1))
    return out.view(-1, hq, D).float().cpu()


def _exact(p, spans):
    q = torch.cat([x[a:b] for x, (a, b) in zip(p.q, spans)])
    k = torch.cat([x[:b] for x, (_, b) in zip(p.k, spans)])
    v = torch.cat([x[:b] for x, (_, b) in zip(p.v, spans)])
    cu_q = torch.tensor([0, *[b - a for a, b in spans]]).cumsum(0)
    cu_k = torch.tensor([0, *[b for _, b in spans]]).cumsum(0)
    return attention_float64(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sm_scale=D**-0.5)


def _rms(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kernel", PREFILL_KERNELS)
@pytest.mark.parametrize("lengths, hq, hkv, page_size, backend", [
    ([300, 77, 1000], 32, 8, 128, "mpfa"),
    ([513, 64], 32, 8, 128, "mpfa-direct"),
], ids=["32x8-page128", "32x8-page128-direct"])
def test_kernel_extend_matches_the_reference_path(paged, monkeypatch, kernel, lengths, hq, hkv, page_size, backend):
    monkeypatch.setenv(PREFILL_KERNEL_ENV, kernel)
    fp8_qk = PREFILL_KERNELS[kernel].numerics != "mpfa"
    p = paged(lengths, hq, hkv, page_size, "cuda")
    (_, on_kernel), (_, reference) = _core(p, hq, hkv, backend, "kernel"), _core(p, hq, hkv, backend)
    for spans in ([(0, n // 2) for n in lengths], [(n // 2, n) for n in lengths]):
        got, ref = _extend(on_kernel, p, spans, hq), _extend(reference, p, spans, hq)
        exact = _exact(p, spans)
        assert bool(torch.isfinite(got).all()), "NaN/Inf in the kernel's output"
        if fp8_qk:
            assert _rms(got, exact) <= 1.15 * _rms(ref, exact) + 2e-3
        else:
            assert _rms(got, ref) <= 1e-2
            assert _rms(got, exact) <= 1.01 * _rms(ref, exact) + 2e-3


def _prefilled(paged, lengths, hq, hkv, page_size, backend):
    """Requests whose tokens but the last are prefilled (reference path) -> (paged, store, core)."""
    p = paged(lengths, hq, hkv, page_size, "cuda")
    store, core = _core(p, hq, hkv, backend)
    s = p.step([(0, n - 1) for n in lengths], "cuda")
    batch = ExtendBatch.build(p.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], page_size)
    core.extend(LAYER, s["q"], s["k"], s["v"], batch, D**-0.5)
    return p, store, core


def _decode_inputs(p, lengths):
    s = p.step([(n - 1, n) for n in lengths], "cuda")
    return s["q"], s["k"], s["v"], s["slots"], s["rows"], torch.tensor(lengths, device="cuda")


@pytest.mark.parametrize("lengths,hq,hkv,page_size,backend", [
    ([130, 1000, 7], 32, 8, 128, "mpfa"), ([300, 45], 10, 2, 16, "mpfa"), ([513, 64], 8, 2, 128, "mpfa-direct"),
], ids=["32x8-page128", "gqa5-page16", "direct"])
def test_decode_matches_its_numerics_reference(paged, lengths, hq, hkv, page_size, backend):
    p, store, core = _prefilled(paged, lengths, hq, hkv, page_size, backend)
    q, k, v, slots, rows, seq_lens = _decode_inputs(p, lengths)
    batch = eager_decode_batch(p.req_to_token, rows, seq_lens, max(lengths), page_size, hq, hkv, 132)
    for x in (batch.workspace.m, batch.workspace.l, batch.workspace.o):
        x.fill_(math.nan)
    out = torch.full((len(lengths), hq, D), math.nan, dtype=torch.bfloat16, device="cuda")
    core.decode(LAYER, q, k, v, slots, batch, D**-0.5, out=out)
    torch.cuda.synchronize()

    variant = variant_of(backend)
    k_all, v_all = torch.cat(p.k), torch.cat(p.v)
    cu_k = torch.tensor([0, *lengths]).cumsum(0)
    means = None
    if variant.smoothing:
        index = torch.tensor([int(p.req_to_token[row, 0]) // page_size for row in p.rows], device="cuda")
        means = SmoothingMeans(store.q_mean[LAYER][index].cpu(), store.k_mean[LAYER][index].cpu())
    ref = merge_partials(decode_partials(q.cpu(), k_all, v_all, variant=NUMERICS.variant(variant.numerics),
                                         cu_seqlens_k=cu_k, partition_size=batch.workspace.partition_size,
                                         block_n=TILE_KEYS, means=means))
    exact = attention_float64(q.cpu(), k_all, v_all, causal=False, cu_seqlens_q=torch.arange(len(lengths) + 1),
                              cu_seqlens_k=cu_k)
    got = out.float().cpu()
    assert bool(torch.isfinite(got).all())
    assert _rms(got, ref) <= 4e-3  # kernel vs oracle (~1e-3) + BF16 output rounding (2**-9)
    assert float((got - ref).abs().max()) <= 0.03 * float(ref.abs().max())
    assert _rms(got, exact) <= 1.01 * _rms(ref, exact) + 4e-3


def test_cuda_graph_replay_equals_eager(paged):
    lengths, hq, hkv, page_size = [900, 300, 64], 8, 2, 16
    p, _, core = _prefilled(paged, lengths, hq, hkv, page_size, "mpfa")
    q, k, v, slots, rows, seq_lens = _decode_inputs(p, lengths)
    buffers = GraphDecodeBuffers(4, hq, hkv, p.req_to_token.shape[1], page_size, "cuda", 132)
    out = torch.empty((3, hq, D), dtype=torch.bfloat16, device="cuda")
    batch = buffers.fill(p.req_to_token, rows, seq_lens, 3)
    core.decode(LAYER, q, k, v, slots, batch, D**-0.5, out=out)  # compiles outside the capture
    eager = out.clone()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        core.decode(LAYER, q, k, v, slots, batch, D**-0.5, out=out)
    buffers.fill(p.req_to_token, rows, seq_lens, 3)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
