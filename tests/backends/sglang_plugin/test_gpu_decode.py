"""The decode path on the GPU: prefill through `MpfaAttention.extend`, then one decode token per request through
the KV-write kernel and the sm90 split-KV decode, against `mpfa.kernels.reference.decode_partials` with the
kernel's tiling and the frozen prefill means, and against float64 truth; the CUDA-graph buffers captured once and
replayed. Outputs and workspaces are NaN-poisoned before each launch; NaN never passes.

Each test runs in every served numerics (`mpfa.kernels.served_numerics`, ``MPFA_NUMERICS``). Under ``had128-k46``
the plugin rotates Q and K (FP32 GEMM) before the means and the KV write (K's 4/6 block scales), the decode step's
query on its own call; the reference is `decode_partials` of the served variant (``mpfa-had128-k46``,
``qk4-pv8-direct-had128-k46``) with the stored (rotated) means, and the graph replays the rotation (its constants
live on the GPU) as it runs eagerly. The ``had128-k46`` cases have not yet run on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from mpfa.backends.sglang_plugin.attention import ExtendBatch, MpfaAttention  # noqa: E402
from mpfa.backends.sglang_plugin.pool_sizing import PoolGeometry  # noqa: E402
from mpfa.backends.sglang_plugin.decode_plan import GraphDecodeBuffers, eager_decode_batch  # noqa: E402
from mpfa.backends.sglang_plugin.kv_store import MpfaKVStore  # noqa: E402
from mpfa.backends.sglang_plugin.variants import variant_of  # noqa: E402
from mpfa.kernels import SmoothingMeans, attention_float64, decode_partials, merge_partials  # noqa: E402
from mpfa.kernels.served_numerics import SERVED_NUMERICS  # noqa: E402
from mpfa.kernels.sm90.decode_layout import TILE_KEYS  # noqa: E402

D = 128
LAYER = 1
SERVED = pytest.mark.parametrize("numerics", SERVED_NUMERICS.values(), ids=list(SERVED_NUMERICS))


def _prefilled(paged, lengths, hq, hkv, page_size, backend, numerics):
    """Requests whose tokens except the last are prefilled (one extend step, reference path) in the given served
    numerics; returns (paged, store, core)."""
    p = paged(lengths, hq, hkv, page_size, "cuda")
    variant = variant_of(backend)
    store = MpfaKVStore.allocate(p.num_slots, page_size, PoolGeometry(hq, hkv, D, 2), variant.smoothing,
                                 "cuda")
    for cache in store.caches:
        cache.fill_(0xFF)
    core = MpfaAttention(store, variant, numerics=numerics)
    s = p.step([(0, n - 1) for n in lengths], "cuda")
    batch = ExtendBatch.build(p.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], page_size)
    core.extend(LAYER, s["q"], s["k"], s["v"], batch, D**-0.5)
    return p, store, core


def _decode_inputs(p, lengths):
    s = p.step([(n - 1, n) for n in lengths], "cuda")
    return s["q"], s["k"], s["v"], s["slots"], s["rows"], torch.tensor(lengths, device="cuda")


def _poison(batch):
    for x in (batch.workspace.m, batch.workspace.l, batch.workspace.o):
        x.fill_(math.nan)


def _rms(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


CASES = [([130, 1000, 7], 32, 8, 128, "mpfa"), ([300, 45], 10, 2, 16, "mpfa"), ([513, 64], 8, 2, 128, "mpfa-direct")]


@SERVED
@pytest.mark.parametrize("lengths,hq,hkv,page_size,backend", CASES, ids=["32x8-page128", "gqa5-page16", "direct"])
def test_decode_matches_reference(paged, numerics, lengths, hq, hkv, page_size, backend):
    p, store, core = _prefilled(paged, lengths, hq, hkv, page_size, backend, numerics)
    q, k, v, slots, rows, seq_lens = _decode_inputs(p, lengths)
    batch = eager_decode_batch(p.req_to_token, rows, seq_lens, max(lengths), page_size, hq, hkv, 132)
    _poison(batch)
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
    ref = merge_partials(decode_partials(q.cpu(), k_all, v_all, variant=numerics.variant(variant.numerics),
                                         cu_seqlens_k=cu_k, partition_size=batch.workspace.partition_size,
                                         block_n=TILE_KEYS, means=means))
    exact = attention_float64(q.cpu(), k_all, v_all, causal=False, cu_seqlens_q=torch.arange(len(lengths) + 1),
                              cu_seqlens_k=cu_k)
    got = out.float().cpu()
    assert bool(torch.isfinite(got).all())
    assert _rms(got, ref) <= 4e-3  # kernel vs oracle (~1e-3) + BF16 output rounding (2**-9)
    assert float((got - ref).abs().max()) <= 0.03 * float(ref.abs().max())
    assert _rms(got, exact) <= 1.01 * _rms(ref, exact) + 4e-3


@SERVED
def test_cuda_graph_replay_equals_eager(paged, numerics):
    lengths, hq, hkv, page_size = [900, 300, 64], 8, 2, 16
    p, store, core = _prefilled(paged, lengths, hq, hkv, page_size, "mpfa", numerics)
    q, k, v, slots, rows, seq_lens = _decode_inputs(p, lengths)
    buffers = GraphDecodeBuffers(4, hq, hkv, p.req_to_token.shape[1], page_size, "cuda", 132)
    out = torch.empty((3, hq, D), dtype=torch.bfloat16, device="cuda")
    batch = buffers.fill(p.req_to_token, rows, seq_lens, 3)
    core.decode(LAYER, q, k, v, slots, batch, D**-0.5, out=out)  # compiles outside the capture
    eager = out.clone()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        core.decode(LAYER, q, k, v, slots, batch, D**-0.5, out=out)
    for x in (buffers.page_table, buffers.first_pages, buffers.seq_lens):
        x.zero_()  # replay-prep must refill them
    buffers.fill(p.req_to_token, rows, seq_lens, 3)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
