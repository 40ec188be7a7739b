"""Once the bench is interrupted, further stop signals are swallowed without a word: blocked, so a signal sent later
stays pending (and would end with the process, whose exit resets Python's handlers), and handled by a no-op where one
was already caught, never by SIG_IGN, with which Python prints "Signal 2 ignored due to race condition" and a
traceback (seen once in `test_two_quick_ctrl_cs_leave_no_server_and_no_running_run` under load)."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from mpfa.mpfa_cli.bench import runner as bench
from mpfa.mpfa_cli.harness.server import STOP_SIGNALS

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signal masks")


@pytest.fixture
def restored_signals():
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    for sig in handlers:
        signal.signal(sig, bench._stopping)  # a pending signal, delivered by the unblock below, runs the no-op
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_stop_signals_after_an_interruption_are_blocked_and_handled_by_a_no_op(restored_signals, capfd):
    bench._ignore_stop_signals()
    assert set(STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert all(signal.getsignal(sig) is bench._stopping for sig in STOP_SIGNALS)
    for sig in STOP_SIGNALS:
        signal.raise_signal(sig)  # to this thread, which blocks it: pending, not delivered
    assert set(STOP_SIGNALS) <= signal.sigpending()
    for sig in STOP_SIGNALS:
        os.kill(os.getpid(), sig)  # to the process: another thread may take it, the no-op then runs here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # delivered now, as if caught before the block
    assert not signal.sigpending() & set(STOP_SIGNALS)
    out, err = capfd.readouterr()
    assert "race condition" not in err and "Traceback" not in err and not out
