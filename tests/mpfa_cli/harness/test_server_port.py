"""Port choice for launched servers: the preferred port when free, another otherwise, never above a ceiling (SGLang
0.5.15 refuses an HTTP port whose gRPC twin, port + 10000, passes 65535)."""
from __future__ import annotations

import socket

from mpfa.mpfa_cli.harness.engines import SGLANG_HIGHEST_PORT
from mpfa.mpfa_cli.harness.server import pick_port, port_free


def test_ceiling_below_the_os_range_gives_a_free_port_under_it() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        os_low = sock.getsockname()[1]  # the OS's ephemeral ports start above 30000 on Linux
    ceiling = min(os_low - 1, 32000)
    port = pick_port(highest=ceiling)
    assert 30000 <= port <= ceiling and port_free(port)


def test_preferred_port_above_the_ceiling_is_not_used() -> None:
    port = pick_port(preferred=SGLANG_HIGHEST_PORT + 5000, highest=SGLANG_HIGHEST_PORT)
    assert port <= SGLANG_HIGHEST_PORT and port_free(port)


def test_busy_preferred_port_is_replaced() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        port = pick_port(preferred=taken)
        assert port != taken and port_free(port)
