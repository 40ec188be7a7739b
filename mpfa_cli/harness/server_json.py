"""JSON from a server's control endpoints (`/get_server_info`, the simulator's `/sim_load` and `/sim_clock`).

A server is untrusted input: its reply is refused past a size limit (a longer Content-Length before any body byte is
read, a longer body as soon as it passes the limit), the whole exchange has a deadline (a reply trickled a byte at a
time fails at it, as a stalled one does), and a redirect is an error naming where it points, never followed: what
answers must be the server that was named.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any

from ..errors import UserError

MAX_REPLY_BYTES = 1 << 20
REPLY_TIMEOUT_S = 10.0


def fetch_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = REPLY_TIMEOUT_S,
               max_bytes: int = MAX_REPLY_BYTES) -> dict[str, Any]:
    """The JSON object a GET of `url` (a POST of `body`, when given) answers with HTTP 200; anything else is a
    one-line UserError (exit 1) naming the URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"cannot read {url}: not an http:// or https:// URL", exit_code=1)
    connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        connection = connection_type(parts.hostname, parts.port, timeout=timeout_s)
    except ValueError as exc:  # a port that is not a number
        raise UserError(f"cannot read {url}: {exc}", exit_code=1) from None
    deadline = _Deadline(connection, timeout_s)
    try:
        data = _exchange(connection, parts, body, max_bytes, url, deadline)
    except (OSError, http.client.HTTPException) as exc:
        if deadline.passed or isinstance(exc, TimeoutError):  # a socket timeout is the whole timeout_s as well
            raise UserError(f"cannot read {url}: no complete reply within {timeout_s:g} s", exit_code=1) from None
        raise UserError(f"cannot read {url}: {type(exc).__name__}: {exc}", exit_code=1) from None
    finally:
        deadline.cancel()
        connection.close()
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        raise UserError(f"cannot read {url}: the reply is not JSON", exit_code=1) from None
    if not isinstance(reply, dict):
        raise UserError(f"cannot read {url}: the reply is a JSON {type(reply).__name__}, not an object", exit_code=1)
    return reply


def _exchange(connection: http.client.HTTPConnection, parts: urllib.parse.SplitResult, body: dict[str, Any] | None,
              max_bytes: int, url: str, deadline: _Deadline) -> bytes:
    """The body of a 200 reply, at most `max_bytes` of it read."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    payload = None if body is None else json.dumps(body).encode()
    connection.connect()
    if deadline.passed:  # it passed while connecting: no socket was there to shut down
        raise TimeoutError
    connection.request("GET" if body is None else "POST", target, body=payload,
                       headers={"Content-Type": "application/json", "Accept": "application/json"})
    response = connection.getresponse()
    if 300 <= response.status < 400:
        where = response.getheader("Location") or "nowhere"
        raise UserError(f"{url} answered HTTP {response.status}, a redirect to {where[:200]}: not followed (give "
                        "the server's own URL)", exit_code=1)
    if response.status != 200:
        raise UserError(f"cannot read {url}: HTTP {response.status} {response.reason[:100]}", exit_code=1)
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise UserError(f"cannot read {url}: its reply of {int(declared)} bytes is over the {max_bytes}-byte "
                        "limit", exit_code=1)
    data = response.read(max_bytes + 1)
    if deadline.passed:  # the read was cut short by the deadline
        raise TimeoutError
    if len(data) > max_bytes:
        raise UserError(f"cannot read {url}: its reply is over the {max_bytes}-byte limit", exit_code=1)
    if declared is not None and declared.strip().isdigit() and len(data) < int(declared):
        raise http.client.IncompleteRead(data, int(declared) - len(data))
    return data


class _Deadline:
    """Shuts the connection's socket down once `seconds` have passed, so that a read blocked on a slow server
    returns (the socket's own timeout bounds each read, not the whole reply)."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float) -> None:
        self.passed = False
        self._connection = connection
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.passed = True
        if (sock := self._connection.sock) is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()
