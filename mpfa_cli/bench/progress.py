"""One overall progress display for `mpfa bench`: steps (points x backends x repeats), requests done, ETA and
what the current server is doing. On a terminal it is a live bar (with `verbose`, one more bar per step counting
its requests); in a pipe or a log it is plain text, one line per server state and per finished step, no control
codes: each server state, each finished step, and within a step the requests done at most every
`PLAIN_EVERY_S` (every request with `verbose`)."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

PLAIN_EVERY_S = 60.0  # a 128K step at c=8 runs for minutes: a line this often shows it is alive


class BenchProgress:
    """Counts steps and requests; `live` draws them on a terminal, otherwise each change worth a line is printed."""

    def __init__(self, console: Console, steps: int, requests: int, verbose: bool = False) -> None:
        self.console = console
        self.steps, self.requests = steps, requests
        self.verbose = verbose
        self.steps_done = self.requests_done = 0
        self.state = "starting"
        self.started = self._printed_at = time.monotonic()
        self.live = console.is_terminal
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("requests"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                             console=console, transient=False, disable=not self.live)
        self._overall = self._bar.add_task(self._description(), total=requests)
        self._step: TaskID | None = None

    def __enter__(self) -> "BenchProgress":
        self._bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._bar.stop()

    def _description(self) -> str:
        return f"step {min(self.steps_done + 1, self.steps)}/{self.steps} · {self.state}"

    def _eta(self) -> str:
        if not self.requests_done:
            return "—"
        return f"{self._elapsed() / self.requests_done * (self.requests - self.requests_done):.0f} s"

    def server(self, state: str) -> None:
        """What the current server is doing, e.g. 'mpfa: starting server'."""
        self.state = state
        self._bar.update(self._overall, description=self._description())
        if not self.live:
            self._print(state)

    def _print(self, line: str) -> None:
        self.console.print(line, highlight=False)
        self._printed_at = time.monotonic()

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def tick(self) -> None:
        self._bar.refresh()

    def step_started(self, label: str, requests: int) -> None:
        self.state = label
        self._bar.update(self._overall, description=self._description())
        if self.verbose and self.live:
            self._step = self._bar.add_task(f"  {label}", total=requests)

    def request_done(self) -> None:
        self.requests_done += 1
        self._bar.advance(self._overall)
        if self._step is not None:
            self._bar.advance(self._step)
        elif not self.live and (self.verbose or time.monotonic() - self._printed_at >= PLAIN_EVERY_S):
            self._print(f"  {self.state}: requests {self.requests_done}/{self.requests}, "
                        f"elapsed {self._elapsed():.0f} s")

    def step_done(self, label: str, outcome: str) -> None:
        self.steps_done += 1
        if self._step is not None:
            self._bar.update(self._step, description=f"  {label} [{outcome}]")
            self._step = None
        self._bar.update(self._overall, description=self._description())
        if not self.live:
            self._print(f"[{self.steps_done}/{self.steps}] {label}: {outcome}; requests "
                        f"{self.requests_done}/{self.requests}, elapsed {self._elapsed():.0f} s, ETA {self._eta()}")


class ServerBar(Progress):
    """A plain rich progress display that also shows the server's state as `served` reports it, one line per
    server (for commands other than `bench` that add their own tasks). In a pipe or a log, where a live display
    would print nothing until it stops, it prints each server state and each finished task as a line instead."""

    def __init__(self, console: Console) -> None:
        self.plain = not console.is_terminal
        super().__init__(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         console=console, transient=False, disable=self.plain)
        self._server: TaskID | None = None

    def server(self, state: str) -> None:
        if self.plain:
            self.console.print(state, highlight=False)
        if self._server is None:
            self._server = self.add_task(state, total=None)
        else:
            self.update(self._server, description=state, total=1, completed=1)
            self._server = None

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        task = self._tasks[task_id]
        if self.plain and task.finished and task.total is not None and task.completed - advance < task.total:
            self.console.print(f"{task.description}: {task.completed:.0f}/{task.total:.0f} in "
                               f"{task.finished_time or 0:.0f} s", highlight=False)

    def tick(self) -> None:
        self.refresh()
