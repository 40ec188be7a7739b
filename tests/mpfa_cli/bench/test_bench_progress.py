"""`mpfa bench`'s progress in a pipe or a log: plain lines, and within a long step a line with the requests done at
most every PLAIN_EVERY_S, so a job's log shows it is alive during a minutes-long 128K repeat."""
from __future__ import annotations

import io

from rich.console import Console

from mpfa.mpfa_cli.bench import progress as progress_module
from mpfa.mpfa_cli.bench.progress import PLAIN_EVERY_S, BenchProgress


def _plain_progress(monkeypatch, verbose: bool = False) -> tuple[BenchProgress, io.StringIO, list[float]]:
    clock = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    return BenchProgress(console, steps=2, requests=10, verbose=verbose), out, clock


def test_a_long_step_prints_its_requests_at_most_every_interval(monkeypatch):
    progress, out, clock = _plain_progress(monkeypatch)
    with progress:
        progress.server("mpfa: server ready after 55 s")
        progress.step_started("mpfa 128K c=8 #1", 5)
        for seconds in (10, PLAIN_EVERY_S - 20, 30, 5):  # lines due after the 3rd request only (60 s since the last)
            clock[0] += seconds
            progress.request_done()
        clock[0] += 1
        progress.request_done()
        progress.step_done("mpfa 128K c=8 #1", "ok")
    lines = out.getvalue().splitlines()
    assert lines == ["mpfa: server ready after 55 s",
                     f"  mpfa 128K c=8 #1: requests 3/10, elapsed {10 + PLAIN_EVERY_S - 20 + 30:.0f} s",
                     f"[1/2] mpfa 128K c=8 #1: ok; requests 5/10, elapsed {PLAIN_EVERY_S + 26:.0f} s, ETA "
                     f"{(PLAIN_EVERY_S + 26) / 5 * 5:.0f} s"]
    assert "\x1b" not in out.getvalue()


def test_verbose_prints_every_request(monkeypatch):
    progress, out, clock = _plain_progress(monkeypatch, verbose=True)
    with progress:
        progress.step_started("fa3-fp8 32K c=1 #1", 3)
        for _ in range(3):
            clock[0] += 1
            progress.request_done()
    assert [line for line in out.getvalue().splitlines() if "requests" in line] == [
        f"  fa3-fp8 32K c=1 #1: requests {n}/10, elapsed {n} s" for n in (1, 2, 3)]
