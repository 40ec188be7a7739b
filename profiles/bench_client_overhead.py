"""How much latency the load client adds to TTFT and ITL with many concurrent streams.

The simulator runs in its own process with chunk tracing on: right before writing each SSE chunk it notes
`time.perf_counter()`. The client (`mpfa.cli.client.run_load`, unchanged) stamps each network read on
arrival. On Linux `perf_counter` is CLOCK_MONOTONIC, one clock for every process on the host, so for each
output token, lag = arrival - send is what the loopback path plus the client's event loop added before the
client saw that token. What that does to the metrics:

  TTFT  gains the first token's lag;
  ITL   gains the change in lag between consecutive tokens (a constant lag leaves every gap unchanged),
        reported as |lag_i - lag_(i-1)|.

The dispatch row (client dispatch stamp to the server handler's start) also holds the server's own queueing
(it parses requests while streaming to hundreds of others), so it only bounds the client's dispatch cost.

    python profiles/bench_client_overhead.py --streams 512 --requests 1024
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from mpfa.cli import client
from mpfa.cli.client import new_event_loop, run_load
from mpfa.cli.records import RequestRecord
from mpfa.cli.sim_server import prompt_digest
from mpfa.cli.workload import make_prompts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"simulator exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("simulator did not start")


def _per_token_arrivals(times: list[float], cumulative: list[int], tokens: int) -> np.ndarray:
    """For tokens 1..tokens: the time of the first chunk whose running count reaches it."""
    return np.asarray(times)[np.searchsorted(np.asarray(cumulative), np.arange(1, tokens + 1))]


def overheads(records: list[RequestRecord], prompts: list[list[int]], trace: dict) -> dict[str, np.ndarray]:
    """Seconds of client-side lag per metric, over all measured requests (see the module docstring)."""
    first, gap_error, lag_all, dispatch = [], [], [], []
    for record in records:
        if record.warmup or not record.ok:
            continue
        server = trace[prompt_digest(prompts[record.index])]
        sent_s, sent_count = zip(*server["sent"])
        n = record.output_tokens
        lag = (_per_token_arrivals(record.chunk_s, np.cumsum(record.chunk_tokens).tolist(), n)
               - _per_token_arrivals(list(sent_s), list(sent_count), n))
        first.append(lag[0])
        gap_error.extend(np.abs(np.diff(lag)))
        lag_all.extend(lag)
        dispatch.append(server["received_s"] - record.dispatch_s)
    return {"TTFT: first-token lag": np.array(first), "ITL: |change in lag|": np.array(gap_error),
            "any token: lag": np.array(lag_all), "dispatch -> server (upper bound)": np.array(dispatch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=512, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--backend", default="fa4-bf16")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulator time scale (1 = modelled H200)")
    parser.add_argument("--incremental", action="store_true", help="server streams only new ids per chunk")
    parser.add_argument("--plain-asyncio", action="store_true", help="client on asyncio's own loop, not uvloop")
    args = parser.parse_args()

    clock = time.get_clock_info("perf_counter").implementation
    if "CLOCK_MONOTONIC" not in clock:
        raise SystemExit(f"perf_counter is {clock}, not a host-wide clock; this measurement needs Linux")

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # The server runs on asyncio's own loop, whose transports send on write(); uvloop would batch the writes
    # of a loop iteration and send them after the stamps, which would count server time as client lag.
    code = (f"from aiohttp import web; from mpfa.cli.sim_server import build_app; "
            f"web.run_app(build_app({args.backend!r}, time_scale={args.time_scale}, trace_chunks=True, "
            f"incremental_streaming_output={args.incremental}), host='127.0.0.1', port={port}, print=None, "
            f"access_log=None)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    try:
        _wait_healthy(url, server)
        prompts = make_prompts(0, args.requests, args.input_len)
        started = time.perf_counter()
        loop_factory = asyncio.new_event_loop if args.plain_asyncio else new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            records = runner.run(run_load(url, prompts, args.output_len, concurrency=args.streams))
        wall = time.perf_counter() - started
        with urllib.request.urlopen(url + "/sim_trace", timeout=60) as response:
            trace = json.loads(response.read())
    finally:
        server.terminate()
        server.wait(timeout=10)

    failed = [r for r in records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    mode = "incremental" if args.incremental else "cumulative"
    loop = "asyncio" if args.plain_asyncio or client.uvloop is None else "uvloop"
    print(f"{args.requests} requests, {args.streams} concurrent streams, {args.input_len} in / {args.output_len} "
          f"out, sim {args.backend} x{args.time_scale}, {mode} output_ids, client loop {loop}, {wall:.1f} s wall")
    print(f"{'client-side overhead (ms)':34s} {'n':>7s} {'p50':>7s} {'p90':>7s} {'p99':>7s} {'max':>7s}")
    for name, values in overheads(records, prompts, trace).items():
        ms = values * 1e3
        print(f"{name:34s} {len(ms):7d} {np.percentile(ms, 50):7.3f} {np.percentile(ms, 90):7.3f} "
              f"{np.percentile(ms, 99):7.3f} {ms.max():7.3f}")


if __name__ == "__main__":
    main()
