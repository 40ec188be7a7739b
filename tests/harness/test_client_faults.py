"""The load client against a hostile HTTP server (aiohttp on 127.0.0.1): every fault becomes a failed
request with its reason, in seconds, never a traceback or a hang."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from aiohttp import web

from mpfa.harness.client import MAX_LINE_BYTES, Timeouts, run_load

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MB = 1024 * 1024


async def against(handler: Handler, **load_options) -> tuple[object, float]:
    """Run one request of 4 tokens against a server answering with `handler`: (its record, seconds taken)."""
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    began = time.perf_counter()
    try:
        async with asyncio.timeout(20):  # a hang fails the test instead of stalling the suite
            (record,) = await run_load(f"http://127.0.0.1:{port}", [[1, 2, 3, 4]], 4, concurrency=1, **load_options)
    finally:
        await runner.cleanup()
    return record, time.perf_counter() - began


async def stream_of(request: web.Request, pieces: list[bytes], then_s: float = 0.0) -> web.StreamResponse:
    """Write `pieces` as an SSE body, then stay silent for `then_s` before ending it."""
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
    await asyncio.sleep(then_s)
    await response.write_eof()
    return response


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def streaming(pieces: list[bytes], then_s: float = 0.0) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_of(request, pieces, then_s)
    return handler


def test_an_oversized_error_body_is_not_read_whole():
    async def huge_500(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=500)
        response.content_length = 200 * MB
        await response.prepare(request)
        with_a_reason = b"out of memory " + b"x" * (MB - 14)
        try:
            for _ in range(200):
                await response.write(with_a_reason)
        except (ConnectionError, RuntimeError):  # the client hung up after the start of the body
            pass
        return response

    record, took_s = asyncio.run(against(huge_500))
    assert record.error.startswith("HTTP 500: out of memory xxx") and len(record.error) < 400
    assert took_s < 5


def test_an_endless_line_fails_the_request_in_linear_time():
    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await response.write(b'data: {"meta_info": "')
            for _ in range(200):  # 200 MB, never a newline
                await response.write(b"y" * MB)
        except (ConnectionError, RuntimeError):
            pass
        return response

    record, took_s = asyncio.run(against(endless))
    assert record.error == f"stream line longer than {MAX_LINE_BYTES} bytes"
    assert took_s < 5


@pytest.mark.parametrize("payload, words", [
    ([1, 2, 3], "unreadable stream chunk"),
    ({"meta_info": ["completion_tokens"]}, "unreadable stream chunk"),
    ({"meta_info": {"completion_tokens": "4"}}, "token count '4' is not an integer"),
    ({"meta_info": {"completion_tokens": 2**63}}, f"token count {2**63} is not an integer"),
    ({"meta_info": {"completion_tokens": -1}}, "token count -1 is not an integer"),
    ({"meta_info": {"completion_tokens": 4, "prompt_tokens": [4]}}, "token count [4] is not an integer"),
    ("just a string", "unreadable stream chunk"),
])
def test_wrong_types_in_an_event_fail_the_request(payload, words):
    record, took_s = asyncio.run(against(streaming([event(payload)])))
    assert not record.ok and words in record.error and record.output_tokens == 0
    assert took_s < 5


async def never_answers(request: web.Request) -> web.StreamResponse:
    await request.read()
    await asyncio.sleep(30)  # accepted, no response head (cancelled with the server)
    raise AssertionError("the client should have given up")


def slow_tokens(gap_s: float) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for total in range(1, 5):
            await asyncio.sleep(gap_s)
            await response.write(event({"meta_info": {"completion_tokens": total}}))
        await response.write_eof()
        return response
    return handler


@pytest.mark.parametrize("handler, timeouts, reason", [
    (never_answers, Timeouts(first_token_s=0.5), "no response from the server for 0.5 s"),
    (streaming([], then_s=30), Timeouts(first_token_s=0.5), "no first token from the server for 0.5 s"),
    (streaming([event({"meta_info": {"completion_tokens": 1}})], then_s=30), Timeouts(chunk_s=0.5),
     "no data from the server for 0.5 s"),
    (slow_tokens(0.3), Timeouts(chunk_s=0.5, request_s=0.8), "request not done after 0.8 s"),
], ids=["stall before headers", "stall before the first token", "stall mid-stream", "too slow overall"])
def test_a_stalled_server_fails_the_request_with_the_reason(handler, timeouts, reason):
    record, took_s = asyncio.run(against(handler, timeouts=timeouts))
    assert not record.ok and reason in record.error
    assert took_s < 3


@pytest.mark.parametrize("field", ["connect_s", "first_token_s", "chunk_s", "request_s"])
@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_a_timeout_must_be_positive_and_finite(field, value):
    with pytest.raises(ValueError, match=f"timeout {field} must be a positive number"):
        Timeouts(**{field: value})


def test_a_request_that_never_connects_is_dispatched_when_it_was_tried():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tried = time.perf_counter()
    (record,) = asyncio.run(run_load(f"http://127.0.0.1:{port}", [[1, 2, 3, 4]], 4, concurrency=1))
    assert not record.ok and "ClientConnectorError" in record.error
    assert tried <= record.dispatch_s <= time.perf_counter()



@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose accept queue is full: the kernel drops further connection attempts (SYNs), so a
    connect waits as it would for a host that never answers."""
    with contextlib.ExitStack() as sockets:
        listener = sockets.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: the queue holds one connection
        port = listener.getsockname()[1]
        for _ in range(2):
            filler = sockets.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        time.sleep(0.05)  # their handshakes complete and fill the queue
        yield port


def test_a_server_that_accepts_no_connection_fails_the_request_at_the_connect_timeout():
    with unanswered_port() as port:
        tried = time.perf_counter()
        (record,) = asyncio.run(asyncio.wait_for(run_load(
            f"http://127.0.0.1:{port}", [[1, 2, 3, 4]], 4, concurrency=1, timeouts=Timeouts(connect_s=0.5)), 20))
        took = time.perf_counter() - tried
    assert record.error == "no connection to the server within 0.5 s"
    assert 0.5 <= took < 2.0
    assert tried <= record.dispatch_s <= tried + took
