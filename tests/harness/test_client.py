"""The load client against the simulator (a real subprocess) and against scripted SSE servers (real HTTP)."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from mpfa.cli import metrics
from mpfa.cli.client import run_load
from mpfa.cli.workload import arrival_times, make_prompts


def max_in_flight(records) -> int:
    edges = sorted([(r.dispatch_s, 1) for r in records] + [(r.completion_s, -1) for r in records])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def test_closed_loop_counts_warmup_and_concurrency(sim):
    prompts, warmup = make_prompts(1, 12, 300), make_prompts(2, 2, 300)
    seen = []
    records = asyncio.run(run_load(sim.url, prompts, 6, concurrency=3, warmup_prompts=warmup,
                                   on_complete=seen.append))
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
    records = asyncio.run(run_load(sim.url, make_prompts(3, 4, 50), 5, concurrency=2, api="openai"))
    assert all(r.ok and r.output_tokens == sum(r.chunk_tokens) == 5 and r.prompt_tokens == 50 for r in records)


def test_arrival_schedule_is_followed(sim):
    arrivals = arrival_times(10, rate=40.0, burstiness=1.0, seed=5)
    records = asyncio.run(run_load(sim.url, make_prompts(4, 10, 64), 3, arrivals=arrivals))
    start = records[0].dispatch_s
    late = [r.dispatch_s - start - a for r, a in zip(records, arrivals)]
    assert all(r.ok for r in records)
    assert min(late) > -1e-3 and max(late) < 0.05


def test_arrivals_with_concurrency_cap(sim):
    arrivals = [0.0] * 8  # all at once, but at most 2 in flight
    records = asyncio.run(run_load(sim.url, make_prompts(6, 8, 64), 4, arrivals=arrivals, concurrency=2))
    assert all(r.ok for r in records) and max_in_flight(records) == 2


def test_zero_requests(sim):
    records = asyncio.run(run_load(sim.url, [], 8, concurrency=4))
    assert records == []
    assert metrics.summarize(records) == {"n_ok": 0.0, "n_failed": 0.0}


def test_output_length_one_has_no_tpot(sim):
    records = asyncio.run(run_load(sim.url, make_prompts(7, 3, 128), 1, concurrency=3))
    assert all(r.ok and r.chunk_tokens == [1] for r in records)
    summary = metrics.summarize(records)
    assert summary["n_ok"] == 3 and summary["ttft_ms_mean"] > 0
    assert not any(k.startswith(("tpot", "itl")) for k in summary)


def test_server_death_keeps_completed_requests(start_sim):
    server = start_sim(die_after_requests=3)
    records = asyncio.run(run_load(server.url, make_prompts(8, 10, 64), 20, concurrency=2))
    assert server.process.wait(timeout=10) == 3
    ok = [r for r in records if r.ok]
    assert len(ok) == 3 and all(r.output_tokens == 20 for r in ok)
    assert all(r.error for r in records if not r.ok) and len(records) == 10
    assert metrics.summarize(records)["n_failed"] == 7


def test_http_error_becomes_record_error(sim):
    records = asyncio.run(run_load(sim.url, make_prompts(9, 2, 16), 10**7, concurrency=2))
    assert all(r.error.startswith("HTTP 400") and "KV cache capacity" in r.error for r in records)


def test_connection_refused_becomes_record_error(start_sim):
    server = start_sim()
    server.stop()
    records = asyncio.run(run_load(server.url, make_prompts(10, 3, 16), 4, concurrency=2))
    assert len(records) == 3 and all(r.error and not r.ok for r in records)


def test_cancellation_propagates_and_keeps_completed(start_sim):
    server = start_sim(time_scale=0.2)
    done = []

    async def main() -> None:
        task = asyncio.create_task(run_load(server.url, make_prompts(11, 40, 64), 30, concurrency=2,
                                            on_complete=done.append))
        while len(done) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
    assert 2 <= len(done) < 40 and all(r.ok and r.output_tokens == 30 for r in done)


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


async def scripted_run(pieces: list[bytes], output_len: int = 4):
    """Serve one SSE response written as `pieces` (10 ms apart) and run one request against it."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        (record,) = await run_load(f"http://127.0.0.1:{port}", [[1, 2, 3, 4]], output_len, concurrency=1)
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
