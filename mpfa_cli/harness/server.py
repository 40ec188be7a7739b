"""Start a server as a child process group, wait until it serves, stream its log to a file, and stop all of it.

Used for both engines that launch a server: SGLang and the built-in simulator. The child runs in a new
session (its own process group) so that stopping it also stops whatever it spawned (SGLang's scheduler and
detokenizer processes); descendants that left the group are found with psutil and killed too. Its log is owner-only
(0600, in a folder created 0700) and never written through a symbolic link.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import sys
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from ..errors import UserError
from .safe_files import append_private, private_dir

LOG_TAIL_LINES = 30
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # held back while a server is being stopped
PR_SET_PDEATHSIG = 1


class ServerError(UserError):
    """The server could not be started or died; the message carries the last lines of its log."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) != 0


def pick_port(preferred: int | None = None, host: str = "127.0.0.1", highest: int = 65535) -> int:
    """The preferred port when it is free (and at most ``highest``), otherwise one the OS hands out, or, when the
    OS's is above ``highest``, the first free one from 30000 up."""
    if preferred is not None and preferred <= highest and port_free(preferred, host):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    if port <= highest:
        return port
    free = next((p for p in range(30000, highest + 1) if port_free(p, host)), None)
    if free is None:
        raise UserError(f"no free port at or below {highest} on {host}")
    return free


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """A launched server. Use as a context manager: it is always stopped on exit, error or Ctrl-C."""

    def __init__(self, command: list[str], log_path: Path, url: str, env: dict[str, str] | None = None) -> None:
        self.command = command
        self.log_path = log_path
        self.url = url
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stop the server; a second Ctrl-C (or SIGTERM, SIGHUP) meanwhile waits until it is stopped."""
        with stop_signals_held():
            self.stop()

    def start(self) -> None:
        private_dir(self.log_path.parent, "server log")
        log = append_private(self.log_path, "server log")
        try:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True, preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise ServerError(f"could not start server ({self.command[0]}): {exc}") from None
        finally:
            log.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float, on_tick: Callable[[float], None] | None = None) -> float:
        """Poll `/health_generate` until it answers 200; returns the seconds it took."""
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if not self.alive:
                code = self.process.returncode if self.process else None
                raise ServerError(
                    f"server exited with code {code} before it was ready; last log lines "
                    f"({self.log_path}):\n{self.log_tail()}"
                )
            if http_ok(f"{self.url}/health_generate", timeout=min(5.0, max(timeout_s - elapsed, 0.5))):
                return elapsed
            if elapsed > timeout_s:
                tail = self.log_tail()
                self.stop()
                raise ServerError(
                    f"server not ready after {timeout_s:.0f} s; last log lines ({self.log_path}):\n{tail}"
                )
            if on_tick:
                on_tick(elapsed)
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group and every descendant, SIGKILL what is left after `grace_s`."""
        if self.process is None:
            return
        try:
            procs = [psutil.Process(self.process.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        _signal_group(self.process.pid, signal.SIGTERM)
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        _signal_group(self.process.pid, signal.SIGKILL)
        for proc in alive:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        self.process.poll()


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP arriving in the block are delivered after it: cleanup is not cut short."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _die_with_parent() -> None:
    """In the child, before it runs the server (Linux): SIGKILL it when the bench dies, even by SIGKILL."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
