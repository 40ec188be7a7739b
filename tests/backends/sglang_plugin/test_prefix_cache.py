"""A cached prefix keeps MpFA exact: request B = A's first pages + its own suffix, served after A with those pages
shared (SGLang's radix cache: B's extend starts at prefix length > 0 and its page table begins with A's pages),
gives attention outputs bit-identical to B served cold in a fresh pool with the same means (B's first chunk being
A's first chunk, its means are A's). B adopts A's means from their shared first page; nothing rewrites them.
Runs the slow reference prefill in Triton's CPU interpreter, and on a GPU the sm90 prefill kernel too."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

from mpfa.backends.sglang_plugin.attention import ExtendBatch, MpfaAttention  # noqa: E402
from mpfa.backends.sglang_plugin.kv_store import MpfaKVStore  # noqa: E402
from mpfa.backends.sglang_plugin.pool_sizing import PoolGeometry  # noqa: E402
from mpfa.backends.sglang_plugin.variants import variant_of  # noqa: E402

HQ, HKV, D, PAGE, LAYER = 8, 2, 128, 32, 1  # 32: the smallest page the sm90 prefill kernel takes
PREFIX, A_LEN, B_LEN = 2 * PAGE, 2 * PAGE + 9, 2 * PAGE + 21  # B shares A's first two (full) pages


def _core(p, device, prefill):
    variant = variant_of("mpfa")
    store = MpfaKVStore.allocate(p.num_slots, PAGE, PoolGeometry(HQ, HKV, D, 2), variant.smoothing, device)
    for cache in store.caches:
        cache.fill_(0xFF)  # NaN in e4m3 and BF16: a slot read before it is written poisons the output
    return MpfaAttention(store, variant, prefill)


def _extend(core, p, index, span):
    """Request `index`'s tokens [a, b) in one extend (prefix a): its output [b - a, Hq, d]."""
    sub, device = p.only(index), p.req_to_token.device
    s = sub.step([span], device)
    batch = ExtendBatch.build(sub.req_to_token, s["rows"], s["slots"], s["prefix"], s["extend"], PAGE)
    out = torch.full((s["q"].shape[0], HQ * D), math.nan, dtype=torch.bfloat16, device=device)
    out.copy_(core.extend(LAYER, s["q"].flatten(1), s["k"], s["v"], batch, D**-0.5).flatten(1))
    return out.view(-1, HQ, D), batch


@pytest.fixture
def shared(paged, device):
    """Pages for A and B; B's first PREFIX tokens are A's (same Q/K/V), and in `hit` its row maps them to A's
    slots, as the radix cache hands them out."""
    cold = paged([A_LEN, B_LEN], HQ, HKV, PAGE, device)
    for x in (cold.q, cold.k, cold.v):
        x[1][:PREFIX] = x[0][:PREFIX]
    hit = dataclasses.replace(cold, req_to_token=cold.req_to_token.clone())
    hit.req_to_token[hit.rows[1], :PREFIX] = hit.req_to_token[hit.rows[0], :PREFIX]
    return cold, hit, device


PATHS = [pytest.param("reference", id="reference")]
if torch.cuda.is_available():
    PATHS.append(pytest.param("kernel", marks=pytest.mark.gpu, id="kernel"))


@pytest.mark.parametrize("prefill", PATHS)
def test_a_cached_prefix_gives_the_cold_outputs_bit_for_bit(shared, prefill):
    cold, hit, device = shared
    served = _core(hit, device, prefill)
    _extend(served, hit, 0, (0, PREFIX))  # A's first chunk: its means, at its first page
    _extend(served, hit, 0, (PREFIX, A_LEN))
    first_page = int(hit.req_to_token[hit.rows[0], 0]) // PAGE
    means = [t[LAYER][first_page].clone() for t in (served.store.q_mean, served.store.k_mean)]
    out_hit, batch = _extend(served, hit, 1, (PREFIX, B_LEN))  # B: a cache hit on A's two pages
    assert batch.first_pages.tolist() == [first_page] and not batch.any_starting
    assert torch.equal(served.store.q_mean[LAYER][first_page], means[0])
    assert torch.equal(served.store.k_mean[LAYER][first_page], means[1])

    fresh = _core(cold, device, prefill)
    _extend(fresh, cold, 1, (0, PREFIX))  # B cold: its first chunk is A's, so are its means
    cold_page = int(cold.req_to_token[cold.rows[1], 0]) // PAGE
    assert torch.equal(fresh.store.k_mean[LAYER][cold_page], means[1])
    out_cold, _ = _extend(fresh, cold, 1, (PREFIX, B_LEN))
    assert bool(torch.isfinite(out_hit.float()).all())
    assert torch.equal(out_hit, out_cold)


def test_a_hit_uses_the_writer_s_means_not_its_own(shared):
    """B's suffix differs from A's: its own first-chunk means would differ, and B must not compute them."""
    _, hit, device = shared
    served = _core(hit, device, "reference")
    _extend(served, hit, 0, (0, A_LEN))  # A in one chunk: means over all of A
    first_page = int(hit.req_to_token[hit.rows[0], 0]) // PAGE
    before = served.store.k_mean[LAYER].clone()
    _extend(served, hit, 1, (PREFIX, B_LEN))
    assert torch.equal(served.store.k_mean[LAYER], before), "a cache hit must not write means"
    assert torch.equal(served.store.k_mean[LAYER][first_page], before[first_page])
