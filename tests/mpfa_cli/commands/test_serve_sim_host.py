"""`mpfa serve-sim` off loopback says on stderr that it is reachable from other machines; on loopback it says
nothing of the kind."""
from __future__ import annotations

import socket

import pytest

from mpfa.mpfa_cli.harness.server import is_loopback


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.0.2.7", False), ("myhost.example", False),
])
def test_which_hosts_are_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_serve_sim_warns_when_it_binds_beyond_loopback(mpfa, host, warned):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = mpfa.popen("serve-sim", "--host", host, "--port", str(port))
    try:
        first = server.stdout.readline()  # the server's own line: it is up
        assert "serve-sim: SIMULATED" in first
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=10)
    warning = f"warning: serving on {host}, reachable from other machines (--host 127.0.0.1 keeps it on this one)"
    assert (warning in stderr) is warned and "Traceback" not in stderr
