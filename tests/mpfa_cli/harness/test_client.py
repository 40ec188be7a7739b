"""The load client against the simulator (a real subprocess) and against scripted SSE servers (real HTTP)."""
from __future__ import annotations

import asyncio
import gc
import itertools
import json
import time

import pytest
from aiohttp import web

from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.harness.client import Timeouts, run, run_load
from mpfa.mpfa_cli.harness.serving_workload import arrival_times, make_prompts
from mpfa.mpfa_cli.harness.sim_server import prompt_digest


def max_in_flight(records) -> int:
    edges = sorted([(r.dispatch_s, 1) for r in records] + [(r.completion_s, -1) for r in records])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def test_closed_loop_counts_warmup_and_concurrency(start_sim):
    # steps of ~0.5 ms: the client sends between them (at 100x speed a stream of chunks never pauses, and a
    # request may end before the client, waiting up to 20 ms for quiet sockets, has sent the third)
    server = start_sim(time_scale=0.1)
    prompts, warmup = make_prompts(1, 12, 300), make_prompts(2, 2, 300)
    seen = []
    records = run(run_load(server.url, prompts, 6, concurrency=3, warmup_prompts=warmup, on_complete=seen.append))
    assert len(seen) == 14 and {id(r) for r in seen} == {id(r) for r in records}
    assert [(r.index, r.warmup) for r in records[:2]] == [(-1, True), (-2, True)]
    assert [r.index for r in records[2:]] == list(range(12)) and not any(r.warmup for r in records[2:])
    for r in records:
        assert r.ok, r.error
        assert r.output_tokens == sum(r.chunk_tokens) == 6 and r.prompt_tokens == r.input_len == 300
        assert r.dispatch_s < r.chunk_s[0] and r.chunk_s == sorted(r.chunk_s) and r.chunk_s[-1] <= r.completion_s
    assert max(r.completion_s for r in records[:2]) <= min(r.dispatch_s for r in records[2:])
    assert max_in_flight(records[2:]) == 3


def test_openai_api_counts_tokens_from_usage(sim):
    records = run(run_load(sim.url, make_prompts(3, 4, 50), 5, concurrency=2, api="openai"))
    assert all(r.ok and r.output_tokens == sum(r.chunk_tokens) == 5 and r.prompt_tokens == 50 for r in records)


def test_openai_chat_api_measures_the_same_token_counts_as_openai(sim):
    """Acceptance of `--api openai-chat` against the simulator: the prompt goes as text (its ids in decimal), the
    simulator reads the ids back, and every request counts the tokens `--api openai` counts."""
    prompts = make_prompts(17, 6, 50)
    by_api = {api: run(run_load(sim.url, prompts, 7, concurrency=3, api=api)) for api in ("openai", "openai-chat")}
    for completion, chat in zip(by_api["openai"], by_api["openai-chat"]):
        assert completion.ok and chat.ok, (completion.error, chat.error)
        assert (chat.output_tokens, sum(chat.chunk_tokens), chat.prompt_tokens) == (7, 7, 50)
        assert (completion.output_tokens, sum(completion.chunk_tokens), completion.prompt_tokens) == (7, 7, 50)


@pytest.mark.parametrize("messages", [[{"role": "user", "content": "12 x 3"}], [{"role": "system", "content": "1"}],
                                      [{"role": "user", "content": "1"}] * 2, "1 2 3"])
def test_the_simulators_chat_route_takes_one_user_message_of_decimal_ids(sim, messages):
    status, body = sim.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400 and b"message" in body
    status, body = sim.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "5 6 7"}],
                                                     "max_tokens": 2})
    reply = json.loads(body)
    assert status == 200 and reply["object"] == "chat.completion" and reply["usage"]["prompt_tokens"] == 3
    assert len(reply["choices"][0]["message"]["content"].split()) == 2


def test_arrival_schedule_is_followed(sim):
    arrivals = arrival_times(10, rate=40.0, burstiness=1.0, seed=5)
    started = time.perf_counter()  # a little before the schedule's origin
    records = asyncio.run(run_load(sim.url, make_prompts(4, 10, 64), 3, arrivals=arrivals))
    late = [r.dispatch_s - started - a for r, a in zip(records, arrivals)]  # dispatch: stamped at the send
    assert all(r.ok for r in records)
    assert min(late) > 0 and max(late) < 0.05


def test_arrivals_with_concurrency_cap(sim):
    arrivals = [0.0] * 8  # all at once, but at most 2 in flight
    records = asyncio.run(run_load(sim.url, make_prompts(6, 8, 64), 4, arrivals=arrivals, concurrency=2))
    assert all(r.ok for r in records) and max_in_flight(records) == 2


def test_zero_requests(sim):
    records = asyncio.run(run_load(sim.url, [], 8, concurrency=4))
    assert records == []
    assert summarize(records) == {"n_ok": 0.0, "n_failed": 0.0}


def test_output_length_one_has_no_tpot(sim):
    records = asyncio.run(run_load(sim.url, make_prompts(7, 3, 128), 1, concurrency=3))
    assert all(r.ok and r.chunk_tokens == [1] for r in records)
    summary = summarize(records)
    assert summary["n_ok"] == 3 and summary["ttft_ms_mean"] > 0
    assert not any(k.startswith(("tpot", "itl")) for k in summary)


def test_server_death_keeps_completed_requests(start_sim):
    server = start_sim(die_after_requests=3)
    records = run(run_load(server.url, make_prompts(8, 10, 64), 20, concurrency=2))
    assert server.process.wait(timeout=10) == 3
    ok = [r for r in records if r.ok]
    assert len(ok) == 3 and all(r.output_tokens == 20 for r in ok)
    assert all(r.error for r in records if not r.ok) and len(records) == 10
    assert summarize(records)["n_failed"] == 7


def test_http_error_becomes_record_error(sim):
    records = asyncio.run(run_load(sim.url, make_prompts(9, 2, 16), 10**7, concurrency=2))
    assert all(r.error.startswith("HTTP 400") and "KV cache capacity" in r.error for r in records)


def test_connection_refused_becomes_record_error(start_sim):
    server = start_sim()
    server.stop()
    records = asyncio.run(run_load(server.url, make_prompts(10, 3, 16), 4, concurrency=2))
    assert len(records) == 3 and all(r.error and not r.ok for r in records)


@pytest.mark.parametrize("output_len", [30, 400])  # 400: streams long enough to be parsed while they run
def test_cancellation_propagates_and_keeps_completed(start_sim, output_len):
    server = start_sim(time_scale=0.2 if output_len == 30 else 0.02)
    done = []

    async def main() -> None:
        task = asyncio.create_task(run_load(server.url, make_prompts(11, 40, 64), output_len, concurrency=2,
                                            on_complete=done.append))
        while len(done) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert 2 <= len(done) < 40 and all(r.ok and r.output_tokens == output_len for r in done)


def test_chunk_stamps_follow_the_servers_writes(start_sim):
    """Every chunk is stamped once, after the simulator began writing it; dispatch before the server saw it."""
    server = start_sim(trace_chunks=True)
    prompts = make_prompts(12, 24, 64)
    started = time.perf_counter()
    records = run(run_load(server.url, prompts, 12, concurrency=8))
    status, raw = server.get("/sim_trace")
    trace = json.loads(raw)
    for record in records:
        entry = trace[prompt_digest(prompts[record.index])]
        before, after, counts = zip(*entry["sent"])
        assert record.ok and list(itertools.accumulate(record.chunk_tokens)) == list(counts)
        assert all(b <= c for b, c in zip(before, record.chunk_s))  # one host-wide clock: causality
        assert started < record.dispatch_s <= entry["received_s"]


def test_long_cumulative_streams_are_parsed_in_batches(sim):
    # 400 cumulative output_ids make ~0.6 MB per stream: parsed in many batches while it streams
    records = run(run_load(sim.url, make_prompts(13, 3, 32), 400, concurrency=3))
    for record in records:
        assert record.ok, record.error
        assert sum(record.chunk_tokens) == record.output_tokens == 400
        assert record.chunk_s == sorted(record.chunk_s) and record.dispatch_s < record.chunk_s[0]
        assert record.chunk_s[-1] <= record.completion_s


def test_chunks_are_stamped_when_they_arrive_not_when_the_stream_ends():
    pieces = [sglang_event(1), sglang_event(2), sglang_event(3), sglang_event(4, finished=True) + b"data: [DONE]\n\n"]
    written: list[float] = []
    record = asyncio.run(scripted_run(pieces, gaps_s=[0.15] * 4, written_s=written))
    assert record.ok, record.error
    assert record.chunk_tokens == [1, 1, 1, 1]
    assert all(0 <= stamp - sent < 0.1 for stamp, sent in zip(record.chunk_s, written))  # pieces are 0.15 s apart


def test_silent_stream_times_out():
    pieces = [sglang_event(1), sglang_event(2)]
    started = time.perf_counter()
    record = asyncio.run(scripted_run(pieces, gaps_s=[5.0, 0.0], chunk_s=0.3))
    assert not record.ok and "no data from the server for 0.3 s" in record.error
    assert time.perf_counter() - started < 3.0


@pytest.mark.parametrize("enabled", [True, False])
def test_run_load_restores_the_garbage_collector(sim, enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        run(run_load(sim.url, make_prompts(14, 2, 16), 3, concurrency=2))
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_completed_requests_leave_no_cyclic_garbage(sim):
    """The cyclic collector is paused for a run, so what a completed request leaves must be freed by reference
    counting: the cyclic garbage after a run (the connections' own) does not grow with its requests."""
    def garbage_after(requests: int) -> int:
        gc.collect()
        run(run_load(sim.url, make_prompts(16, requests, 16), 3, concurrency=4))
        return gc.collect()

    was = gc.isenabled()
    gc.disable()  # also after each run: nothing is collected before it is counted
    try:
        assert garbage_after(64) == garbage_after(8)
    finally:
        (gc.enable if was else gc.disable)()


def test_failing_on_complete_stops_the_run(sim):
    seen = []

    def store(record) -> None:
        seen.append(record)
        if len(seen) == 3:
            raise RuntimeError("store broke")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="store broke"):
            await run_load(sim.url, make_prompts(15, 200, 32), 8, concurrency=4, on_complete=store)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert len(seen) < 20


def test_a_prompt_that_cannot_be_sent_raises_rather_than_being_dropped(sim):
    # the second goes out from the first's completion path, where it fails; the worker sends it again and raises
    with pytest.raises(TypeError):
        run(run_load(sim.url, [[1, 2, 3], [1, 2, object()]], 3, concurrency=1))


def test_bad_arguments_raise():
    for kwargs, words in [(dict(), "concurrency"), (dict(concurrency=0), "concurrency"),
                          (dict(concurrency=1, api="grpc"), "api"), (dict(arrivals=[0.0, 1.0]), "arrival")]:
        with pytest.raises(ValueError, match=words):
            asyncio.run(run_load("http://127.0.0.1:9", [[1, 2, 3]], 4, **kwargs))


# --- scripted servers: exact SSE byte streams, to check parsing and error handling --------------------------


def sglang_event(total: int, prompt: int = 4, finished: bool = False) -> bytes:
    meta = {"prompt_tokens": prompt, "completion_tokens": total,
            "finish_reason": {"type": "length", "length": total} if finished else None}
    return b"data: " + json.dumps({"output_ids": list(range(total)), "meta_info": meta}).encode() + b"\n\n"


async def scripted_run(pieces: list[bytes], output_len: int = 4, gaps_s: list[float] | None = None,
                       chunk_s: float = 30.0, written_s: list[float] | None = None):
    """Serve one SSE response written as `pieces` (after each, a pause: `gaps_s` or 10 ms) and run one
    request against it; `written_s` collects when each piece was written."""
    gaps_s = gaps_s or [0.01] * len(pieces)

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece, gap in zip(pieces, gaps_s):
            await response.write(piece)
            if written_s is not None:
                written_s.append(time.perf_counter())
            await asyncio.sleep(gap)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        (record,) = await run_load(f"http://127.0.0.1:{port}", [[1, 2, 3, 4]], output_len, concurrency=1,
                                   timeouts=Timeouts(chunk_s=chunk_s))
    finally:
        await runner.cleanup()
    return record


def test_coalesced_chunks_and_split_events():
    final = sglang_event(4, finished=True)
    pieces = [sglang_event(1), sglang_event(3), final[:25], final[25:] + b"data: [DONE]\n\n"]
    record = asyncio.run(scripted_run(pieces))
    assert record.ok, record.error
    assert record.chunk_tokens == [1, 2, 1] and record.output_tokens == 4
    gaps = [b - a for a, b in zip(record.chunk_s, record.chunk_s[1:])]
    assert gaps[1] >= 0.018  # the split event is stamped when its second half arrives, two writes later


@pytest.mark.parametrize("pieces, words", [
    ([sglang_event(1), sglang_event(3, finished=True), b"data: [DONE]\n\n"], "generated 3 tokens, 4 were requested"),
    ([sglang_event(1), sglang_event(2)], "stream ended before"),
    ([sglang_event(1), b'data: {"error": {"message": "boom"}}\n\n', b"data: [DONE]\n\n"], "server error: boom"),
    ([sglang_event(4, prompt=5, finished=True), b"data: [DONE]\n\n"], "5 prompt tokens, 4 were sent"),
    ([b"data: {not json\n\n"], "unreadable stream chunk"),
])
def test_untrustworthy_streams_become_errors(pieces, words):
    record = asyncio.run(scripted_run(pieces))
    assert not record.ok and words in record.error
