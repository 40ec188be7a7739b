"""The scheduling that keeps the client's own work from delaying the stamps of socket reads.

Reads are stamped when the event loop polls its sockets, between iterations, and an iteration runs every callback
that was ready when it began. The client's steps other than sending (parsing a finished stream, ~0.1-0.3 ms; the
caller's per-record callback) each take a turn (`Turns.take`): one step per iteration, and only when the sockets
are quiet. Sends take no turn: a freed slot's next request goes out in the iteration its response ended (one
write, ~10 us).
"""
from __future__ import annotations

import asyncio
import collections
import time

from .stamped_reads import LastRead

QUIET_S = 100e-6  # sockets without a read for this long are quiet
RECHECK_S = 1e-3  # how soon a turn looks again at sockets that were not quiet
MAX_TURN_DEFERRAL_S = 20e-3  # longest a step waits for quiet sockets


class Turns:
    """Runs the client's steps one at a time, each in its own event-loop iteration, first come, first served.
    A turn is handed on when no read has arrived for QUIET_S, else looked at again RECHECK_S later (a timer, not
    a busy loop), and given anyway to a step that has waited MAX_TURN_DEFERRAL_S, so that a client whose sockets
    never go quiet still makes progress."""

    def __init__(self, last_read: LastRead) -> None:
        self._last_read = last_read
        self._waiting: collections.deque[tuple[asyncio.Future[None], float]] = collections.deque()
        self._handing_on = False
        self._loop = asyncio.get_running_loop()

    async def take(self) -> None:
        """Return at this task's turn; the step that follows should not await before its work is done. A
        cancelled task loses its turn."""
        waiter = self._loop.create_future()
        self._waiting.append((waiter, time.perf_counter()))
        if not self._handing_on:
            self._handing_on = True
            self._loop.call_soon(self._hand_on)
        await waiter

    def _hand_on(self) -> None:
        waiting = self._waiting
        while waiting and waiting[0][0].done():
            waiting.popleft()
        if not waiting:
            self._handing_on = False
            return
        now = time.perf_counter()
        waiter, since = waiting[0]
        if now - self._last_read.at_s < QUIET_S and now - since < MAX_TURN_DEFERRAL_S:
            self._loop.call_later(RECHECK_S, self._hand_on)
            return
        waiting.popleft()
        waiter.set_result(None)  # its task runs in the next iteration; the next turn is looked for after it
        self._loop.call_soon(self._hand_on)
