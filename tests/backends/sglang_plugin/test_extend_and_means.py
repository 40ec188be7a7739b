"""The extend path of one layer (`MpfaAttention.extend`) on SGLang-shaped paged inputs: KV write through the
Triton kernel, frozen means under chunked prefill, and the SLOW REFERENCE prefill against `mpfa.kernels.reference`
(the quantized variant with the same means: identical up to Delta_S's one-ulp rounding; and float64 truth: no
further than the quantized reference is). The cache is NaN-poisoned first: a slot that is read without being
written makes the reference raise. Runs on the GPU, or in Triton's CPU interpreter without one."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from mpfa.backends.sglang_plugin.attention import ExtendBatch, MpfaAttention  # noqa: E402
from mpfa.backends.sglang_plugin.pool_sizing import PoolGeometry  # noqa: E402
from mpfa.backends.sglang_plugin.kv_store import MpfaKVStore  # noqa: E402
from mpfa.backends.sglang_plugin.variants import variant_of  # noqa: E402
from mpfa.kernels import SmoothingMeans, attention, attention_float64  # noqa: E402
from mpfa.kernels.smoothing import sequence_means  # noqa: E402

HQ, HKV, D = 8, 2, 128
SCALE = D**-0.5
POISON = 0xFF  # NaN in e4m3 and BF16
BF16_ROUNDING = 2.0**-8  # the stored means: FP32 sums rounded to BF16 (relative error <= 2^-9, +1 for the sums)


def _setup(paged, lengths, backend, device, page_size=16, layers=2):
    p = paged(lengths, HQ, HKV, page_size, device)
    variant = variant_of(backend)
    store = MpfaKVStore.allocate(p.num_slots, page_size, PoolGeometry(HQ, HKV, D, layers), variant.smoothing,
                                 device)
    for cache in store.caches:
        cache.fill_(POISON)
    return p, store, MpfaAttention(store, variant)


def _extend(core, p, spans, device, layer=1):
    s = p.step(spans, device)
    batch = ExtendBatch.build(p.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], p.page_size)
    out = torch.full((s["q"].shape[0], HQ * D), math.nan, dtype=torch.bfloat16, device=device)
    out.copy_(core.extend(layer, s["q"].flatten(1), s["k"], s["v"], batch, SCALE).flatten(1))
    return out.view(-1, HQ, D), batch


def _reference(p, spans, variant, means=None):
    """Reference attention of each span's queries over the request's tokens [0, span end)."""
    q = torch.cat([x[a:b] for x, (a, b) in zip(p.q, spans)])
    k = torch.cat([x[:b] for x, (_, b) in zip(p.k, spans)])
    v = torch.cat([x[:b] for x, (_, b) in zip(p.v, spans)])
    cu_q = torch.tensor([0, *[b - a for a, b in spans]]).cumsum(0)
    cu_k = torch.tensor([0, *[b for _, b in spans]]).cumsum(0)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sm_scale=SCALE)
    return attention(q, k, v, variant=variant, means=means, **kw), attention_float64(q, k, v, **kw)


def _first_pages(p):
    """Each request's first page: the row of its means."""
    return [int(p.req_to_token[row, 0]) // p.page_size for row in p.rows]


def _stored_means(store, p, layer=1):
    pages = torch.tensor(_first_pages(p))
    return SmoothingMeans(store.q_mean[layer][pages].cpu(), store.k_mean[layer][pages].cpu())


def _rms(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check(out, ref, exact):
    got = out.float().cpu()
    assert bool(torch.isfinite(got).all()), "NaN/Inf in the output"
    assert _rms(got, ref.bfloat16().float()) <= 1e-3  # same formats, same tiles: BF16 output rounding only
    assert _rms(got, exact) <= 1.01 * _rms(ref, exact) + 2e-3  # + BF16 output rounding (2**-9)


def test_single_chunk_prefill_matches_reference(device, paged):
    lengths = [21, 35, 5]  # pages of 16: one and a part, two and a part, a part
    p, store, core = _setup(paged, lengths, "mpfa", device)
    spans = [(0, n) for n in lengths]
    out, _ = _extend(core, p, spans, device)
    means = _stored_means(store, p)
    for got, x in ((means.q_mean, p.q), (means.k_mean, p.k)):
        want = torch.stack([sequence_means(t.double(), torch.tensor([0, t.shape[0]]))[0] for t in x])
        torch.testing.assert_close(got.double(), want, rtol=BF16_ROUNDING, atol=1e-5)  # stored in BF16
    assert got.dtype == torch.bfloat16
    assert bool((store.q_mean[0] == 0).all()), "another layer's means changed"
    _check(out, *_reference(p, spans, "mpfa", means))


def test_chunked_prefill_freezes_means_from_the_first_chunk(device, paged):
    """Step 1: request A's first chunk. Step 2: A's second chunk (prefix 32) with request B starting (mixed)."""
    p, store, core = _setup(paged, [48, 20], "mpfa", device)
    a_row, b_row = _first_pages(p)
    _extend(core, p.only(0), [(0, 32)], device)
    first = (store.q_mean[1][a_row].clone(), store.k_mean[1][a_row].clone())
    out, batch = _extend(core, p, [(32, 48), (0, 20)], device)
    assert batch.starting.tolist() == [False, True]
    assert torch.equal(store.q_mean[1][a_row], first[0]) and torch.equal(store.k_mean[1][a_row], first[1])
    torch.testing.assert_close(store.k_mean[1][b_row].double().cpu(),
                               sequence_means(p.k[1].double(), torch.tensor([0, 20]))[0], rtol=BF16_ROUNDING,
                               atol=1e-5)
    a_chunk1 = SmoothingMeans(sequence_means(p.q[0][:32], torch.tensor([0, 32])),
                              sequence_means(p.k[0][:32], torch.tensor([0, 32])))
    torch.testing.assert_close(first[0].cpu().double(), a_chunk1.q_mean[0].double(), rtol=BF16_ROUNDING, atol=1e-5)
    _check(out, *_reference(p, [(32, 48), (0, 20)], "mpfa", _stored_means(store, p)))


@pytest.mark.slow  # on a CPU: Triton's interpreter, ~8 s; GPU runs (-m gpu) include it
def test_later_chunks_take_no_means(device, paged, monkeypatch):
    """A batch of later chunks only (no request starts): the means stay frozen and none are computed."""
    from mpfa.kernels.sm90 import sequence_means as kernel_module

    p, store, core = _setup(paged, [80], "mpfa", device)
    _extend(core, p, [(0, 48)], device)
    frozen = (store.q_mean.clone(), store.k_mean.clone())
    monkeypatch.setattr(kernel_module, "sequence_means", lambda *_: pytest.fail("means computed for a later chunk"))
    out, batch = _extend(core, p, [(48, 80)], device)
    assert not batch.any_starting and batch.starting.tolist() == [False]
    assert torch.equal(store.q_mean, frozen[0]) and torch.equal(store.k_mean, frozen[1])
    _check(out, *_reference(p, [(48, 80)], "mpfa", _stored_means(store, p)))


@pytest.mark.slow  # on a CPU: Triton's interpreter, ~8 s; GPU runs (-m gpu) include it
def test_direct_variant_has_no_means(device, paged):
    lengths = [40, 21]
    p, store, core = _setup(paged, lengths, "mpfa-direct", device)
    out, _ = _extend(core, p, [(0, n) for n in lengths], device)
    assert tuple(store.q_mean.shape) == (2, 1, HQ, D) and bool((store.q_mean == 0).all())
    slots = p.step([(0, n) for n in lengths], device)["slots"]
    assert bool((store.layer(1).token_delta_s(slots) == 0).all()), "mpfa-direct must store zero Delta_S"
    _check(out, *_reference(p, [(0, n) for n in lengths], "qk4-pv8-direct"))


def test_extend_batch_layout(device, paged):
    p = paged([5, 3], HQ, HKV, 4, device)
    s = p.step([(2, 5), (0, 3)], device)
    batch = ExtendBatch.build(p.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], 4)
    assert batch.cu_q == [0, 3, 6] and batch.cu_k == [0, 5, 8]
    first = _first_pages(p)
    assert batch.first_pages.tolist() == first
    assert batch.token_means_row.tolist() == [first[0]] * 3 + [first[1]] * 3
    assert batch.kv_slots.tolist() == p.req_to_token[p.rows[0], :5].tolist() + p.req_to_token[p.rows[1], :3].tolist()
    assert batch.starting.tolist() == [False, True] and batch.any_starting


def test_prefill_path_comes_from_the_environment(monkeypatch):
    from mpfa.backends.sglang_plugin.setup_checks import MpfaSetupError, prefill_path

    monkeypatch.delenv("MPFA_PREFILL", raising=False)
    assert prefill_path() == "kernel"
    monkeypatch.setenv("MPFA_PREFILL", "reference")
    assert prefill_path() == "reference"
    monkeypatch.setenv("MPFA_PREFILL", "fast")
    with pytest.raises(MpfaSetupError, match="kernel, reference"):
        prefill_path()


def test_extend_batch_page_table_for_the_prefill_kernel(paged):
    p = paged([70, 5], HQ, HKV, 32, "cpu")
    s = p.step([(0, 70), (0, 5)], "cpu")
    batch = ExtendBatch.build(p.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], 32)
    assert batch.page_table.dtype == torch.int32 and tuple(batch.page_table.shape) == (2, 3)
    assert batch.seq_lens_k.tolist() == [70, 5]
    for b, row in enumerate(p.rows):  # page p of request b holds its tokens [32p, 32p + 32)
        for page in range(-(-[70, 5][b] // 32)):
            assert int(batch.page_table[b, page]) * 32 == int(p.req_to_token[row, page * 32])
