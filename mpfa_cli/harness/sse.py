"""Server-sent events framing (the WHATWG event-stream rules) over the bytes of a response body, read by read.

A byte-order mark at the start is skipped; lines end with CRLF, LF or CR (a CRLF split across two reads is one
line end); a line beginning with ':' is a comment; `data` lines accumulate (one leading space of the value
dropped) and an empty line dispatches them as one event, joined with LF; other fields (`event`, `id`, `retry`,
unknown names) are ignored; an event the stream ends inside is not dispatched. Works on bytes (the delimiters are
ASCII): the events' data is left for the caller's JSON parser to decode and validate as UTF-8.
"""
from __future__ import annotations

BOM = b"\xef\xbb\xbf"


class StreamError(Exception):
    """A response stream that cannot be trusted; the message says why."""


class SseReader:
    """Splits body bytes into events. An event (its data, or an unfinished line) longer than `max_event_bytes`
    raises `StreamError`: what is kept between reads never passes that size."""

    __slots__ = ("_max_event_bytes", "_head", "_after_cr", "_pending", "_pending_bytes", "_data", "_data_bytes")

    def __init__(self, max_event_bytes: int) -> None:
        self._max_event_bytes = max_event_bytes
        self._head: bytes | None = b""  # the first bytes while they may be a split byte-order mark; None after
        self._after_cr = False  # the last read ended with CR: an LF starting the next one ends no line
        self._pending: list[bytes] = []  # the start of an unfinished line, read by read
        self._pending_bytes = 0
        self._data: list[bytes] = []  # the data lines of the event being read
        self._data_bytes = 0

    @property
    def mid_event(self) -> bool:
        """Data of an event, or the start of a line that is no comment, has been read but not its end."""
        return bool(self._data) or (bool(self._pending) and self._pending[0][:1] != b":")

    def feed(self, data: bytes) -> list[bytes]:
        """The data of each event that `data` completes, in order."""
        if self._head is not None:
            data = self._skip_bom(data)
        if self._after_cr and data[:1] == b"\n":
            data = data[1:]
        self._after_cr = data[-1:] == b"\r"
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, tail = data.split(b"\n")
        events: list[bytes] = []
        if lines:
            if self._pending:
                lines[0] = b"".join(self._pending) + lines[0]
                self._pending, self._pending_bytes = [], 0
            for line in lines:
                if not line:
                    if self._data:
                        self._check_size()
                        events.append(b"\n".join(self._data))
                        self._data, self._data_bytes = [], 0
                elif line[0] != 0x3A:  # not a ':' comment
                    field, _, value = line.partition(b":")
                    if field == b"data":
                        value = value[1:] if value[:1] == b" " else value
                        self._data_bytes += len(value) + (1 if self._data else 0)  # the joined length
                        self._data.append(value)
        if tail:
            self._pending.append(tail)
            self._pending_bytes += len(tail)
        self._check_size()
        return events

    def _check_size(self) -> None:
        if self._data_bytes + self._pending_bytes > self._max_event_bytes:
            raise StreamError(f"stream event longer than {self._max_event_bytes} bytes")

    def _skip_bom(self, data: bytes) -> bytes:
        """`data` without a byte-order mark that starts the stream; b"" while the first bytes could still be one."""
        head = self._head + data  # type: ignore[operator]
        if len(head) < len(BOM) and BOM.startswith(head):
            self._head = head
            return b""
        self._head = None
        return head[len(BOM):] if head.startswith(BOM) else head
