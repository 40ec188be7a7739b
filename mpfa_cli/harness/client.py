"""The load generator: stream requests to an SGLang-compatible server and record when each token arrived.

Requests go over keep-alive HTTP/1.1 connections (`stamped_reads`; no cap, so 512+ concurrent streams are fine),
and the timestamps are taken where the bytes are, not where a request's task happens to run: a chunk's arrival is
stamped by the connection on the socket read that delivered it, before any parsing, and a request's dispatch right
before its bytes are written to the socket. A freed slot's next request is written in the event-loop iteration
its response ended, on the connection that carried it; the client's other work (parsing the SSE events, the
caller's `on_complete`) runs one step per iteration when the sockets are quiet (`client_turns.Turns`). Python's
cyclic garbage collector is paused for the run.

The APIs it speaks, and how each counts tokens, are in `client_apis`; a response body is read as a strict
event stream, bounded by what its request asked for (`client_streams`). Each event gets the stamp of the read that
completed it.

A request that fails (HTTP error, connection lost, a stream that breaks its bounds, token counts that differ from
the request) becomes a record with `error` set; it never raises. Cancellation (Ctrl-C) cancels the requests in
flight, waits for them, and propagates; records already passed to `on_complete` stay intact.
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

from .client_apis import APIS, Api
from .client_requests import Flight, Requests
from .client_streams import EventStream, StreamLimits
from .client_turns import Turns
from .records import RequestRecord
from .request_timeouts import Timeouts
from .stamped_reads import Connection, Connections, Endpoint, LastRead

T = TypeVar("T")
_Job = tuple[int, list[int], int]  # (record index, prompt, output tokens)
_Finish = Callable[[RequestRecord, "EventStream | None"], Awaitable[RequestRecord]]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed: it roughly halves the event loop's cost per streamed chunk."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on `new_event_loop()`; use it to drive `run_load`. Ctrl-C (SIGINT) cancels `main`, which
    cancels its requests and waits for them, then raises KeyboardInterrupt here; another Ctrl-C meanwhile is
    ignored (asyncio's own handler would raise it inside an event-loop callback: a connection's, say, which the
    loop would report as a broken connection). From the first Ctrl-C on, SIGINT stays blocked in this thread: the
    caller is stopping, and one let through once the loop's handler is gone would raise inside the loop's shutdown
    ("Cannot close a running event loop") or inside the caller's cleanup before it could hold signals back."""
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
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
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
    output_lens: Sequence[int] | None = None,
    warmup_prompts: Sequence[list[int]] = (),
    on_complete: Callable[[RequestRecord], None] | None = None,
    api: str = "sglang",
    model: str | None = None,
    timeouts: Timeouts = Timeouts(),
    on_answer: Callable[[RequestRecord, list[int]], None] | None = None,
) -> list[RequestRecord]:
    """Send every prompt and return one record per request: warmup records first, then measured ones by index.

    Load: `concurrency` alone keeps that many requests in flight (closed loop); `arrivals` (seconds from the
    start, one per prompt) dispatches on that schedule (open loop), capped at `concurrency` in flight if both
    are given. `output_lens` (one per prompt) replaces `output_len` for the measured prompts, as a trace
    replay's requests each ask for their own. Warmup prompts run first, at `concurrency` (or all at once), and are
    marked `warmup=True` with indices -1, -2, ... so they never collide with measured indices. `on_complete` gets
    each record as it finishes, warmup included, after `on_answer` got it with the output ids the server returned
    (`/generate` only; empty elsewhere). A request that waits longer than `timeouts` allows fails with the reason.
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
    if output_lens is not None and (len(output_lens) != len(prompts) or min(output_lens, default=1) < 1):
        raise ValueError(f"expected {len(prompts)} output lengths >= 1, got {len(output_lens)}")
    endpoint = Endpoint(url.rstrip("/") + APIS[api].path)
    with _CyclicGcPause() as gc_pause:
        return await _run_load(endpoint, prompts, [output_len] * len(prompts) if output_lens is None else output_lens,
                               output_len, concurrency, arrivals, warmup_prompts, on_complete, APIS[api], model,
                               timeouts, gc_pause, on_answer)


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
    endpoint: Endpoint, prompts: Sequence[list[int]], output_lens: Sequence[int], warmup_output_len: int,
    concurrency: int | None,
    arrivals: Sequence[float] | None, warmup_prompts: Sequence[list[int]],
    on_complete: Callable[[RequestRecord], None] | None, api: Api, model: str | None, timeouts: Timeouts,
    gc_pause: _CyclicGcPause, on_answer: Callable[[RequestRecord, list[int]], None] | None,
) -> list[RequestRecord]:
    last_read = LastRead()
    turns = Turns(last_read)
    parsers: set[asyncio.Task] = set()

    async def parse_backlog(stream: EventStream) -> None:
        while stream.unparsed:
            await turns.take()
            stream.parse()
        stream.parse_scheduled = False

    def on_backlog(stream: EventStream) -> None:
        task = asyncio.create_task(parse_backlog(stream))
        parsers.add(task)
        task.add_done_callback(parsers.discard)

    connections = Connections(endpoint, last_read)
    requests = Requests(
        connections, endpoint, lambda prompt, output_len: orjson.dumps(api.payload(prompt, output_len, model)),
        lambda output_len: functools.partial(EventStream, api, StreamLimits.for_request(output_len), on_backlog),
        timeouts)

    async def finish(record: RequestRecord, stream: EventStream | None) -> RequestRecord:
        """Parse the stream, fill in the record and hand it to `on_complete`, each at a turn."""
        if stream is not None:
            while stream.unparsed:
                await turns.take()
                stream.parse()
            stream.fill(record)
        if on_answer is not None:
            on_answer(record, stream.counts.output_ids if stream is not None else [])
        if record.error is not None and gc_pause.note_failure():
            await turns.take()
            gc.collect()
        if on_complete is not None:
            await turns.take()
            on_complete(record)
        return record

    try:
        warm = [(-1 - i, p, warmup_output_len) for i, p in enumerate(warmup_prompts)]
        records = await _closed_loop(requests, finish, warm, concurrency or max(len(warm), 1), warmup=True)
        jobs = [(i, prompt, n) for i, (prompt, n) in enumerate(zip(prompts, output_lens))]
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

    async def one(index: int, prompt: list[int], output_len: int) -> RequestRecord:
        async with slots:
            flight = await requests.start(index, prompt, output_len, False)
            stream = await requests.end(flight)
        return await finish(flight.record, stream)  # type: ignore[arg-type]

    try:
        for job, offset in zip(jobs, arrivals):
            delay = begin + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(*job)))
    except BaseException:
        await _cancel_all(tasks)
        raise
    await _finish_all(tasks)
    return [task.result() for task in tasks]
