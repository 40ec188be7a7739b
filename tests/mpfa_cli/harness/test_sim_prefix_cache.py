"""The simulator's prefix cache: hits in whole pages, prefill of uncached tokens only, SGLang's reports, eviction."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpfa.mpfa_cli.harness.latency_model import LatencyModel
from mpfa.mpfa_cli.harness.serving_workload import make_prompt
from mpfa.mpfa_cli.harness.sim_prefix_cache import PrefixCache
from mpfa.mpfa_cli.harness.sim_server import load_model_shape
from mpfa.backends.specs import BACKENDS


def ids(*parts: list[int]) -> np.ndarray:
    return np.asarray([t for part in parts for t in part])


def test_hits_are_whole_pages_and_never_the_whole_prompt() -> None:
    a, b, c = make_prompt(1, 0, 300), make_prompt(1, 1, 50), make_prompt(1, 2, 50)
    cache = PrefixCache(page_size=128)
    assert cache.match(ids(a, b)) == 0
    cache.insert(ids(a, b))
    assert cache.tokens == 256 + 0 * 128  # 350 tokens: whole pages only
    assert cache.match(ids(a, c)) == 256
    assert cache.match(ids(a[:256])) == 128  # a prompt all cached still computes its last token
    exact = PrefixCache(page_size=1)
    exact.insert(ids(a, b))
    assert exact.match(ids(a, c)) == 300 and exact.match(ids(a, b)) == 349


def test_an_extension_replaces_its_prefix_and_eviction_drops_the_least_recently_used() -> None:
    a, b, c = make_prompt(2, 0, 100), make_prompt(2, 1, 100), make_prompt(2, 2, 100)
    cache = PrefixCache(page_size=1)
    cache.insert(ids(a))
    cache.insert(ids(a, b))  # a conversation's next turn: the tree grows by b
    assert cache.tokens == 200
    cache.insert(ids(c))
    assert cache.tokens == 300
    cache.match(ids(a, [5]))  # a used last: c is the least recently used
    cache.evict_to(250)
    assert cache.tokens == 200 and cache.match(ids(c, [5])) == 0 and cache.match(ids(a, b, [5])) == 200


def test_prefill_counts_only_uncached_tokens_but_attends_to_the_whole_context() -> None:
    model = LatencyModel(BACKENDS["mpfa"].sim, load_model_shape("llama-3.1-8b"))
    cold = model.prefill_seconds([32768 + 256])
    assert model.prefill_seconds([32768 + 256], [0]) == cold
    hit = model.prefill_seconds([32768 + 256], [32768])
    short = model.prefill_seconds([256])
    assert short < hit < cold / 10  # the 256 new queries attend to 33K keys: more than a 256-token prompt alone
    with pytest.raises(ValueError):
        model.prefill_seconds([100], [100])


def _generate(server, prompt: list[int], api: str = "/generate") -> dict:
    if api == "/generate":
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
    else:
        body = {"prompt": prompt, "max_tokens": 4}
    status, raw = server.post(api, body)
    assert status == 200, raw
    return json.loads(raw)


def test_the_simulator_reports_hits_like_sglang_only_with_the_radix_cache(start_sim) -> None:
    prefix = make_prompt(3, 0, 512)
    on, off = start_sim("mpfa", radix_cache=True), start_sim("mpfa")
    assert json.loads(on.get("/get_server_info")[1])["disable_radix_cache"] is False
    assert json.loads(off.get("/get_server_info")[1])["disable_radix_cache"] is True
    for server, second in ((on, 512), (off, 0)):
        first = _generate(server, prefix + make_prompt(3, 1, 64))
        assert first["meta_info"]["cached_tokens"] == 0
        again = _generate(server, prefix + make_prompt(3, 2, 64))
        assert again["meta_info"]["cached_tokens"] == second
    # a finished request is cached with its output but the last token: 637 + 3 tokens are 5 whole pages, where its
    # prompt alone would be 4
    turn = prefix + make_prompt(3, 4, 125)
    follow_up = turn + _generate(on, turn)["output_ids"][:3]
    usage = _generate(on, follow_up + make_prompt(3, 3, 10), "/v1/completions")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 640


def test_flush_cache_empties_the_prefix_cache_as_sglangs_does(start_sim) -> None:
    server = start_sim("mpfa", radix_cache=True)
    prompt = make_prompt(5, 0, 300) + make_prompt(5, 1, 40)
    _generate(server, prompt)
    assert _generate(server, prompt)["meta_info"]["cached_tokens"] == 256
    status, raw = server.post("/flush_cache", {})
    assert (status, raw) == (200, b"Cache flushed.")
    assert _generate(server, prompt)["meta_info"]["cached_tokens"] == 0
