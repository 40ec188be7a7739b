"""The load generator: stream requests to an SGLang-compatible server and record when each token arrived.

One aiohttp session serves the whole run (no connection cap, so 512+ concurrent streams are fine). Each
network read is timestamped with `time.perf_counter()` before anything is parsed; the SSE events it
completes get that timestamp. Tokens per chunk come from the server's running count
(`meta_info.completion_tokens` on `/generate`, `usage.completion_tokens` on `/v1/completions` with
continuous usage stats), which is right whether the server streams cumulative or incremental `output_ids`
and when it coalesces several steps into one chunk.

A request that fails (HTTP error, connection lost, token counts that differ from the request) becomes a
record with `error` set; it never raises. Cancellation (Ctrl-C) cancels the requests in flight, waits for
them, and propagates; records already passed to `on_complete` stay intact.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp
import orjson

try:
    import uvloop
except ImportError:  # not built for Windows
    uvloop = None

from mpfa.cli.records import RequestRecord

APIS = ("sglang", "openai")
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 1800.0  # longest silence tolerated on a stream: a queued 128K prefill under load can be minutes
ERROR_BODY_CHARS = 300

T = TypeVar("T")
_Job = tuple[int, list[int]]  # (record index, prompt)
_SendOne = Callable[[int, list[int], bool], Awaitable[RequestRecord]]  # (index, prompt, warmup) -> record


class _StreamState:
    """What one request's stream has told us so far."""

    __slots__ = ("counted", "server_total", "prompt_tokens", "finished", "error")

    def __init__(self) -> None:
        self.counted = 0  # tokens attributed to chunks
        self.server_total: int | None = None  # the server's latest count of all output tokens
        self.prompt_tokens: int | None = None
        self.finished = False
        self.error: str | None = None


def _sglang_payload(prompt: list[int], output_len: int, model: str | None) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }


def _openai_payload(prompt: list[int], output_len: int, model: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if model:
        payload["model"] = model
    return payload


def _error_message(event: dict[str, Any]) -> str | None:
    """The message of an error event (SGLang: `{"error": {...}}`; OpenAI: `{"object": "error", ...}`)."""
    if "error" in event:
        err = event["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)
    if event.get("object") == "error":
        return str(event.get("message", event))
    return None


def _sglang_event(event: dict[str, Any], state: _StreamState) -> int:
    """Update `state` from one `/generate` chunk; returns the new tokens it carries."""
    meta = event["meta_info"]
    total = int(meta["completion_tokens"])
    state.prompt_tokens = meta.get("prompt_tokens", state.prompt_tokens)
    state.server_total = total
    finish = meta.get("finish_reason")
    if finish is not None:
        state.finished = True
        if isinstance(finish, dict) and finish.get("type") == "abort":
            state.error = f"server aborted the request: {finish.get('message', finish)}"
    return total - state.counted


def _openai_event(event: dict[str, Any], state: _StreamState) -> int:
    """Update `state` from one `/v1/completions` chunk; returns the new tokens it carries.

    Without per-chunk usage, each chunk with a choice is taken as one token; the final usage chunk then
    checks that assumption (a mismatch becomes the record's error).
    """
    usage = event.get("usage")
    if usage:
        state.server_total = int(usage["completion_tokens"])
        state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
    choices = event.get("choices") or []
    if not choices:
        return 0
    if choices[0].get("finish_reason") is not None:
        state.finished = True
    if usage:
        return state.server_total - state.counted
    return 1


_EVENT_PARSERS = {"sglang": (_sglang_payload, _sglang_event, "/generate"),
                  "openai": (_openai_payload, _openai_event, "/v1/completions")}


def _check_counts(record: RequestRecord, state: _StreamState) -> str | None:
    """Why the finished stream's token counts cannot be trusted, if they cannot."""
    if not state.finished:
        return "stream ended before the server finished the request"
    if state.server_total is None:
        return "server reported no completion token count"
    if state.counted != state.server_total:
        return f"chunks carried {state.counted} tokens but the server reports {state.server_total}"
    if state.server_total != record.max_new_tokens:
        return f"server generated {state.server_total} tokens, {record.max_new_tokens} were requested"
    if state.prompt_tokens is not None and state.prompt_tokens != record.input_len:
        return f"server counted {state.prompt_tokens} prompt tokens, {record.input_len} were sent"
    return None


async def _send(
    session: aiohttp.ClientSession, url: str, api: str, model: str | None, record: RequestRecord,
    prompt: list[int],
) -> None:
    """Run one request and fill in `record` (timestamps, counts, or the error)."""
    build_payload, handle_event, _ = _EVENT_PARSERS[api]
    body = orjson.dumps(build_payload(prompt, record.max_new_tokens, model))
    state = _StreamState()
    chunk_s, chunk_tokens = record.chunk_s, record.chunk_tokens
    try:
        record.dispatch_s = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                text = (await response.text(errors="replace"))[:ERROR_BODY_CHARS]
                record.error = f"HTTP {response.status}: {text.strip()}"
                return
            pending = b""
            async for piece in response.content.iter_any():
                arrived = time.perf_counter()
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        record.completion_s = arrived
                        continue
                    event = orjson.loads(data)
                    if (message := _error_message(event)) is not None:
                        record.error = f"server error: {message}"
                        return
                    new_tokens = handle_event(event, state)
                    if new_tokens > 0:
                        chunk_s.append(arrived)
                        chunk_tokens.append(new_tokens)
                        state.counted += new_tokens
            if record.completion_s is None:  # a stream that ends without [DONE] completes at its end
                record.completion_s = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON or a chunk without the expected fields
        record.error = f"unreadable stream chunk: {type(exc).__name__}: {exc}"
        return
    record.output_tokens = state.server_total or 0
    record.prompt_tokens = state.prompt_tokens
    record.error = state.error or _check_counts(record, state)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed: it roughly halves the event loop's cost per streamed chunk."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on `new_event_loop()`; use it to drive `run_load`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _finish_all(tasks: list[asyncio.Task]) -> None:
    """Await every task; on any failure or cancellation, cancel and reap the rest before re-raising."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await _cancel_all(tasks)
        raise


async def run_load(
    url: str,
    prompts: Sequence[list[int]],
    output_len: int,
    *,
    concurrency: int | None = None,
    arrivals: Sequence[float] | None = None,
    warmup_prompts: Sequence[list[int]] = (),
    on_complete: Callable[[RequestRecord], None] | None = None,
    api: str = "sglang",
    model: str | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> list[RequestRecord]:
    """Send every prompt and return one record per request: warmup records first, then measured ones by index.

    Load: `concurrency` alone keeps that many requests in flight (closed loop); `arrivals` (seconds from the
    start, one per prompt) dispatches on that schedule (open loop), capped at `concurrency` in flight if both
    are given. Warmup prompts run first, at `concurrency` (or all at once), and are marked `warmup=True`
    with indices -1, -2, ... so they never collide with measured indices. `on_complete` gets each record as
    it finishes, warmup included.
    """
    if api not in APIS:
        raise ValueError(f"unknown api '{api}'; valid: {', '.join(APIS)}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if concurrency is None and arrivals is None:
        raise ValueError("give a concurrency, an arrival schedule, or both")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if arrivals is not None and len(arrivals) != len(prompts):
        raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts")
    endpoint = url.rstrip("/") + _EVENT_PARSERS[api][2]

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(index: int, prompt: list[int], warmup: bool) -> RequestRecord:
            record = RequestRecord(index=index, input_len=len(prompt), max_new_tokens=output_len,
                                   dispatch_s=0.0, warmup=warmup)
            await _send(session, endpoint, api, model, record, prompt)
            if on_complete is not None:
                on_complete(record)
            return record

        warm = [(-1 - i, p) for i, p in enumerate(warmup_prompts)]
        records = await _closed_loop(one, warm, concurrency or max(len(warm), 1), warmup=True)
        jobs = list(enumerate(prompts))
        if arrivals is None:
            records += await _closed_loop(one, jobs, concurrency, warmup=False)
        else:
            records += await _open_loop(one, jobs, arrivals, concurrency)
    return records


async def _closed_loop(one: _SendOne, jobs: list[_Job], concurrency: int, warmup: bool) -> list[RequestRecord]:
    """`concurrency` workers, each sending the next job as soon as its previous one finished."""
    queue = iter(jobs)
    results: list[RequestRecord] = []

    async def worker() -> None:
        for index, prompt in queue:
            results.append(await one(index, prompt, warmup))

    await _finish_all([asyncio.create_task(worker()) for _ in range(min(concurrency, len(jobs)))])
    return sorted(results, key=lambda r: abs(r.index))


async def _open_loop(
    one: _SendOne, jobs: list[_Job], arrivals: Sequence[float], concurrency: int | None
) -> list[RequestRecord]:
    """Dispatch each job at its arrival time (waiting for a free slot when `concurrency` caps the load)."""
    slots = asyncio.Semaphore(concurrency) if concurrency is not None else None
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task] = []

    async def capped(index: int, prompt: list[int]) -> RequestRecord:
        if slots is None:
            return await one(index, prompt, False)
        async with slots:
            return await one(index, prompt, False)

    try:
        for (index, prompt), offset in zip(jobs, arrivals):
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(capped(index, prompt)))
    except BaseException:
        await _cancel_all(tasks)
        raise
    await _finish_all(tasks)
    return [task.result() for task in tasks]
