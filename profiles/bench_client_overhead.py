"""How much time the load client adds to the TTFT and ITL it measures, with many concurrent streams.

The simulator runs in its own process on asyncio's own event loop, with chunk tracing on: around the write
of each SSE chunk it notes `time.perf_counter()` before and after. That loop's write is the `send()` itself,
and on loopback `send()` returns with the bytes already in the receiving socket, so the "after" stamp is
when the chunk became readable by the client. The client (`mpfa.mpfa_cli.harness.client.run_load`, unchanged) stamps
each socket read on arrival. On Linux `perf_counter` is CLOCK_MONOTONIC, one clock for every process on the
host, so per output token:

  client lag      = client stamp - sim stamp after the send: bytes waiting in the client's socket until the
                    client noted them. This is the error the client's timestamps carry.
  end-to-end lag  = client stamp - sim stamp before the send: the above plus the simulator's send syscall.

What that does to the metrics: TTFT gains the first token's lag; ITL gains the change in lag between
consecutive tokens (a constant lag leaves every gap unchanged), reported as |lag_i - lag_(i-1)|.

Client lag also holds what the host adds: waking the client's process and scheduling it. `--reference`
runs the same workload through a minimal reader (raw uvloop protocol: stamp, keep the bytes, nothing else)
to measure that floor on the machine at hand; whatever the reference shows is not the client's doing.
`--realtime` runs both processes under SCHED_FIFO, so other work on the host cannot delay them (needs
CAP_SYS_NICE; the kernel still caps real-time tasks at 95% of each second by default).

Dispatch: the client stamps a request right before writing it to the socket; "dispatch -> sim handler" runs
from there to the simulator's handler starting, so it also holds the simulator's own queueing (it parses
requests while streaming to hundreds of others) and only bounds the client's part. "refill delay" is what
the closed loop adds: the i-th completion to the (streams + i)-th dispatch, both in time order.

Issue 29's targets at 512 streams (`TARGETS_P99_MS`): the client adds under 1 ms p99 to TTFT (first-token client
lag) and refills a freed slot within 5 ms p99; each run's table is followed by whether they were met.
`tests/mpfa_cli/harness/test_client_load.py` (marked slow) checks them.

    mpfa profile client-overhead --streams 512 --requests 1024 --runs 3 --reference --realtime
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import orjson

from ..backends.specs import BACKENDS
from ..mpfa_cli.errors import UserError
from ..mpfa_cli.harness import client
from ..mpfa_cli.harness.client import new_event_loop, run_load
from ..mpfa_cli.harness.serving_workload import make_prompts
from ..mpfa_cli.harness.sim_server import prompt_digest

PERCENTILES = (50, 90, 99)
REALTIME_PRIORITY = 50
TTFT_LAG = "TTFT: first-token client lag"
REFILL = "refill delay (closed loop)"
TARGETS_P99_MS = {TTFT_LAG: 1.0, REFILL: 5.0}


@dataclass(frozen=True)
class OverheadOptions:
    """One measurement: the load, the simulator it runs against and how the two processes are scheduled."""

    streams: int = 512  # concurrent streams
    requests: int = 1024
    input_len: int = 256
    output_len: int = 64
    backend: str = "fa4-bf16"  # whose latency model the simulator serves
    time_scale: float = 1.0  # the simulator's (1: the modelled H200)
    incremental: bool = False  # the simulator streams only the new ids per chunk
    plain_asyncio: bool = False  # the client on asyncio's own loop, not uvloop
    runs: int = 1  # repeats of the whole measurement on fresh simulators
    reference: bool = False  # also run the minimal reference reader
    realtime: bool = False  # client and simulator under SCHED_FIFO

    def __post_init__(self) -> None:
        for name in ("streams", "requests", "input_len", "output_len", "runs"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.requests < self.streams:
            raise UserError(f"--requests ({self.requests}) must be at least --streams ({self.streams})")
        if not self.time_scale > 0:
            raise UserError(f"--time-scale must be > 0, got {self.time_scale}")
        if self.backend not in BACKENDS:
            raise UserError(f"unknown backend '{self.backend}'; valid: {', '.join(BACKENDS)}")


@dataclass
class Stream:
    """What a client saw of one measured request: when each event carrying tokens arrived."""

    index: int
    dispatch_s: float
    completion_s: float
    event_s: list[float]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"simulator exited with code {process.returncode}", exit_code=1)
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise UserError("simulator did not start", exit_code=1)


def _set_realtime(pid: int) -> None:
    try:
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except PermissionError:
        raise UserError("--realtime needs permission to set SCHED_FIFO (root or CAP_SYS_NICE)") from None


@contextlib.contextmanager
def realtime() -> Iterator[None]:
    """This process under SCHED_FIFO for the block, then back to the scheduling it had."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    _set_realtime(0)
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)


def _start_sim(options: OverheadOptions, port: int) -> subprocess.Popen:
    # asyncio's own loop: its transports send on write(), while uvloop batches the writes of a loop iteration
    # and sends them after the "after" stamps, which would count simulator time as client lag.
    code = (f"from aiohttp import web; from mpfa.mpfa_cli.harness.sim_server import build_app; "
            f"web.run_app(build_app({options.backend!r}, time_scale={options.time_scale}, trace_chunks=True, "
            f"incremental_streaming_output={options.incremental}), host='127.0.0.1', port={port}, print=None, "
            f"access_log=None)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    if options.realtime:
        _set_realtime(process.pid)
    return process


async def _mpfa_client(url: str, prompts: list[list[int]], output_len: int, streams: int) -> list[Stream]:
    records = await run_load(url, prompts, output_len, concurrency=streams)
    failed = [r for r in records if not r.ok]
    if failed:
        raise UserError(f"{len(failed)} requests failed, e.g. {failed[0].error}", exit_code=1)
    return [Stream(r.index, r.dispatch_s, r.completion_s, r.chunk_s) for r in records]


class _ReferenceConnection(asyncio.Protocol):
    """One keep-alive connection of the reference reader: stamps each read, keeps the bytes, and recognises
    the end of a chunked response (the simulator's SSE bodies cannot end in the terminating chunk)."""

    def __init__(self) -> None:
        self.reads: list[tuple[float, bytes]] = []
        self.tail = b""  # the last bytes received, to see a terminating chunk split across reads
        self.ended: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.perf_counter(), data))
        self.tail = (self.tail + data)[-7:]
        if self.tail == b"\r\n0\r\n\r\n" and self.ended is not None:
            self.ended.set_result(None)


def _event_ends(reads: list[tuple[float, bytes]]) -> list[float]:
    """The stamp of the read that completed each SSE event with tokens (every one but `[DONE]`)."""
    body = b"".join(data for _, data in reads)
    offsets = np.cumsum([len(data) for _, data in reads])
    stamps, start = [], body.find(b"data: ")
    while (end := body.find(b"\n\n", start)) >= 0:
        if not body.startswith(b"data: [DONE]", start):
            stamps.append(reads[int(np.searchsorted(offsets, end + 2))][0])
        start = body.find(b"data: ", end)
        if start < 0:
            break
    return stamps


async def _reference_client(url: str, prompts: list[list[int]], output_len: int, streams: int) -> list[Stream]:
    """Closed loop over `streams` keep-alive connections; the reads are only sorted into events afterwards."""
    loop = asyncio.get_running_loop()
    host, port = url.removeprefix("http://").split(":")
    jobs, finished = iter(enumerate(prompts)), []

    async def worker() -> None:
        _, connection = await loop.create_connection(_ReferenceConnection, host, int(port))
        for index, prompt in jobs:
            body = orjson.dumps({"input_ids": prompt, "stream": True,
                                 "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True}})
            request = (b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
            connection.reads, connection.ended = [], loop.create_future()
            dispatch = time.perf_counter()
            connection.transport.write(request)
            await connection.ended
            finished.append((index, dispatch, connection.reads))
        connection.transport.close()

    gc.disable()  # as run_load does: a collection would stall the loop
    try:
        await asyncio.gather(*(worker() for _ in range(min(streams, len(prompts)))))
    finally:
        gc.enable()
    return [Stream(index, dispatch, reads[-1][0], _event_ends(reads)) for index, dispatch, reads in finished]


CLIENTS = {"mpfa": _mpfa_client, "reference": _reference_client}


def _per_token(times: np.ndarray, cumulative: np.ndarray, tokens: int) -> np.ndarray:
    """For tokens 1..tokens: the time of the first chunk whose running count reaches it."""
    return times[np.searchsorted(cumulative, np.arange(1, tokens + 1))]


def overheads(streams: list[Stream], prompts: list[list[int]], trace: dict, concurrency: int
              ) -> dict[str, np.ndarray]:
    """Seconds per measured request or token, by row of the report (see the module docstring)."""
    rows: dict[str, list[float]] = {name: [] for name in (
        "TTFT: first-token client lag", "ITL: |change in client lag|", "any token: client lag",
        "TTFT: first-token end-to-end lag", "ITL: |change in end-to-end lag|", "sim send (write syscall)",
        "dispatch -> sim handler (bound)")}
    for stream in streams:
        server = trace[prompt_digest(prompts[stream.index])]
        before, after, count = (np.asarray(column) for column in zip(*server["sent"]))
        if len(stream.event_s) != len(count):
            raise UserError(f"request {stream.index}: the client saw {len(stream.event_s)} chunks with tokens, "
                            f"the simulator sent {len(count)}", exit_code=1)
        n = int(count[-1])
        arrived = _per_token(np.asarray(stream.event_s), count, n)
        lag = arrived - _per_token(after, count, n)
        e2e = arrived - _per_token(before, count, n)
        rows["TTFT: first-token client lag"].append(lag[0])
        rows["ITL: |change in client lag|"].extend(np.abs(np.diff(lag)))
        rows["any token: client lag"].extend(lag)
        rows["TTFT: first-token end-to-end lag"].append(e2e[0])
        rows["ITL: |change in end-to-end lag|"].extend(np.abs(np.diff(e2e)))
        rows["sim send (write syscall)"].extend(after - before)
        rows["dispatch -> sim handler (bound)"].append(server["received_s"] - stream.dispatch_s)
    completions = np.sort([s.completion_s for s in streams])
    dispatches = np.sort([s.dispatch_s for s in streams])
    refills = dispatches[concurrency:] - completions[:len(dispatches) - concurrency]
    return {**{name: np.asarray(values) for name, values in rows.items()}, REFILL: refills}


def p99_ms(values: np.ndarray) -> float:
    return float(np.percentile(values, 99) * 1e3)


def targets_line(rows: dict[str, np.ndarray]) -> str:
    """Whether the run met each of `TARGETS_P99_MS`."""
    return "targets: " + "; ".join(
        f"{name} p99 {p99_ms(rows[name]):.3f} ms < {target:g} ms: {'met' if p99_ms(rows[name]) < target else 'MISSED'}"
        for name, target in TARGETS_P99_MS.items())


def measure(options: OverheadOptions, kind: str) -> tuple[dict[str, np.ndarray], str]:
    """One run of one client against a fresh simulator: the overhead rows and a line about the run."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start_sim(options, port)
    try:
        _wait_healthy(url, server)
        prompts = make_prompts(0, options.requests, options.input_len)
        load_before = os.getloadavg()[0]
        cpu_before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        loop_factory = asyncio.new_event_loop if options.plain_asyncio else new_event_loop
        gc.collect()
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            streams = runner.run(CLIENTS[kind](url, prompts, options.output_len, options.streams))
        wall = time.perf_counter() - started
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        with urllib.request.urlopen(url + "/sim_trace", timeout=60) as response:
            trace = json.loads(response.read())
    finally:
        server.terminate()
        server.wait(timeout=10)
    cpu = cpu_after.ru_utime - cpu_before.ru_utime + cpu_after.ru_stime - cpu_before.ru_stime
    chunks = sum(len(s.event_s) for s in streams)
    note = (f"{wall:.1f} s wall, client CPU {cpu:.2f} s = {cpu / chunks * 1e6:.1f} us per chunk "
            f"(requests included), load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    return overheads(streams, prompts, trace, options.streams), note


def _print_table(rows: dict[str, np.ndarray]) -> None:
    print(f"{'overhead (ms)':34s} {'n':>7s}" + "".join(f" {f'p{p}':>7s}" for p in PERCENTILES) + f" {'max':>7s}")
    for name, values in rows.items():
        ms = values * 1e3
        print(f"{name:34s} {len(ms):7d}" + "".join(f" {np.percentile(ms, p):7.3f}" for p in PERCENTILES)
              + f" {ms.max():7.3f}")


def report(options: OverheadOptions) -> None:
    """Every run's table (and the targets), then the p99s over runs, on stdout."""
    clock = time.get_clock_info("perf_counter").implementation
    if "CLOCK_MONOTONIC" not in clock:
        raise UserError(f"perf_counter is {clock}, not a host-wide clock; this measurement needs Linux")
    with realtime() if options.realtime else contextlib.nullcontext():
        _report(options)


def _report(options: OverheadOptions) -> None:
    mode = "incremental" if options.incremental else "cumulative"
    loop = "asyncio" if options.plain_asyncio or client.uvloop is None else "uvloop"
    o = options
    print(f"{o.requests} requests, {o.streams} concurrent streams, {o.input_len} in / {o.output_len} out, "
          f"sim {o.backend} x{o.time_scale}, {mode} output_ids, client loop {loop}, {os.cpu_count()} CPUs, "
          f"{'SCHED_FIFO' if o.realtime else 'default scheduling'}")
    kinds = ["mpfa", "reference"] if options.reference else ["mpfa"]
    p99s: dict[tuple[str, str], list[float]] = {}
    for run in range(options.runs):
        for kind in kinds:
            rows, note = measure(options, kind)
            print(f"\nrun {run + 1}, {kind} client: {note}")
            _print_table(rows)
            if kind == "mpfa":
                print(targets_line(rows))
            for name, values in rows.items():
                p99s.setdefault((kind, name), []).append(p99_ms(values))
    if options.runs > 1:
        print(f"\np99 (ms) over {options.runs} runs: best / median / worst")
        for (kind, name), values in p99s.items():
            print(f"{kind:9s} {name:34s} {min(values):7.3f} / {np.median(values):7.3f} / {max(values):7.3f}")

