"""aiohttp connections that timestamp every socket read before anything else runs, and the scheduling that
keeps the client's own work from delaying those stamps.

A benchmark client is only as precise as the moment it notes that bytes arrived. With aiohttp's streaming
API that moment is when the request's task wakes up and reads the body, which waits behind every other
callback of the event loop; with hundreds of streams receiving a chunk per decode step, that wait is
milliseconds. Here the connection protocol stamps `time.perf_counter()` on entering `data_received` and
hands the body bytes of each 200 response, with that stamp, to a `BodySink` made for the response.
Nothing else runs per read: no task wakes up until the body has ended.

aiohttp has no public hook at this level. `StampingHandler` subclasses its connection protocol
(`aiohttp.client_proto.ResponseHandler`) and relies on its `_payload` (the body being received) and
`feed_data((message, payload))` (called once per response head); `StampingConnector` replaces the
connector's protocol factory (`_factory`). The client tests check stamps, ends and failures against real
servers, so an aiohttp release that changes these fails the tests rather than skewing numbers.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.streams import StreamReader

QUIET_S = 100e-6  # sockets without a read for this long are quiet (see `Turns`)
RECHECK_S = 1e-3  # how soon a turn looks again at sockets that were not quiet
MAX_TURN_DEFERRAL_S = 20e-3  # longest a step waits for quiet sockets


class BodySink(Protocol):
    """Where a 200 response's body goes as it arrives."""

    ended: bool

    def add(self, arrived: float, data: bytes) -> None:
        """Body bytes from one socket read, stamped when the read arrived."""

    def end(self, failure: BaseException | None = None) -> None:
        """The body is complete, or broken by `failure`; called once."""


class LastRead:
    """When any connection of a session last read from its socket."""

    __slots__ = ("at_s",)

    def __init__(self) -> None:
        self.at_s = 0.0


class StampingHandler(ResponseHandler):
    """aiohttp's connection protocol, plus: every read is stamped first, and the body of a 200 response goes,
    read by read, to the sink that `new_sink()` made for it (kept in `sinks[payload]` for the request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sinks: dict[StreamReader, BodySink],
                 new_sink: Callable[[], BodySink], last_read: LastRead) -> None:
        super().__init__(loop)
        self._sinks = sinks
        self._new_sink = new_sink
        self._last_read = last_read
        self._sink: BodySink | None = None  # of the response being received, when it is a 200

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=0)  # send on write(); uvloop would defer it to the loop's end

    def feed_data(self, data: tuple[Any, StreamReader], size: int = 0) -> None:
        message, payload = data
        if message.code == 200:
            self._sink = self._sinks[payload] = self._new_sink()
            self.read_timeout = None  # the sink's owner watches for silence: no timer re-armed on every read
        else:
            self._sink = None
        super().feed_data(data, size)

    def data_received(self, data: bytes) -> None:
        if not data:  # aiohttp resuming a paused parser; the read that is draining collects what it yields
            super().data_received(data)
            return
        self._last_read.at_s = arrived = time.perf_counter()
        super().data_received(data)
        sink = self._sink
        if sink is not None and not sink.ended:
            self._drain(sink, arrived)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)  # ends a body read until EOF, or marks an unfinished one failed
        sink = self._sink
        if sink is not None and not sink.ended:
            self._drain(sink, time.perf_counter())
            if not sink.ended:
                sink.end(aiohttp.ServerDisconnectedError("connection closed before the response ended"))

    def _drain(self, sink: BodySink, arrived: float) -> None:
        payload = self._payload
        if payload is None:
            return
        if (failure := payload.exception()) is not None:
            sink.end(failure)
            return
        while body := payload.read_nowait():  # draining can resume a paused parser, which yields more
            sink.add(arrived, body)
        if payload.is_eof():
            sink.end()

    def resume_reading(self, *args: Any, **kwargs: Any) -> None:
        if self._reading_paused:  # aiohttp calls this on every buffer read, and re-parses even when not paused
            super().resume_reading(*args, **kwargs)


class StampingConnector(aiohttp.TCPConnector):
    """A connector whose connections are `StampingHandler`s; `take_sink` hands a response's sink over."""

    def __init__(self, new_sink: Callable[[], BodySink], last_read: LastRead, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not hasattr(self, "_factory"):
            raise RuntimeError(f"aiohttp {aiohttp.__version__} has no connection protocol factory to replace")
        self._sinks: dict[StreamReader, BodySink] = {}
        self._factory = functools.partial(StampingHandler, self._loop, self._sinks, new_sink, last_read)

    def take_sink(self, payload: StreamReader) -> BodySink:
        """The sink of a 200 response (`response.content`); it keeps filling until the body ends."""
        return self._sinks.pop(payload)


def request_trace(turns: "Turns") -> aiohttp.TraceConfig:
    """aiohttp tracing for the client's requests, which pass their record as `trace_request_ctx`:

    - `dispatch_s` is set right before the request body goes to the socket: aiohttp fires
      `on_request_chunk_sent` before the write, and a bytes body is one write. With the connections' zero
      write-buffer limit, that write is the `send()`.
    - a request that had to open a connection takes another turn (see `Turns`) once it is open: building
      and sending it then resumes in a later iteration, and a wave of new connections (the first requests
      of a run) would otherwise resume all at once.
    """
    async def stamp_dispatch(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
        context.trace_request_ctx.dispatch_s = time.perf_counter()

    async def take_turn(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
        await turns.take(send=True)

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(stamp_dispatch)
    trace.on_connection_create_end.append(take_turn)
    return trace


class Turns:
    """Runs the client's steps one at a time, each in its own event-loop iteration: sending a request (aiohttp's
    request path, 0.05-0.09 ms) first, then the others (parsing a finished stream, ~0.1-0.3 ms; the caller's
    per-record callback) when the sockets are quiet.

    Reads are stamped when the loop polls its sockets, between iterations, and an iteration runs every
    callback that was ready when it began. When 512 streams end on one decode step, their follow-up work
    would otherwise run in a few long iterations while the other streams' last chunks wait unstamped. A
    send (`take(send=True)`: a freed slot's refill) is handed its turn at once, ahead of the others: a read
    waits at most one send to be stamped, and the slot is busy again. Any other turn is handed on when no
    read has arrived for QUIET_S, else looked at again RECHECK_S later (a timer, not a busy loop), and given
    anyway to a step that has waited MAX_TURN_DEFERRAL_S, so that a client whose sockets never go quiet still
    makes progress.
    """

    def __init__(self, last_read: LastRead) -> None:
        self._last_read = last_read
        self._sends: collections.deque[asyncio.Future[None]] = collections.deque()
        self._waiting: collections.deque[tuple[asyncio.Future[None], float]] = collections.deque()
        self._handing_on = False
        self._loop = asyncio.get_running_loop()

    def give(self, waiter: asyncio.Future[None], send: bool = False) -> None:
        """Resolve `waiter` at its turn (sends first, then first come, first served); a cancelled waiter loses
        its turn."""
        if send:
            self._sends.append(waiter)
        else:
            self._waiting.append((waiter, time.perf_counter()))
        if not self._handing_on:
            self._handing_on = True
            self._loop.call_soon(self._hand_on)

    async def take(self, send: bool = False) -> None:
        """Return at this task's turn; the step that follows should not await before its work is done. `send`:
        the step sends a request."""
        waiter = self._loop.create_future()
        self.give(waiter, send)
        await waiter

    def _hand_on(self) -> None:
        sends, waiting = self._sends, self._waiting
        while sends and sends[0].done():
            sends.popleft()
        if sends:
            sends.popleft().set_result(None)
            self._loop.call_soon(self._hand_on)
            return
        while waiting and waiting[0][0].done():
            waiting.popleft()
        if not waiting:
            self._handing_on = False
            return
        now = time.perf_counter()
        waiter, since = waiting[0]
        if now - self._last_read.at_s < QUIET_S and now - since < MAX_TURN_DEFERRAL_S:
            self._loop.call_later(RECHECK_S, self._hand_on)
            return
        waiting.popleft()
        waiter.set_result(None)  # its task runs in the next iteration; the next turn is looked for after it
        self._loop.call_soon(self._hand_on)
