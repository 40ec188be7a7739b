"""The simulator over real HTTP: SGLang's /generate formats, validation, readiness, server info."""
from __future__ import annotations

import json
import time

import pytest

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.bench.runner import verify_server
from mpfa.mpfa_cli.harness.latency_model import LatencyModel
from mpfa.mpfa_cli.harness.serving_workload import make_prompt
from mpfa.mpfa_cli.harness.sim_server import load_model_shape


def events(raw: bytes) -> list[bytes]:
    """The payloads of an SSE body, asserting SGLang's framing: `data: <payload>` blocks ending with [DONE]."""
    assert raw.endswith(b"\n\n")
    blocks = raw[:-2].split(b"\n\n")
    assert all(b.startswith(b"data: ") for b in blocks), blocks[:3]
    assert blocks[-1] == b"data: [DONE]"
    return [b[len(b"data: "):] for b in blocks[:-1]]


def generate(server, prompt: list[int], max_new: int, stream: bool) -> tuple[int, bytes]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True,
                                                     "temperature": 0}, "stream": stream}
    return server.post("/generate", body)


def test_generate_non_stream_counts_and_deterministic_output(sim):
    prompt = make_prompt(seed=11, index=0, input_len=100)
    status, raw = generate(sim, prompt, 7, stream=False)
    assert status == 200
    out = json.loads(raw)
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == 7 and any((prompt * 2)[i:i + 7] == ids for i in range(len(prompt)))  # a span of the prompt
    assert meta["prompt_tokens"] == 100 and meta["completion_tokens"] == 7
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["e2e_latency"] > 0
    assert json.loads(generate(sim, prompt, 7, stream=False)[1])["output_ids"] == ids
    other = make_prompt(seed=11, index=1, input_len=100)
    assert json.loads(generate(sim, other, 7, stream=False)[1])["output_ids"] != ids


def test_generate_stream_is_cumulative_sse_like_sglang(sim):
    prompt = make_prompt(seed=12, index=0, input_len=64)
    final = json.loads(generate(sim, prompt, 9, stream=False)[1])["output_ids"]
    status, raw = generate(sim, prompt, 9, stream=True)
    assert status == 200
    chunks = [json.loads(e) for e in events(raw)]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 9
    for chunk, count in zip(chunks, counts):
        assert chunk["output_ids"] == final[:count]  # cumulative, as SGLang without incremental streaming
        assert chunk["meta_info"]["prompt_tokens"] == 64
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_incremental_streaming_sends_only_new_ids(start_sim):
    server = start_sim(incremental_streaming_output=True)
    prompt = make_prompt(seed=13, index=0, input_len=32)
    final = json.loads(generate(server, prompt, 12, stream=False)[1])["output_ids"]
    chunks = [json.loads(e) for e in events(generate(server, prompt, 12, stream=True)[1])]
    assert [i for c in chunks for i in c["output_ids"]] == final
    assert chunks[-1]["meta_info"]["completion_tokens"] == 12


def test_openai_completions_stream_with_usage(sim):
    prompt = make_prompt(seed=14, index=0, input_len=20)
    body = {"prompt": prompt, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, raw = sim.post("/v1/completions", body)
    assert status == 200
    chunks = [json.loads(e) for e in events(raw)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    with_choice = chunks[:-1]
    assert [c["usage"]["completion_tokens"] for c in with_choice] == [
        sum(len(x["choices"][0]["token_ids"]) for x in with_choice[: i + 1]) for i in range(len(with_choice))]
    assert with_choice[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("raw, words", [
    (b"{not json", "not valid JSON"),
    (json.dumps([1, 2]).encode(), "JSON object"),
    (json.dumps({"sampling_params": {"max_new_tokens": 4}}).encode(), "'input_ids' is required"),
    (json.dumps({"input_ids": []}).encode(), "non-empty list"),
    (json.dumps({"input_ids": "hello"}).encode(), "non-empty list"),
    (json.dumps({"input_ids": [1.5, 2.0]}).encode(), "non-empty list"),
    (json.dumps({"input_ids": [5, -1]}).encode(), "non-negative"),
    (json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 0}}).encode(), "max_new_tokens"),
    (json.dumps({"input_ids": [5, 6], "sampling_params": [1]}).encode(), "'sampling_params' must be an object"),
    (json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10**8}}).encode(), "KV cache capacity"),
])
def test_bad_generate_requests_get_400_with_message(sim, raw, words):
    status, body = sim.post("/generate", raw=raw)
    assert status == 400
    assert words in json.loads(body)["error"]["message"]


def test_bad_openai_request_gets_400(sim):
    status, body = sim.post("/v1/completions", {"max_tokens": 3})
    assert status == 400 and "'prompt' is required" in json.loads(body)["error"]["message"]


def test_server_info_reports_backend_as_sglang_would(start_sim):
    server = start_sim("flashinfer-fp8", model="qwen3-14b")
    status, raw = server.get("/get_server_info")
    info = json.loads(raw)
    assert status == 200 and info["simulated"] is True
    for key, want in BACKENDS["flashinfer-fp8"].expect.items():
        assert info[key] == want
    verify_server(info, BACKENDS["flashinfer-fp8"])
    verify_server(json.loads(start_sim("mpfa-direct").get("/get_server_info")[1]), BACKENDS["mpfa-direct"])
    shape = load_model_shape("qwen3-14b")
    assert info["model_path"] == "qwen3-14b"
    assert info["max_total_num_tokens"] == LatencyModel(BACKENDS["flashinfer-fp8"].sim, shape).kv_capacity_tokens
    assert info["page_size"] == 1 and "version" in info
    for path in ("/start_profile", "/stop_profile"):
        assert server.post(path)[0] == 200


def test_startup_delay_answers_503_until_ready(start_sim):
    server = start_sim(startup_delay=1.5)
    assert server.get("/health")[0] == 200
    assert server.get("/health_generate")[0] == 503
    assert generate(server, [5, 6, 7], 2, stream=False)[0] == 503
    deadline = time.monotonic() + 10
    while server.get("/health_generate")[0] != 200:
        assert time.monotonic() < deadline, "never became ready"
        time.sleep(0.1)
    assert generate(server, [5, 6, 7], 2, stream=False)[0] == 200


def test_request_takes_at_least_the_modelled_time(start_sim):
    scale = 0.05
    server = start_sim("triton-bf16", time_scale=scale)
    model = LatencyModel(BACKENDS["triton-bf16"].sim, load_model_shape("llama-3.1-8b"))
    prompt, max_new = make_prompt(seed=15, index=0, input_len=4096), 20
    modelled = model.prefill_seconds([4096]) + sum(model.decode_step_seconds([4096 + i]) for i in range(1, max_new))
    start = time.perf_counter()
    status, _ = generate(server, prompt, max_new, stream=False)
    took = time.perf_counter() - start
    assert status == 200
    assert modelled * scale <= took < 2 * modelled * scale + 0.25


def test_chunk_trace_brackets_every_write(start_sim):
    server = start_sim(trace_chunks=True)
    prompt = make_prompt(seed=14, index=0, input_len=32)
    status, raw = generate(server, prompt, 6, stream=True)
    assert status == 200
    counts = [json.loads(e)["meta_info"]["completion_tokens"] for e in events(raw)]
    status, trace = server.get("/sim_trace")
    (entry,) = json.loads(trace).values()
    before, after, sent_counts = zip(*entry["sent"])
    assert list(sent_counts) == counts  # one trace entry per SSE chunk written, with the tokens so far
    assert entry["received_s"] <= before[0]
    assert all(b <= a for b, a in zip(before, after))
    assert all(a <= b for a, b in zip(after, before[1:]))
