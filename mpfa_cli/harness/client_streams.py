"""One streamed response body as the load client reads it: kept read by read with its stamp, parsed into events
later (at a turn of the client's), and bounded in size, events and tokens by what its request asked for.

A response that breaks a bound, or that cannot be trusted (an error event, an unreadable chunk, a token count
that goes backwards), stops at once: the rest is neither kept nor parsed, and the request fails with the reason.
The first `data: [DONE]` completes the stream: whatever follows it counts for nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .client_apis import Api, StreamCounts, check_counts, error_message
from .records import RequestRecord
from .sse import SseReader, StreamError

PARSE_BATCH_BYTES = 32 * 1024  # stream bytes parsed per turn (~0.1-0.3 ms), and kept unparsed before one is due
MAX_BACKLOG_BYTES = 1024 * 1024  # unparsed bytes kept; past this a read is parsed as it arrives (bounded memory)

EVENT_BASE_BYTES = 1024 * 1024
EVENT_BYTES_PER_TOKEN = 64  # an event may repeat every output token so far (SGLang's cumulative `output_ids`)
EXTRA_EVENTS = 64  # events beyond one per token: a role chunk, the finish and usage chunks, `[DONE]`, ...
STREAM_BYTES_PER_EVENT = 4 * 1024


@dataclass(frozen=True)
class StreamLimits:
    """What the response to a request for `tokens` output tokens may hold; more fails the request."""

    tokens: int
    events: int
    event_bytes: int
    stream_bytes: int

    @classmethod
    def for_request(cls, max_new_tokens: int) -> "StreamLimits":
        """Room for one event per token plus EXTRA_EVENTS, event k carrying up to k tokens' worth of output."""
        events = max_new_tokens + EXTRA_EVENTS
        return cls(tokens=max_new_tokens, events=events,
                   event_bytes=EVENT_BASE_BYTES + EVENT_BYTES_PER_TOKEN * max_new_tokens,
                   stream_bytes=EVENT_BASE_BYTES + STREAM_BYTES_PER_EVENT * events
                   + EVENT_BYTES_PER_TOKEN * max_new_tokens * (max_new_tokens + 1) // 2)


class EventStream:
    """One SSE response body (a `stamped_reads.BodySink`). The connection only keeps each read with its stamp
    (`add`, about a microsecond); `parse` turns them into events later, in a turn of the client's, or at once
    for reads past MAX_BACKLOG_BYTES unparsed. An event that carries new tokens is noted with the stamp of the
    read that completed it (its empty line). An untrustworthy stream ends its request at once (`end_early`)."""

    __slots__ = ("api", "_limits", "_reader", "_on_backlog", "_end_early", "_pieces", "_parsed", "_backlog_bytes",
                 "_bytes", "_events", "parse_scheduled", "counts", "chunk_s", "chunk_tokens", "done_s", "error",
                 "stopped")

    def __init__(self, api: Api, limits: StreamLimits, on_backlog: Callable[["EventStream"], None],
                 end_early: Callable[[], None]) -> None:
        self.api = api
        self._limits = limits
        self._reader = SseReader(limits.event_bytes)
        self._on_backlog = on_backlog  # called once the unparsed reads pass PARSE_BATCH_BYTES
        self._end_early = end_early
        self._pieces: list[tuple[float, bytes] | None] = []  # (stamp, body bytes) per read; None once parsed
        self._parsed = 0
        self._backlog_bytes = 0
        self._bytes = 0  # of the whole body so far
        self._events = 0
        self.parse_scheduled = False
        self.counts = StreamCounts()
        self.chunk_s: list[float] = []
        self.chunk_tokens: list[int] = []
        self.done_s: float | None = None  # when the first `data: [DONE]` arrived
        self.error: str | None = None
        self.stopped = False  # the stream failed: the rest is not kept or parsed

    def add(self, arrived: float, data: bytes) -> None:
        if self.stopped:
            return
        self._bytes += len(data)
        if self._bytes > self._limits.stream_bytes:
            self.parse(MAX_BACKLOG_BYTES)  # what is kept may fail the stream for a more telling reason
            if not self.stopped:
                self._stop(f"stream longer than {self._limits.stream_bytes} bytes for {self._limits.tokens} tokens")
            return
        self._pieces.append((arrived, data))
        self._backlog_bytes += len(data)
        if self._backlog_bytes > MAX_BACKLOG_BYTES:
            self.parse(self._backlog_bytes - MAX_BACKLOG_BYTES)
        elif self._backlog_bytes > PARSE_BATCH_BYTES and not self.parse_scheduled:
            self.parse_scheduled = True
            self._on_backlog(self)

    @property
    def unparsed(self) -> bool:
        return self._parsed < len(self._pieces)

    def parse(self, budget_bytes: int = PARSE_BATCH_BYTES) -> None:
        """Parse the kept reads, oldest first, until about `budget_bytes` are done."""
        done = 0
        while self._parsed < len(self._pieces) and done < budget_bytes:
            arrived, data = self._pieces[self._parsed]  # type: ignore[misc]
            self._pieces[self._parsed] = None  # free the bytes
            self._parsed += 1
            self._backlog_bytes -= len(data)
            done += len(data)
            self._parse_piece(arrived, data)

    def _parse_piece(self, arrived: float, data: bytes) -> None:
        if self.stopped or self.done_s is not None:
            return
        try:
            for event in self._reader.feed(data):
                self._event(arrived, event)
                if self.stopped or self.done_s is not None:
                    return
        except StreamError as exc:
            self._stop(str(exc))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # malformed JSON, wrong fields
            self._stop(f"unreadable stream chunk: {type(exc).__name__}: {exc}")

    def _event(self, arrived: float, data: bytes) -> None:
        limits, counts = self._limits, self.counts
        self._events += 1
        if self._events > limits.events:
            raise StreamError(f"stream holds more than {limits.events} events for {limits.tokens} tokens")
        if data == b"[DONE]":
            self.done_s = arrived
            return
        event: Any = orjson.loads(data)
        if (message := error_message(event)) is not None:
            self._stop(f"server error: {message}")
            return
        new_tokens = self.api.read_event(event, counts)
        if new_tokens < 0:
            raise StreamError(f"server counts {counts.server_total} tokens after chunks carried {counts.counted}")
        if max(counts.counted + new_tokens, counts.server_total or 0) > limits.tokens:
            raise StreamError(f"server sent more than the {limits.tokens} tokens requested")
        if new_tokens:
            self.chunk_s.append(arrived)
            self.chunk_tokens.append(new_tokens)
            counts.counted += new_tokens

    def _stop(self, error: str) -> None:
        """Stop keeping and parsing and end the stream: its request fails and drops the connection."""
        self.error, self.stopped = error, True
        self._pieces, self._parsed, self._backlog_bytes = [], 0, 0
        self._end_early()

    def fill(self, record: RequestRecord) -> None:
        """Chunk times, counts and any error of the fully parsed stream into `record`."""
        record.chunk_s, record.chunk_tokens = self.chunk_s, self.chunk_tokens
        if self.stopped:  # the counts are incomplete
            record.completion_s = None
            record.error = self.error
            return
        counts = self.counts
        record.completion_s = self.done_s or record.completion_s
        record.output_tokens = counts.server_total or 0
        record.prompt_tokens = counts.prompt_tokens
        record.cached_tokens = counts.cached_tokens
        if self.done_s is None and self._reader.mid_event:
            record.error = "stream ended inside an event (no empty line after it)"
        else:
            record.error = counts.error or check_counts(record, counts, self.api)
