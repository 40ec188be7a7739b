"""A server's control replies (`/get_server_info`, ...) are read with a size limit and a deadline, and a redirect
is refused: a hostile or broken server costs at most 1 MiB and the timeout, and cannot send mpfa elsewhere."""
from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.server_json import MAX_REPLY_BYTES, fetch_json

Reply = Callable[[socket.socket], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], str]]:
    """`serve(reply)`: the URL of a server on 127.0.0.1 that reads a request's head and runs `reply` on the socket."""
    listeners: list[socket.socket] = []

    def start(reply: Reply) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                        head += chunk
                    try:
                        reply(conn)
                    except OSError:  # the client hung up: what these servers are for
                        pass

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}/get_server_info"

    yield start
    for listener in listeners:
        listener.close()


def _answer(body: bytes, head: str = "HTTP/1.1 200 OK") -> Reply:
    return lambda conn: conn.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


def _endless(head: bytes) -> Reply:
    def reply(conn: socket.socket) -> None:
        conn.sendall(head)
        block = b" " * 65536
        while True:
            conn.sendall(block)

    return reply


def _trickle(head: bytes, rest: bytes, every_s: float = 0.2) -> Reply:
    def reply(conn: socket.socket) -> None:
        conn.sendall(head)
        for byte in rest:
            time.sleep(every_s)
            conn.sendall(bytes([byte]))

    return reply


def _refused(url: str, *words: str, timeout_s: float = 10.0) -> tuple[float, int]:
    """(seconds, peak bytes allocated) of a `fetch_json` that must fail in one line holding `words`."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(UserError) as refused:
            fetch_json(url, timeout_s=timeout_s)
        took = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert "\n" not in message and refused.value.exit_code == 1
    assert all(word in message for word in words), message
    return took, peak


def test_a_reply_is_read_as_a_json_object(serve):
    assert fetch_json(serve(_answer(b'{"attention_backend": "fa4"}'))) == {"attention_backend": "fa4"}


def test_a_redirect_is_refused_naming_where_it_points(serve):
    elsewhere = "http://203.0.113.9:30000/get_server_info"
    url = serve(lambda conn: conn.sendall(f"HTTP/1.1 302 Found\r\nLocation: {elsewhere}\r\nContent-Length: 0"
                                          "\r\n\r\n".encode()))
    _refused(url, "HTTP 302", f"a redirect to {elsewhere}: not followed")


def test_a_300_mb_reply_declared_as_such_is_refused_before_its_body_is_read(serve):
    url = serve(_endless(b"HTTP/1.1 200 OK\r\nContent-Length: 300000000\r\n\r\n"))
    took, peak = _refused(url, "reply of 300000000 bytes is over the 1048576-byte limit")
    assert took < 2 and peak < 256 * 1024


@pytest.mark.parametrize("framing", ["Transfer-Encoding: chunked", "Connection: close"])
def test_an_endless_reply_is_cut_at_the_limit(serve, framing):
    if "chunked" in framing:
        def reply(conn: socket.socket) -> None:
            conn.sendall(f"HTTP/1.1 200 OK\r\n{framing}\r\n\r\n".encode())
            while True:
                conn.sendall(b"10000\r\n" + b" " * 65536 + b"\r\n")
    else:
        reply = _endless(f"HTTP/1.1 200 OK\r\n{framing}\r\n\r\n".encode())
    took, peak = _refused(serve(reply), f"over the {MAX_REPLY_BYTES}-byte limit")
    assert took < 5 and peak < 4 * MAX_REPLY_BYTES


@pytest.mark.parametrize("where", ["body", "head"])
def test_a_reply_trickled_a_byte_at_a_time_fails_at_the_deadline(serve, where):
    body = b'{"attention_backend": "fa4"}'
    if where == "body":
        reply = _trickle(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode(), body)
    else:
        reply = _trickle(b"HTTP/1.1 200 OK\r\n", f"X-Slow: {'x' * 100}\r\n\r\n".encode())
    took, _ = _refused(serve(reply), "no complete reply within 1 s", timeout_s=1.0)
    assert 0.9 < took < 3


def test_a_server_that_never_answers_fails_at_the_deadline(serve):
    took, _ = _refused(serve(lambda conn: time.sleep(5)), "no complete reply within 0.5 s", timeout_s=0.5)
    assert took < 2


@pytest.mark.parametrize(("body", "words"), [
    (b"<html>not json</html>", "the reply is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "the reply is not JSON"),
    (b'["fa4"]', "the reply is a JSON list, not an object"),
])
def test_a_reply_that_is_not_a_json_object_is_one_line(serve, body, words):
    _refused(serve(_answer(body)), words)


def test_an_error_status_is_one_line(serve):
    _refused(serve(_answer(b"down", "HTTP/1.1 503 Service Unavailable")), "HTTP 503 Service Unavailable")


def test_a_url_that_is_not_http_is_one_line():
    with pytest.raises(UserError, match="not an http:// or https:// URL"):
        fetch_json("file:///etc/passwd")
