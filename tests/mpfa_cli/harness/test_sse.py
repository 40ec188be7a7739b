"""The event-stream framing (`sse.SseReader`): fed any bytes split into any reads, it gives the events a reading of
the whole body by the WHATWG rules gives (a reference written here from the rules), and it bounds what it keeps."""
from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mpfa.mpfa_cli.harness.sse import BOM, SseReader, StreamError

FRAGMENTS = [b"data", b"data:", b"data: ", b":", b" ", b"\r", b"\n", b"\r\n", b"x", b"{}", b"id: 1", b"event",
             b"\xef", b"\xbb", b"\xbf", BOM, b"\xff"]


def reference_events(body: bytes) -> list[bytes]:
    """The events of a whole body by the rules: a leading BOM dropped, lines split at CRLF, LF or CR, an empty
    line dispatching the data lines read since the last one (joined with LF), comments and other fields ignored,
    and an event the body ends inside dropped."""
    body = body[len(BOM):] if body.startswith(BOM) else body
    events, data = [], None
    for line in re.split(rb"\r\n|\r|\n", body)[:-1]:
        if not line:
            if data is not None:
                events.append(b"\n".join(data))
            data = None
        elif not line.startswith(b":"):
            field, _, value = line.partition(b":")
            if field == b"data":
                data = [*(data or []), value[1:] if value.startswith(b" ") else value]
    return events


def read(pieces: list[bytes], max_event_bytes: int = 1 << 20) -> list[bytes]:
    reader = SseReader(max_event_bytes)
    return [event for piece in pieces for event in reader.feed(piece)]


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(body) + 1) for c in cuts}), len(body)]
    return [body[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=40), cuts=st.lists(st.integers(0, 400), max_size=12))
@example(fragments=[b"data: {", b"\r", b"\n", b"data: }", b"\r\n", b"\r\n"], cuts=[8])  # a CRLF split mid-event
@example(fragments=[BOM, b"data: x", b"\n\n"], cuts=[1, 2])  # a BOM over three reads
@example(fragments=[b"x", BOM, b"data: x", b"\n\n"], cuts=[])  # a BOM past the start is data
def test_any_bytes_in_any_reads_give_the_events_of_the_whole_body(fragments, cuts):
    body = b"".join(fragments)
    assert read(split(body, cuts)) == reference_events(body)


def test_an_event_past_the_size_limit_fails_whether_its_lines_are_whole_or_not():
    with pytest.raises(StreamError, match="stream event longer than 10 bytes"):
        read([b"data: 123456\ndata: 7890\n"], max_event_bytes=10)  # 11 bytes joined
    with pytest.raises(StreamError, match="stream event longer than 10 bytes"):
        read([b"data: 12345", b"678901"], max_event_bytes=10)  # an unfinished line
    assert read([b"data: 12345\ndata: 6789\n\n"], max_event_bytes=10) == [b"12345\n6789"]


def test_mid_event_says_whether_an_event_was_left_unended():
    reader = SseReader(100)
    assert reader.feed(b"data: 1\n\n: comment") == [b"1"] and not reader.mid_event
    assert reader.feed(b"\nda") == [] and reader.mid_event
    assert reader.feed(b"ta: 2\n") == [] and reader.mid_event
    assert reader.feed(b"\n") == [b"2"] and not reader.mid_event
