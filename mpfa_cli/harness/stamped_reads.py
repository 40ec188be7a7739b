"""HTTP/1.1 keep-alive connections that timestamp every socket read before anything else runs.

A benchmark client is only as precise as the moment it notes that bytes arrived. Here a connection is an asyncio
`Protocol`: `data_received` stamps `time.perf_counter()` first, then feeds the bytes to `httptools` (llhttp, the C
parser uvicorn uses), whose callbacks hand the body of a 200 response, read by read and with that stamp, to a
`BodySink` made for the response. Nothing else runs per read: the request's task sleeps until its `Exchange` is
done. A request is one prebuilt `write()` (the write buffer limit is 0, so it is the `send()` itself), stamped
right before; a connection whose response ended cleanly carries the next request at once. Only a 200 whose body is
an uncompressed event stream reaches the sink (the request asks for `Accept-Encoding: identity`).

A server may close a kept-alive connection as a request goes out on it (an idle timeout, without `Connection:
close`): such a request got no byte back, was never answered, and is marked `Exchange.resendable`.

Bounds a server cannot get past: a response head of at most MAX_HEAD_BYTES, an error body kept up to the caller's
limit (then the connection is dropped), silence limits from the last read (`Exchange.wait`), and a deadline for
the whole request.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable
from typing import Protocol

import httptools

from .request_timeouts import Timeouts

MAX_HEAD_BYTES = 64 * 1024  # response bytes without a complete head; more fails the request


class BodySink(Protocol):
    """Where a 200 response's body goes as it arrives."""

    def add(self, arrived: float, data: bytes) -> None:
        """Body bytes from one socket read, stamped when the read arrived."""


class RequestFailed(Exception):
    """A request that could not be sent; the message says why."""


class LastRead:
    """When any connection of a run last read from its socket."""

    __slots__ = ("at_s",)

    def __init__(self) -> None:
        self.at_s = 0.0


class Endpoint:
    """Where requests go (`http://host:port/path`, or https) and the bytes of a JSON POST there."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nUser-Agent: mpfa\r\n"
                      f"Accept: */*\r\nAccept-Encoding: identity\r\nContent-Type: application/json\r\n"
                      f"Content-Length: ").encode()

    def post(self, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self._head, len(body), body)


def _encoded(content_encoding: bytes) -> bool:
    return content_encoding.strip().lower() not in (b"", b"identity")


def _not_event_stream(content_type: bytes, content_encoding: bytes) -> str | None:
    """Why a 200 response with these headers is not an uncompressed event stream, if it is not."""
    if _encoded(content_encoding):
        return (f"server sent a body with Content-Encoding {content_encoding.decode(errors='replace')!r}, not an "
                "uncompressed event stream (mpfa asks for Accept-Encoding: identity)")
    if content_type.split(b";")[0].strip().lower() != b"text/event-stream":
        shown = repr(content_type.decode(errors="replace")) if content_type else "none"
        return f"server sent Content-Type {shown}, not an event stream (text/event-stream)"
    return None


class Exchange:
    """One request and its response. `done` resolves once the caller can go on: the response ended, the sink
    needs no more of it, the error body was read as far as it is kept, or it failed (`failure` says why)."""

    __slots__ = ("_new_sink", "_error_bytes", "_timer", "done", "status", "not_event_stream", "sink", "error_body",
                 "body_started", "replied", "reused", "failure", "resendable", "last_read_s", "then")

    def __init__(self, new_sink: Callable[[Callable[[], None]], BodySink], error_bytes: int) -> None:
        self._new_sink = new_sink  # called with `end` for a 200 response: the sink may end it early
        self._error_bytes = error_bytes  # error body bytes kept
        self._timer: asyncio.TimerHandle | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status: int | None = None
        self.not_event_stream: str | None = None  # why a 200's body is not read as a stream
        self.sink: BodySink | None = None
        self.error_body = bytearray()
        self.body_started = False
        self.replied = False  # any byte of the response arrived
        self.reused = False  # sent on a connection that had carried a response before
        self.failure: str | None = None
        self.resendable = False  # failed by the connection's close with no byte back, on a reused connection
        self.last_read_s = 0.0  # the request's write, then each read
        self.then: Callable[[Connection], None] | None = None  # called with the connection once it can carry another

    def head(self, status: int, content_type: bytes, content_encoding: bytes) -> None:
        self.status = status
        if status != 200:
            return
        self.not_event_stream = _not_event_stream(content_type, content_encoding)
        if self.not_event_stream is None:
            self.sink = self._new_sink(self.end)
        elif _encoded(content_encoding):  # nothing readable to show of its body
            self.end()

    def body(self, arrived: float, data: bytes) -> None:
        self.body_started = True
        if self.sink is not None:
            self.sink.add(arrived, data)
        else:
            self.error_body += data[:self._error_bytes - len(self.error_body)]
            if len(self.error_body) >= self._error_bytes:
                self.end()

    def end(self) -> None:
        """Done: the response ended, or no more of it is wanted (then its connection is dropped)."""
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, reason: str) -> None:
        if not self.done.done():
            self.failure = reason
            self.done.set_result(None)

    def closed_by_server(self) -> None:
        """The server closed the connection before the response ended."""
        if not self.done.done():
            self.resendable = self.reused and not self.replied
        self.fail("server closed the connection before the response ended")

    async def wait(self, limits: Timeouts, deadline_s: float) -> None:
        """Until `done`; silence past the limit since the last read, or `deadline_s`, fails the exchange. One
        timer per request, looked at only when it fires."""
        self._watch(limits, deadline_s)
        try:
            await self.done
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None  # its callback refers back to this exchange: no reference cycle left behind

    def _watch(self, limits: Timeouts, deadline_s: float) -> None:
        now = time.perf_counter()
        limit_s = limits.chunk_s if self.body_started else limits.first_token_s
        if now >= deadline_s:
            self.fail(f"request not done after {limits.request_s:g} s")
        elif now >= self.last_read_s + limit_s:
            what = "data" if self.body_started else "first token" if self.status is not None else "response"
            self.fail(f"no {what} from the server for {limit_s:g} s")
        else:  # looked at again by then, and within the shorter limit (the body may start meanwhile)
            next_s = min(deadline_s, self.last_read_s + limit_s, now + min(limits.chunk_s, limits.first_token_s))
            self._timer = asyncio.get_running_loop().call_later(next_s - now, self._watch, limits, deadline_s)


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: `send` writes a request, the response goes to its `Exchange`."""

    def __init__(self, last_read: LastRead) -> None:
        self._last_read = last_read
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._exchange: Exchange | None = None
        self._arrived = 0.0  # stamp of the read being parsed
        self._head_bytes = 0
        self._sized = False  # the response has a Content-Length or is chunked (else its body ends with the connection)
        self._content_type = b""
        self._content_encoding = b""
        self._keep_alive = True
        self._responses = 0  # carried to their end

    @property
    def exchange(self) -> Exchange | None:
        """The exchange whose response this connection is receiving."""
        return self._exchange

    @property
    def reusable(self) -> bool:
        """Open, its last response complete, and the server keeps it alive."""
        transport = self._transport
        return transport is not None and not transport.is_closing() and self._exchange is None and self._keep_alive

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.set_write_buffer_limits(high=0)  # send on write(); uvloop would defer it to the iteration's end
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, exchange: Exchange) -> float:
        """Write `request`, its response going to `exchange`; returns the stamp taken right before the write."""
        self._exchange, self._head_bytes = exchange, 0
        exchange.reused = self._responses > 0
        exchange.last_read_s = sent = time.perf_counter()
        if self._transport is None:  # the server closed it before the request could go
            exchange.closed_by_server()
        else:
            self._transport.write(request)
        return sent

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._last_read.at_s = self._arrived = arrived = time.perf_counter()
        exchange = self._exchange
        if exchange is None:  # bytes nobody asked for
            self.close()
            return
        exchange.last_read_s, exchange.replied = arrived, True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed HTTP response: {exc}")
            return
        if exchange.status is None and self._exchange is exchange:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(f"response head longer than {MAX_HEAD_BYTES} bytes")

    def eof_received(self) -> bool:
        return False  # close: a response the EOF cuts short fails in connection_lost

    def connection_lost(self, exc: BaseException | None) -> None:
        self._transport = None
        exchange, self._exchange = self._exchange, None
        if exchange is None:
            return
        if exchange.status is not None and not self._sized:  # a body delimited by the connection's end
            exchange.end()
        else:
            exchange.closed_by_server()

    def _fail(self, reason: str) -> None:
        if self._exchange is not None:
            self._exchange.fail(reason)
        self.close()

    # httptools callbacks: none raises, and each ignores a response no request waits for

    def on_message_begin(self) -> None:
        self._sized = False
        self._content_type = self._content_encoding = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self._sized = True
        elif name == b"content-type":
            self._content_type = value
        elif name == b"content-encoding":
            self._content_encoding = value

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if self._exchange is not None and status >= 200:  # 1xx: an interim response, the real one follows
            self._exchange.head(status, self._content_type, self._content_encoding)

    def on_body(self, body: bytes) -> None:
        if self._exchange is not None:
            self._exchange.body(self._arrived, body)

    def on_message_complete(self) -> None:
        exchange = self._exchange
        if exchange is None or exchange.status is None:
            return
        self._exchange, self._keep_alive = None, self._parser.should_keep_alive()
        self._responses += 1
        if not self._keep_alive:
            self.close()
        exchange.end()
        if exchange.then is not None and self.reusable:
            exchange.then(self)  # the next request goes in the iteration, and the callback, this one ended


class Connections:
    """Keep-alive connections to one endpoint: a request takes the connection freed last, or opens one."""

    def __init__(self, endpoint: Endpoint, last_read: LastRead) -> None:
        self._endpoint = endpoint
        self._last_read = last_read
        self._idle: list[Connection] = []
        self._open: set[Connection] = set()

    async def take(self, limits: Timeouts, deadline_s: float) -> Connection:
        """A connection for one request, idle or new; raises `RequestFailed` if none opens in time."""
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable:
                return connection
            self._open.discard(connection)
        return await self.open(limits, deadline_s)

    async def open(self, limits: Timeouts, deadline_s: float) -> Connection:
        """A new connection; raises `RequestFailed` if it does not open in time."""
        remaining_s = deadline_s - time.perf_counter()
        endpoint, loop = self._endpoint, asyncio.get_running_loop()
        try:
            async with asyncio.timeout(min(limits.connect_s, remaining_s)):
                _, connection = await loop.create_connection(
                    lambda: Connection(self._last_read), endpoint.host, endpoint.port, ssl=endpoint.ssl,
                    server_hostname=endpoint.host if endpoint.ssl else None)
        except TimeoutError:
            if remaining_s < limits.connect_s:
                raise RequestFailed(f"request not done after {limits.request_s:g} s") from None
            raise RequestFailed(f"no connection to the server within {limits.connect_s:g} s") from None
        except OSError as exc:
            raise RequestFailed(f"cannot connect to the server: {type(exc).__name__}: {exc}") from None
        self._open.add(connection)
        return connection

    def give_back(self, connection: Connection, exchange: Exchange) -> None:
        """After `exchange`: keep `connection` for the next request if the response ended cleanly, else drop it;
        one that already carries the next request (`Exchange.then`) stays with it."""
        if connection.exchange not in (None, exchange):
            return
        if connection.reusable:
            self._idle.append(connection)
        else:
            connection.close()
            self._open.discard(connection)

    def close(self) -> None:
        for connection in self._open:
            connection.close()
        self._open.clear()
        self._idle.clear()
