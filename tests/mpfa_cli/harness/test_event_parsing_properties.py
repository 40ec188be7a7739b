"""Properties of the client's stream parsing (`client._EventStream`), over generated streams (hypothesis): however
the bytes are split into reads, a stream yields the same chunks, each stamped by the read that ended its line;
whatever the events hold, parsing never raises, and a stream it accepts has typed, bounded counts."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mpfa.mpfa_cli.harness.client import _EVENT_PARSERS, MAX_COUNT, _EventStream

SETTINGS = settings(max_examples=150, deadline=None)
SCALARS = st.none() | st.booleans() | st.integers() | st.sampled_from([2**31, 2**63, -1]) | st.floats() | st.text(
    max_size=8)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["meta_info", "completion_tokens", "prompt_tokens",
                                                         "finish_reason", "type", "error", "usage", "choices"]),
                                        inner, max_size=4), max_leaves=8)


def _parsed(pieces: list[bytes], api: str = "sglang") -> _EventStream:
    """A stream fed `pieces` as reads stamped 0, 1, 2, ... and parsed to the end."""
    stream = _EventStream(_EVENT_PARSERS[api][1], lambda _: None, lambda: None)
    for stamp, piece in enumerate(pieces):
        stream.add(float(stamp), piece)
    while stream.unparsed:
        stream.parse()
    return stream


def _split(body: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(body) + 1) for c in cuts}), len(body)]
    return [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@st.composite
def sglang_streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A well-formed `/generate` body, and the new tokens each of its events carries."""
    steps = draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
    total, events = 0, []
    for i, step in enumerate(steps):
        total += step
        meta = {"completion_tokens": total, "prompt_tokens": 7,
                "finish_reason": {"type": "length"} if i == len(steps) - 1 else None}
        events.append(b"data: " + json.dumps({"text": "x" * draw(st.integers(0, 40)), "meta_info": meta}).encode()
                      + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n", steps


@SETTINGS
@given(stream=sglang_streams(), cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_any_split_into_reads_gives_the_same_chunks_stamped_by_the_read_that_ended_them(stream, cuts):
    body, steps = stream
    pieces = _split(body, cuts)
    parsed = _parsed(pieces)
    assert parsed.error is None and parsed.finished and parsed.chunk_tokens == steps
    ends = [sum(map(len, pieces[:i + 1])) for i in range(len(pieces))]  # offset after each read

    def stamp_of(offset: int) -> float:
        return float(next(i for i, end in enumerate(ends) if end > offset))

    line_ends = [i for i in range(len(body)) if body[i:i + 1] == b"\n" and body[i - 1:i] != b"\n"]
    assert parsed.chunk_s == [stamp_of(offset) for offset in line_ends[:-1]]
    assert parsed.done_s == stamp_of(line_ends[-1])


@SETTINGS
@given(events=st.lists(VALUES, min_size=1, max_size=6), api=st.sampled_from(sorted(_EVENT_PARSERS)),
       cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_any_events_parse_without_raising_and_accepted_counts_are_bounded_integers(events, api, cuts):
    body = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)
    parsed = _parsed(_split(body, cuts), api)
    if parsed.stopped:
        assert parsed.error.startswith(("unreadable stream chunk: ", "server error: "))
        return
    assert all(type(k) is int and 0 < k < MAX_COUNT for k in parsed.chunk_tokens)
    assert parsed.counted == sum(parsed.chunk_tokens) and len(parsed.chunk_s) == len(parsed.chunk_tokens)
    for count in (parsed.server_total, parsed.prompt_tokens):
        assert count is None or (type(count) is int and 0 <= count < MAX_COUNT)


@SETTINGS
@given(body=st.binary(max_size=300), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_any_bytes_parse_without_raising(body, cuts):
    parsed = _parsed(_split(body, cuts))
    assert parsed.stopped == (parsed.error is not None)
