"""One request of the load: written on a keep-alive connection, then its outcome read into its record.

`Requests.start` takes a connection (an idle one, or a new one within the connect timeout) and writes the request;
`Requests.write` writes it on a connection at hand, which is how a closed loop refills a slot from the completion
path of its previous response (`stamped_reads.Exchange.then`). `Requests.end` waits for the response under the
timeouts and returns the body's sink of a 200, else None with the record's error set. Nothing here raises for a
failed request.

A request the server never answered because it closed the kept-alive connection as the request went out
(`Exchange.resendable`: no byte came back) is sent once more, on a new connection and within the same deadline;
its dispatch time is then the second write's. A request that got any byte back is never sent again.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from .records import RequestRecord
from .request_timeouts import Timeouts
from .stamped_reads import BodySink, Connection, Connections, Endpoint, Exchange, RequestFailed

ERROR_BODY_CHARS = 300
ERROR_BODY_BYTES = 4 * ERROR_BODY_CHARS  # kept of an error body; the rest is dropped with the connection


class Flight:
    """A request and its exchange; `exchange` is None when no connection could be had (`record.error` says why)."""

    __slots__ = ("record", "prompt", "exchange", "connection", "deadline_s")

    def __init__(self, record: RequestRecord, prompt: list[int], deadline_s: float) -> None:
        self.record = record
        self.prompt = prompt
        self.deadline_s = deadline_s
        self.exchange: Exchange | None = None
        self.connection: Connection | None = None


class Requests:
    """Sends the load's requests to one endpoint (`body(prompt)` builds a request's JSON) and reads their outcome."""

    def __init__(self, connections: Connections, endpoint: Endpoint, body: Callable[[list[int], int], bytes],
                 new_sink: Callable[[int], Callable[[Callable[[], None]], BodySink]], timeouts: Timeouts) -> None:
        self._connections = connections
        self._endpoint = endpoint
        self._body = body  # (prompt, output tokens) -> the request's JSON
        self._new_sink = new_sink  # output tokens -> the sink factory of a response that may carry that many
        self._timeouts = timeouts

    def _flight(self, index: int, prompt: list[int], output_len: int, warmup: bool) -> Flight:
        # dispatch_s: when the request was begun; moved to its write to the socket once it has a connection
        now = time.perf_counter()
        record = RequestRecord(index=index, input_len=len(prompt), max_new_tokens=output_len,
                               dispatch_s=now, warmup=warmup)
        return Flight(record, prompt, now + self._timeouts.request_s)

    def _send(self, flight: Flight, connection: Connection) -> Flight:
        output_len = flight.record.max_new_tokens
        request = self._endpoint.post(self._body(flight.prompt, output_len))
        flight.connection, flight.exchange = connection, Exchange(self._new_sink(output_len), ERROR_BODY_BYTES)
        flight.record.dispatch_s = connection.send(request, flight.exchange)
        return flight

    async def start(self, index: int, prompt: list[int], output_len: int, warmup: bool) -> Flight:
        """Write the request on an idle connection, or on a new one."""
        flight = self._flight(index, prompt, output_len, warmup)
        try:
            connection = await self._connections.take(self._timeouts, flight.deadline_s)
        except RequestFailed as exc:
            flight.record.error = str(exc)
            return flight
        return self._send(flight, connection)

    def write(self, connection: Connection, index: int, prompt: list[int], output_len: int, warmup: bool) -> Flight:
        """Write the request on `connection`, free now."""
        return self._send(self._flight(index, prompt, output_len, warmup), connection)

    async def end(self, flight: Flight) -> BodySink | None:
        """Wait for the response: the body's sink of a 200 that ended (or that the sink stopped), else None
        with `record.error`. The connection goes back to the pool, or is dropped if its response did not end."""
        if flight.exchange is None:
            return None
        await self._wait(flight)
        if flight.exchange.resendable:
            then = flight.exchange.then
            try:
                connection = await self._connections.open(self._timeouts, flight.deadline_s)
            except RequestFailed as exc:
                flight.record.error = str(exc)
                return None
            self._send(flight, connection).exchange.then = then  # type: ignore[union-attr]
            await self._wait(flight)  # a new connection's exchange is never resendable: sent twice at most
        record, exchange = flight.record, flight.exchange
        sink, exchange.sink = exchange.sink, None  # the sink refers back to the exchange: no reference cycle left
        if exchange.status is not None and (exchange.status != 200 or exchange.not_event_stream is not None):
            text = exchange.error_body.decode(errors="replace")[:ERROR_BODY_CHARS].strip()
            what = f"HTTP {exchange.status}" if exchange.status != 200 else exchange.not_event_stream
            record.error = f"{what}: {text}" if text else what
            return None
        if exchange.failure is not None:
            record.error = exchange.failure
            return None
        record.completion_s = exchange.last_read_s  # a stream that ends without [DONE] completes at its last read
        return sink

    async def _wait(self, flight: Flight) -> None:
        """Until the exchange is done; then its connection goes back to the pool, or is dropped."""
        try:
            await flight.exchange.wait(self._timeouts, flight.deadline_s)  # type: ignore[union-attr]
        finally:
            self._connections.give_back(flight.connection, flight.exchange)  # type: ignore[arg-type]
