"""The load generator: stream requests to an SGLang-compatible server and record when each token arrived.

Requests go over keep-alive HTTP/1.1 connections (`stamped_reads`; no cap, so 512+ concurrent streams are fine),
and the timestamps are taken where the bytes are, not where a request's task happens to run: a chunk's arrival is
stamped by the connection on the socket read that delivered it, before any parsing, and a request's dispatch right
before its bytes are written to the socket. A freed slot's next request is written in the event-loop iteration
its response ended, on the connection that carried it; the client's other work (parsing the SSE events, the
caller's `on_complete`) runs one step per iteration when the sockets are quiet (`client_turns.Turns`). Python's
cyclic garbage collector is paused for the run.

Tokens per chunk come from the server's running count (`meta_info.completion_tokens` on `/generate`,
`usage.completion_tokens` on `/v1/completions` with continuous usage stats), which is right whether the
server streams cumulative or incremental `output_ids` and when it coalesces several steps into one chunk.
Each SSE event gets the stamp of the read that delivered the end of its line.

A request that fails (HTTP error, connection lost, token counts that differ from the request) becomes a
record with `error` set; it never raises. Cancellation (Ctrl-C) cancels the requests in flight, waits for
them, and propagates; records already passed to `on_complete` stay intact.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import orjson

try:
    import uvloop
except ImportError:  # not built for Windows
    uvloop = None

from .client_requests import Flight, Requests
from .client_turns import Turns
from .records import RequestRecord
from .request_timeouts import Timeouts
from .stamped_reads import Connection, Connections, Endpoint, LastRead

APIS = ("sglang", "openai")
MAX_LINE_BYTES = 1024 * 1024  # longest stream line parsed; a longer one fails the request
MAX_COUNT = 2**31  # token counts at or above this in an event make it unreadable
PARSE_BATCH_BYTES = 32 * 1024  # stream bytes parsed per turn (~0.1-0.3 ms), and kept unparsed before one is due

T = TypeVar("T")
_Job = tuple[int, list[int]]  # (record index, prompt)
_Finish = Callable[[RequestRecord, "_EventStream | None"], Awaitable[RequestRecord]]


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


def _count(value: Any) -> int:
    """A token count from an event: a non-negative integer that fits the store's 64-bit columns."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise ValueError(f"token count {value!r} is not an integer in [0, {MAX_COUNT})")
    return value


def _sglang_event(event: dict[str, Any], state: "_EventStream") -> int:
    """Update `state` from one `/generate` chunk; returns the new tokens it carries."""
    meta = event["meta_info"]
    total = _count(meta["completion_tokens"])
    if (prompt := meta.get("prompt_tokens")) is not None:
        state.prompt_tokens = _count(prompt)
    state.server_total = total
    finish = meta.get("finish_reason")
    if finish is not None:
        state.finished = True
        if isinstance(finish, dict) and finish.get("type") == "abort":
            state.error = f"server aborted the request: {finish.get('message', finish)}"
    return total - state.counted


def _openai_event(event: dict[str, Any], state: "_EventStream") -> int:
    """Update `state` from one `/v1/completions` chunk; returns the new tokens it carries.

    Without per-chunk usage, each chunk with a choice is taken as one token; the final usage chunk then
    checks that assumption (a mismatch becomes the record's error).
    """
    usage = event.get("usage")
    if usage:
        state.server_total = _count(usage["completion_tokens"])
        if (prompt := usage.get("prompt_tokens")) is not None:
            state.prompt_tokens = _count(prompt)
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


def _check_counts(record: RequestRecord, state: "_EventStream") -> str | None:
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


class _EventStream:
    """One SSE response body (a `stamped_reads.BodySink`). The connection only keeps each read with its
    stamp (`add`, about a microsecond); `parse` turns them into events later, in a turn of the client's.
    Each event that carries new tokens is noted with the stamp of the read that delivered the end of its
    line. An error in the stream ends its request at once (`end_early`), without the rest of the body."""

    __slots__ = ("_handle_event", "_on_backlog", "_end_early", "_pieces", "_parsed", "_backlog_bytes", "_pending",
                 "_pending_bytes", "parse_scheduled", "chunk_s", "chunk_tokens", "done_s", "counted",
                 "server_total", "prompt_tokens", "finished", "error", "stopped")

    def __init__(self, handle_event: Callable[[dict[str, Any], "_EventStream"], int],
                 on_backlog: Callable[["_EventStream"], None], end_early: Callable[[], None]) -> None:
        self._handle_event = handle_event
        self._on_backlog = on_backlog  # called once the unparsed reads pass PARSE_BATCH_BYTES
        self._end_early = end_early
        self._pieces: list[tuple[float, bytes] | None] = []  # (stamp, body bytes) per read; None once parsed
        self._parsed = 0
        self._backlog_bytes = 0
        self._pending: list[bytes] = []  # the start of an unfinished line, piece by piece
        self._pending_bytes = 0
        self.parse_scheduled = False
        self.chunk_s: list[float] = []
        self.chunk_tokens: list[int] = []
        self.done_s: float | None = None  # when `data: [DONE]` arrived
        self.counted = 0  # tokens attributed to chunks
        self.server_total: int | None = None  # the server's latest count of all output tokens
        self.prompt_tokens: int | None = None
        self.finished = False
        self.error: str | None = None
        self.stopped = False  # by an error event or an unreadable chunk: the rest is not parsed

    def add(self, arrived: float, data: bytes) -> None:
        self._pieces.append((arrived, data))
        self._backlog_bytes += len(data)
        if self._backlog_bytes > PARSE_BATCH_BYTES and not self.parse_scheduled:
            self.parse_scheduled = True
            self._on_backlog(self)

    @property
    def unparsed(self) -> bool:
        return self._parsed < len(self._pieces)

    def parse(self, budget_bytes: int = PARSE_BATCH_BYTES) -> None:
        """Parse the kept reads, oldest first, until about `budget_bytes` are done."""
        pieces, done = self._pieces, 0
        while self._parsed < len(pieces) and done < budget_bytes:
            arrived, data = pieces[self._parsed]  # type: ignore[misc]
            pieces[self._parsed] = None  # free the bytes
            self._parsed += 1
            done += len(data)
            if not self.stopped:
                self._parse_piece(arrived, data)
        self._backlog_bytes -= done

    def _parse_piece(self, arrived: float, data: bytes) -> None:
        """Parse the lines `data` completes; an unfinished line is kept in pieces (joined once, when it ends)."""
        *lines, tail = data.split(b"\n")
        if lines:
            lines[0] = b"".join(self._pending) + lines[0]
            self._pending, self._pending_bytes = [], 0
        self._pending.append(tail)
        self._pending_bytes += len(tail)
        if self._pending_bytes > MAX_LINE_BYTES or any(len(line) > MAX_LINE_BYTES for line in lines):
            self._stop(f"stream line longer than {MAX_LINE_BYTES} bytes")
            return
        try:
            for line in lines:
                if line.startswith(b"data:"):
                    self._event(arrived, line[5:].strip())
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # malformed JSON, wrong fields
            self._stop(f"unreadable stream chunk: {type(exc).__name__}: {exc}")

    def _event(self, arrived: float, data: bytes) -> None:
        if self.stopped:
            return
        if data == b"[DONE]":
            self.done_s = arrived
            return
        event = orjson.loads(data)
        if (message := _error_message(event)) is not None:
            self._stop(f"server error: {message}")
            return
        if (new_tokens := self._handle_event(event, self)) > 0:
            self.chunk_s.append(arrived)
            self.chunk_tokens.append(new_tokens)
            self.counted += new_tokens

    def _stop(self, error: str) -> None:
        """Stop parsing and end the stream: its request fails and drops the connection (unread bytes and all)."""
        self.error, self.stopped = error, True
        self._pending, self._pending_bytes = [], 0
        self._end_early()


def _fill(record: RequestRecord, stream: _EventStream) -> None:
    """Chunk times, counts and any error of a fully parsed stream."""
    record.chunk_s, record.chunk_tokens = stream.chunk_s, stream.chunk_tokens
    if stream.stopped:  # the counts are incomplete
        record.completion_s = None
        record.error = stream.error
        return
    record.completion_s = stream.done_s or record.completion_s
    record.output_tokens = stream.server_total or 0
    record.prompt_tokens = stream.prompt_tokens
    record.error = stream.error or _check_counts(record, stream)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed: it roughly halves the event loop's cost per streamed chunk."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on `new_event_loop()`; use it to drive `run_load`. Ctrl-C (SIGINT) cancels `main`, which
    cancels its requests and waits for them, then raises KeyboardInterrupt here; another Ctrl-C meanwhile is
    ignored (asyncio's own handler would raise it inside an event-loop callback: a connection's, say, which the
    loop would report as a broken connection)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        interrupted, result = runner.run(_until_ctrl_c(main))
    if interrupted:
        raise KeyboardInterrupt
    return result  # type: ignore[return-value]


async def _until_ctrl_c(main: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
    """(whether a Ctrl-C came, what `main` returned); (True, None) once a Ctrl-C has cancelled it."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    interrupted = False

    def on_ctrl_c() -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            task.cancel()

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return False, await main
    loop.add_signal_handler(signal.SIGINT, on_ctrl_c)
    try:
        result = await main
    except asyncio.CancelledError:
        if not interrupted:
            raise
        return True, None
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return interrupted, result


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
    timeouts: Timeouts = Timeouts(),
) -> list[RequestRecord]:
    """Send every prompt and return one record per request: warmup records first, then measured ones by index.

    Load: `concurrency` alone keeps that many requests in flight (closed loop); `arrivals` (seconds from the
    start, one per prompt) dispatches on that schedule (open loop), capped at `concurrency` in flight if both
    are given. Warmup prompts run first, at `concurrency` (or all at once), and are marked `warmup=True`
    with indices -1, -2, ... so they never collide with measured indices. `on_complete` gets each record as
    it finishes, warmup included. A request that waits longer than `timeouts` allows fails with the reason.
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
    endpoint = Endpoint(url.rstrip("/") + _EVENT_PARSERS[api][2])
    with _CyclicGcPause() as gc_pause:
        return await _run_load(endpoint, prompts, output_len, concurrency, arrivals, warmup_prompts, on_complete,
                               api, model, timeouts, gc_pause)


class _CyclicGcPause:
    """Pauses Python's cyclic garbage collector for a run, as `timeit` does: with thousands of live objects a
    collection stalls the event loop for milliseconds to tens of milliseconds, and every read waiting
    meanwhile is stamped late. A completed request leaves no reference cycles (measured: the same ~450 cyclic
    objects, the connections' own, after 256, 1024 or 2048 requests over 64 connections); a failed one leaves a
    few (its exception and traceback: ~7 for a refused connection), so they are collected after every
    FAILURES_PER_COLLECTION failures, at a turn of the client's."""

    FAILURES_PER_COLLECTION = 1000

    def __init__(self) -> None:
        self._failures = 0
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "_CyclicGcPause":
        gc.disable()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._was_enabled:
            gc.enable()

    def note_failure(self) -> bool:
        """Count a failed request; True when the failures' garbage is due to be collected."""
        self._failures += 1
        return self._failures % self.FAILURES_PER_COLLECTION == 0


async def _run_load(
    endpoint: Endpoint, prompts: Sequence[list[int]], output_len: int, concurrency: int | None,
    arrivals: Sequence[float] | None, warmup_prompts: Sequence[list[int]],
    on_complete: Callable[[RequestRecord], None] | None, api: str, model: str | None, timeouts: Timeouts,
    gc_pause: _CyclicGcPause,
) -> list[RequestRecord]:
    last_read = LastRead()
    turns = Turns(last_read)
    parsers: set[asyncio.Task] = set()

    async def parse_backlog(stream: _EventStream) -> None:
        while stream.unparsed:
            await turns.take()
            stream.parse()
        stream.parse_scheduled = False

    def on_backlog(stream: _EventStream) -> None:
        task = asyncio.create_task(parse_backlog(stream))
        parsers.add(task)
        task.add_done_callback(parsers.discard)

    make_payload = _EVENT_PARSERS[api][0]
    connections = Connections(endpoint, last_read)
    requests = Requests(connections, endpoint, lambda prompt: orjson.dumps(make_payload(prompt, output_len, model)),
                        output_len, functools.partial(_EventStream, _EVENT_PARSERS[api][1], on_backlog), timeouts)

    async def finish(record: RequestRecord, stream: _EventStream | None) -> RequestRecord:
        """Parse the stream, fill in the record and hand it to `on_complete`, each at a turn."""
        if stream is not None:
            while stream.unparsed:
                await turns.take()
                stream.parse()
            _fill(record, stream)
        if record.error is not None and gc_pause.note_failure():
            await turns.take()
            gc.collect()
        if on_complete is not None:
            await turns.take()
            on_complete(record)
        return record

    try:
        warm = [(-1 - i, p) for i, p in enumerate(warmup_prompts)]
        records = await _closed_loop(requests, finish, warm, concurrency or max(len(warm), 1), warmup=True)
        jobs = list(enumerate(prompts))
        if arrivals is None:
            records += await _closed_loop(requests, finish, jobs, concurrency, warmup=False)
        else:
            records += await _open_loop(requests, finish, jobs, arrivals, concurrency)
    finally:
        await _cancel_all(list(parsers))
        connections.close()
    return records


async def _closed_loop(
    requests: Requests, finish: _Finish, jobs: list[_Job], concurrency: int, warmup: bool
) -> list[RequestRecord]:
    """`concurrency` workers, each with one request in flight. A response that ends cleanly has the next job
    written on its connection by the connection's callback, in the iteration it ended (`Exchange.then`); after
    any other outcome the worker sends the next job itself. The ended ones are finished (parsed, handed to
    `on_complete`) at later turns, off the workers' path. A failure while finishing (say, in `on_complete`)
    stops the workers and is raised."""
    queue = iter(jobs)
    workers: list[asyncio.Task] = []
    finishing: list[asyncio.Task] = []
    failures: list[BaseException] = []

    def stop_on_failure(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not failures:
            failures.append(task.exception())
            for worker_task in workers:
                worker_task.cancel()

    async def worker() -> None:
        written: list[Flight] = []  # the next request, once the completion path has written it
        unsent: list[_Job] = []  # a job the completion path could not write: sent here, where an error can raise

        def refill(connection: Connection) -> None:
            if (job := next(queue, None)) is not None:
                try:
                    written.append(requests.write(connection, *job, warmup))
                except Exception:
                    unsent.append(job)

        while True:
            if written:
                flight = written.pop()
            elif (job := unsent.pop() if unsent else next(queue, None)) is not None:
                flight = await requests.start(*job, warmup)
            else:
                return
            if flight.exchange is not None:
                flight.exchange.then = refill
            stream = await requests.end(flight)
            finishing.append(task := asyncio.create_task(finish(flight.record, stream)))  # type: ignore[arg-type]
            task.add_done_callback(stop_on_failure)

    workers.extend(asyncio.create_task(worker()) for _ in range(min(concurrency, len(jobs))))
    try:
        await asyncio.gather(*workers)
        await asyncio.gather(*finishing)
    except BaseException:
        await _cancel_all(workers + finishing)
        if failures:
            raise failures[0] from None
        raise
    return sorted((task.result() for task in finishing), key=lambda r: abs(r.index))


async def _open_loop(
    requests: Requests, finish: _Finish, jobs: list[_Job], arrivals: Sequence[float], concurrency: int | None,
) -> list[RequestRecord]:
    """Dispatch each job at its arrival time (waiting for a free slot when `concurrency` caps the load)."""
    slots = asyncio.Semaphore(concurrency) if concurrency is not None else contextlib.nullcontext()
    loop = asyncio.get_running_loop()
    begin = loop.time()
    tasks: list[asyncio.Task] = []

    async def one(index: int, prompt: list[int]) -> RequestRecord:
        async with slots:
            flight = await requests.start(index, prompt, False)
            stream = await requests.end(flight)
        return await finish(flight.record, stream)  # type: ignore[arg-type]

    try:
        for (index, prompt), offset in zip(jobs, arrivals):
            delay = begin + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, prompt)))
    except BaseException:
        await _cancel_all(tasks)
        raise
    await _finish_all(tasks)
    return [task.result() for task in tasks]
