"""Properties of the client's stream parsing (`client_streams.EventStream` over `sse.SseReader`), over generated
streams (hypothesis): however the bytes are framed (LF, CR or CRLF line ends, a byte-order mark, an event's data
over several lines, comments and other fields) and split into reads, a stream yields the same chunks, each stamped
by the read that completed its event; nothing after the first `[DONE]` counts; whatever the events hold, parsing
never raises, and a stream it accepts has typed, bounded counts."""
from __future__ import annotations

import json
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from mpfa.mpfa_cli.harness.client_apis import APIS, MAX_COUNT
from mpfa.mpfa_cli.harness.client_streams import EventStream, StreamLimits
from mpfa.mpfa_cli.harness.sse import BOM

SETTINGS = settings(max_examples=150, deadline=None)
MAX_NEW_TOKENS = 64
MB = 1024 * 1024
SCALARS = st.none() | st.booleans() | st.integers() | st.sampled_from([2**31, 2**63, -1]) | st.floats() | st.text(
    max_size=8)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["meta_info", "completion_tokens", "prompt_tokens",
                                                         "finish_reason", "type", "error", "usage", "choices"]),
                                        inner, max_size=4), max_leaves=8)
STREAM_ERRORS = ("unreadable stream chunk: ", "server error: ", "token count went backwards: ", "server counts ",
                 f"server sent more than the {MAX_NEW_TOKENS} tokens requested")


def _parsed(pieces: list[bytes], api: str = "sglang") -> EventStream:
    """A stream fed `pieces` as reads stamped 0, 1, 2, ... and parsed to the end."""
    stream = EventStream(APIS[api], StreamLimits.for_request(MAX_NEW_TOKENS), lambda _: None, lambda: None)
    for stamp, piece in enumerate(pieces):
        stream.add(float(stamp), piece)
    while stream.unparsed:
        stream.parse()
    return stream


def _split(body: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(body) + 1) for c in cuts}), len(body)]
    return [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@st.composite
def sglang_streams(draw: st.DrawFn) -> tuple[bytes, list[int], list[int]]:
    """A well-formed `/generate` body in any framing the event-stream rules allow: (the body, the new tokens each
    of its events carries, the offset of each event's end, `[DONE]` last)."""
    eol = draw(st.sampled_from([b"\n", b"\r", b"\r\n"]))
    body = bytearray(BOM if draw(st.booleans()) else b"")
    steps = draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
    ends, total = [], 0
    for i, step in enumerate([*steps, None]):
        if step is None:
            text = b"[DONE]"
        else:
            total += step
            meta = {"completion_tokens": total, "prompt_tokens": 7,
                    "finish_reason": {"type": "length"} if i == len(steps) - 1 else None}
            text = json.dumps({"text": "x" * draw(st.integers(0, 40)), "meta_info": meta}).encode()
        for other in draw(st.lists(st.sampled_from([b": keep-alive", b":", b"id: 7", b"event: message", b"retry: 5",
                                                    b"unknown field"]), max_size=2)):
            body += other + eol
        spaces = [j for j, byte in enumerate(text) if byte == 0x20]  # JSON whitespace: a line break may replace it
        breaks = sorted(set(draw(st.lists(st.sampled_from(spaces), max_size=3)))) if spaces else []
        for a, b in zip([-1, *breaks], [*breaks, len(text)]):
            body += draw(st.sampled_from([b"data: ", b"data:"])) + text[a + 1:b] + eol
        ends.append(len(body))  # the empty line that ends the event: complete at its first byte
        body += eol
    return bytes(body), steps, ends


def _read_holding(pieces: list[bytes], offset: int) -> float:
    """The stamp of the read (0, 1, 2, ...) that holds the byte at `offset`."""
    end = 0
    for stamp, piece in enumerate(pieces):
        end += len(piece)
        if end > offset:
            return float(stamp)
    raise AssertionError("offset past the body")


@SETTINGS
@given(stream=sglang_streams(), cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_any_framing_and_split_into_reads_gives_the_same_chunks_stamped_by_the_read_that_completed_them(
        stream, cuts):
    body, steps, ends = stream
    pieces = _split(body, cuts)
    parsed = _parsed(pieces)
    assert parsed.error is None and parsed.counts.finished and parsed.chunk_tokens == steps
    assert parsed.chunk_s == [_read_holding(pieces, offset) for offset in ends[:-1]]
    assert parsed.done_s == _read_holding(pieces, ends[-1])


@SETTINGS
@given(stream=sglang_streams(), after=st.binary(max_size=200), cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_nothing_after_the_first_done_counts(stream, after, cuts):
    body, steps, _ = stream
    pieces = _split(body, cuts)
    token_and_done = b'data: {"meta_info": {"completion_tokens": 99}}\n\ndata: [DONE]\n\n'
    parsed, alone = _parsed([*pieces, token_and_done, after]), _parsed(pieces)
    assert parsed.error is None and parsed.chunk_tokens == steps and parsed.counts.server_total == sum(steps)
    assert (parsed.chunk_s, parsed.done_s) == (alone.chunk_s, alone.done_s)


@SETTINGS
@given(events=st.lists(VALUES, min_size=1, max_size=6), api=st.sampled_from(sorted(APIS)),
       cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_any_events_parse_without_raising_and_accepted_counts_are_bounded_integers(events, api, cuts):
    body = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)
    parsed = _parsed(_split(body, cuts), api)
    if parsed.stopped:
        assert parsed.error.startswith(STREAM_ERRORS)
        return
    assert all(type(k) is int and 0 < k < MAX_COUNT for k in parsed.chunk_tokens)
    assert parsed.counts.counted == sum(parsed.chunk_tokens) <= MAX_NEW_TOKENS
    assert len(parsed.chunk_s) == len(parsed.chunk_tokens)
    for count in (parsed.counts.server_total, parsed.counts.prompt_tokens):
        assert count is None or (type(count) is int and 0 <= count < MAX_COUNT)
    assert parsed.counts.server_total is None or parsed.counts.server_total <= MAX_NEW_TOKENS


@SETTINGS
@given(body=st.binary(max_size=300), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_any_bytes_parse_without_raising(body, cuts):
    parsed = _parsed(_split(body, cuts))
    assert parsed.stopped == (parsed.error is not None)


def test_reads_past_the_backlog_limit_are_parsed_as_they_arrive():
    """With no turn ever given to parse (a client too busy), what is kept stays under MAX_BACKLOG_BYTES: a 10 MB
    stream of 20,000 events is read, every event stamped by its read, in a few MB."""
    count = 20_000
    events = [b"data: " + json.dumps({"text": "x" * 440, "meta_info": {
        "completion_tokens": total, "finish_reason": {"type": "length"} if total == count else None}}).encode()
        + b"\n\n" for total in range(1, count + 1)]
    per_read = 128
    stream = EventStream(APIS["sglang"], StreamLimits.for_request(count), lambda _: None, lambda: None)
    tracemalloc.start()
    try:
        for stamp, start in enumerate(range(0, count, per_read)):
            stream.add(float(stamp), b"".join(events[start:start + per_read]))  # ~64 KB a read
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    while stream.unparsed:
        stream.parse()
    assert stream.error is None and stream.chunk_tokens == [1] * count
    assert stream.chunk_s == [float(i // per_read) for i in range(count)]
    assert sum(map(len, events)) > 10 * MB and peak < 4 * MB  # MAX_BACKLOG_BYTES kept, chunk lists, a read
