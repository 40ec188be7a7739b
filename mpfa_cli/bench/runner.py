"""`mpfa bench`: for each backend, get a server, confirm what it runs, and measure every load point x repeat.

Each run records the attention kernels its server ran (`served_kernels`): what the server reports (the simulator
says what it simulates), else what the backend runs for the model's shape with the user's prefill kernel, which
MpFA's servers are given as a server argument.
Every finished request is written to the store as it completes, so a server crash or Ctrl-C loses only the
requests in flight; the run is then marked failed or interrupted.

On the simulator, unless `real_time`, requests are timed on the latency model's clock: before each repeat the
server is told how the load arrives (`sim_server.LoadHint`), so it runs as fast as `time_scale` lets it and each
request still joins the same batch step; every finished request's arrival and token times are then read from the
server in modelled seconds. The stored numbers are the same at any speed-up.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from ...backends.specs import BackendSpec
from ..harness import client, serving_workload
from ..results.metrics.summary import summarize
from ..harness.engines import READY_TIMEOUT_S, SGLANG_HIGHEST_PORT, gpu_label, model_name, sglang_launch, sim_launch
from ..harness.environment import collect_environment
from ..errors import UserError
from ..harness.latency_model import LatencyModel, point_seconds
from .progress import BenchProgress, ServerBar
from ..harness.records import RequestRecord, RunRecord
from ..reports.tables import CAVEAT_MARK
from ..harness.scenario import LoadPoint, Scenario, is_bundled_model, load_model_shape, without_bundled_model_paths
from ..harness.served_kernels import kernel_server_args, launch_page_size, served_kernels
from ..harness.sim_server import prompt_digest
from ..harness.server import STOP_SIGNALS, ServerError, ServerProcess, pick_port, stop_signals_held
from ..results.store import ResultStore


@dataclass
class BenchOptions:
    engine: str  # sim | sglang | url
    run_dir: Path
    url: str | None = None
    api: str = "sglang"
    port: int | None = None
    time_scale: float = 1.0
    real_time: bool = False  # simulator: time requests on the client's clock, not the latency model's
    ready_timeout_s: float | None = None
    tp: int = 1
    dp: int = 1
    server_args: list[str] = field(default_factory=list)
    slo: dict[str, float] | None = None
    prefill_kernel: str | None = None  # MpFA's prefill kernel (`dispatch.PREFILL_KERNELS`); None: the shape's default
    verbose: bool = False  # progress: a line or bar per step's requests, not only the overall one
    timeouts: client.Timeouts = field(default_factory=client.Timeouts)  # per request: a stalled server fails it
    labelled: bool = False  # --url: the backend names were given as labels, not checked against the server

    @property
    def modelled_clock(self) -> bool:
        """Requests are timed on the simulator's latency model, not on the client's clock."""
        return self.engine == "sim" and not self.real_time

    def server_args_for(self, spec: BackendSpec) -> list[str]:
        """The extra server flags of ``spec``'s server: the user's, and the prefill kernel for MpFA's."""
        return [*kernel_server_args(spec, self.prefill_kernel), *self.server_args]


# For `estimated_seconds`: the simulator's cost per prompt token sent (serialized, parsed, hashed) on a 2-core CPU,
# and how long a server takes to get ready.
SIM_SECONDS_PER_PROMPT_TOKEN = 0.3e-6
SERVER_START_S = {"sim": 1.5, "sglang": 90.0}


class RunInterrupted(Exception):
    """Ctrl-C (or SIGTERM, SIGHUP) during a run; the partial run is saved under `run_id`."""

    def __init__(self, run_id: int | None) -> None:
        super().__init__(f"interrupted; partial results saved (run {run_id})" if run_id else "interrupted")
        self.run_id = run_id


INTERRUPTING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # handled as Ctrl-C is, their name the reason
_received: list[str] = []  # the names of those received while the bench runs, oldest first


def _interrupt(signum: int, frame: Any) -> None:
    """Deliver SIGTERM or SIGHUP as a Ctrl-C. While the client's event loop runs, its Ctrl-C handler cancels the
    load (`client.run`); a KeyboardInterrupt raised here could land inside an event-loop callback instead, which
    the loop takes for a broken connection."""
    _received.append(signal.Signals(signum).name)
    signal.raise_signal(signal.SIGINT)


def _interruption() -> str:
    """What interrupted the bench: the first signal delivered as a Ctrl-C, else Ctrl-C itself."""
    return _received[0] if _received else "Ctrl-C"


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP interrupt the bench as Ctrl-C does (their name the reason) for as long as it runs."""
    _received.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in INTERRUPTING_SIGNALS}
    try:
        yield
    except (KeyboardInterrupt, RunInterrupted):
        _ignore_stop_signals()
        raise
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is _interrupt:
                signal.signal(sig, handler)


def _ignore_stop_signals() -> None:
    """Once interrupted, the bench is stopping: further SIGINT, SIGTERM and SIGHUP are ignored until the process
    exits; the cleanup before is bounded (`ServerProcess.stop`). The main thread blocks them, so one sent to it
    later stays pending and ends with the process (Python resets handlers to the default action as it exits), and
    any caught meanwhile, here or by another thread, runs a no-op handler. Not SIG_IGN: a signal caught a moment
    before the switch is then reported by Python as "ignored due to race condition", with a traceback. A handler
    run while the no-op is being set raises at most one KeyboardInterrupt per signal caught: the interruption
    already being handled."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for sig in STOP_SIGNALS:
        for _ in range(len(STOP_SIGNALS) + 1):
            try:
                signal.signal(sig, _stopping)
                break
            except KeyboardInterrupt:
                continue


def _stopping(signum: int, frame: Any) -> None:
    """The handler of a stop signal caught as the bench stops: nothing to do, it is stopping."""


def _get_json(url: str, timeout: float = 10.0) -> dict[str, Any]:
    return _post_json(url, None, timeout)


def _post_json(url: str, body: dict[str, Any] | None, timeout: float = 10.0) -> dict[str, Any]:
    """The JSON answer to a GET, or to a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise UserError(f"could not read {url}: {exc}", exit_code=1) from None


def _find_key(tree: Any, key: str) -> Any:
    """First value stored under `key` anywhere in nested dicts/lists (SGLang nests some server state)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            if (found := _find_key(item, key)) is not None:
                return found
    return None


def verify_server(info: dict[str, Any], spec: BackendSpec, must_report: bool = False) -> None:
    """Refuse to measure a server that runs something other than what the backend spec asked for (or, when
    `must_report`, one that does not say what it runs)."""
    reported = {key: _find_key(info, key) for key in spec.expect}
    for key, want in spec.expect.items():
        got = reported[key]
        if got is not None and str(got) != want:
            raise UserError(f"server reports {key}={got}, but backend '{spec.name}' asks for {want}", exit_code=1)
    if must_report and all(got is None for got in reported.values()):
        raise UserError(f"the server reports no {', '.join(spec.expect)} to check backend '{spec.name}' against; "
                        f"name it with --backend-label {spec.name} to store its runs under that name unchecked",
                        exit_code=1)


def verify_weights(info: dict[str, Any], model: str) -> None:
    """Refuse a server whose weights are not the ones `model` means: SGLang's dummy weights for a bundled config
    name, the checkpoint's own for a directory (a dummy-weight server would make a logits check vacuous)."""
    got = _find_key(info, "load_format")
    if got is None:
        return
    bundled = is_bundled_model(model)
    if bundled != (str(got) == "dummy"):
        want = "dummy weights" if bundled else f"the weights in {model}"
        raise UserError(f"server reports load_format={got}, but model '{model}' means {want}", exit_code=1)


@contextmanager
def served(
    spec: BackendSpec, model: str, context_len: int, opts: BenchOptions, progress: BenchProgress | ServerBar
) -> Iterator[tuple[str, dict[str, Any], ServerProcess | None]]:
    """A ready server for `spec` (launched, or the one at --url): yields its URL, server info and process. A
    server whose `/get_server_info` contradicts the backend is refused."""
    if opts.engine == "url":
        url = opts.url.rstrip("/")
        info = _get_json(f"{url}/get_server_info")
        if not opts.labelled:
            verify_server(info, spec, must_report=True)
        yield url, info, None
        return
    port = pick_port(opts.port, highest=65535 if opts.engine == "sim" else SGLANG_HIGHEST_PORT)
    if opts.engine == "sim":
        launch = sim_launch(spec, port, opts.time_scale, model, opts.server_args_for(spec))
    else:
        launch = sglang_launch(spec, port, model, context_len, opts.tp, opts.dp, opts.server_args_for(spec))
    url = f"http://127.0.0.1:{port}"
    log = opts.run_dir / f"server-{spec.name}-{int(time.time())}.log"
    with ServerProcess(launch.command, log, url, launch.env) as server:
        progress.server(f"{spec.name}: starting server")
        timeout = opts.ready_timeout_s or READY_TIMEOUT_S[opts.engine]
        took = server.wait_ready(timeout, on_tick=lambda _: progress.tick())
        progress.server(f"{spec.name}: server ready after {took:.0f} s")
        info = _get_json(f"{url}/get_server_info")
        verify_server(info, spec)
        if opts.engine != "sim":  # the simulator loads no weights
            verify_weights(info, model)
        yield url, info, server


def run_bench(
    scenario: Scenario, specs: list[BackendSpec], opts: BenchOptions, store: ResultStore, console: Console
) -> list[int]:
    """Measure every backend; returns the ids of the runs it stored."""
    shape = load_model_shape(scenario.model)
    # The heads of one tensor-parallel rank (SGLang replicates KV heads over ranks beyond their count). A prefill
    # kernel that shape does not take fails here, before any server starts.
    q_heads, kv_heads = shape.q_heads // opts.tp, max(1, shape.kv_heads // opts.tp)
    expected = {spec.name: served_kernels(spec, q_heads, kv_heads, launch_page_size(spec), opts.prefill_kernel)
                for spec in specs}
    environment = collect_environment()
    gpu = gpu_label(opts.engine == "sim", environment["gpus"])
    context_len = max(scenario.input_len) + scenario.output_len + 64
    run_ids: list[int] = []
    plan = run_plan(scenario)
    requests = len(specs) * sum(point.num_requests + warmup for point, _, warmup in plan)
    with _signals_interrupt(), BenchProgress(console, len(specs) * len(plan), requests, opts.verbose) as progress:
        for spec in specs:
            run_ids += _run_backend(spec, scenario, plan, opts, store, console, progress, expected[spec.name],
                                    environment, gpu, context_len)
    return run_ids


def run_plan(scenario: Scenario) -> list[tuple[LoadPoint, int, int]]:
    """(point, repeat, warmup requests) in the order each backend runs them: warmup before the first repeat at each
    input length."""
    warmed: set[int] = set()
    plan = []
    for point in scenario.points():
        for repeat in range(scenario.repeats):
            plan.append((point, repeat, scenario.warmup_requests if point.input_len not in warmed else 0))
            warmed.add(point.input_len)
    return plan


def _run_backend(
    spec: BackendSpec, scenario: Scenario, plan: list[tuple[LoadPoint, int, int]], opts: BenchOptions,
    store: ResultStore, console: Console, progress: BenchProgress, expected_kernels: dict[str, str],
    environment: dict[str, Any], gpu: str, context_len: int,
) -> list[int]:
    """One backend's server and every step of the plan on it; returns the ids of the runs it stored."""
    run_ids: list[int] = []
    with served(spec, scenario.model, context_len, opts, progress) as (url, info, server):
        simulated = opts.engine == "sim" or bool(info.get("simulated"))
        # A simulated run's numbers come from the latency model, not from the code the caveat is about.
        caveat = None if simulated else spec.caveat_for(os.environ)
        if caveat:
            console.print(Text(f"{spec.name} {CAVEAT_MARK} caveat: {caveat}", style="yellow"))
        kernels = info.get("kernels") or expected_kernels
        for point, repeat, warmup in plan:
            run = RunRecord(
                scenario=scenario.name, backend=spec.name, engine=opts.engine, simulated=simulated,
                caveat=caveat, load=point.load, repeat=repeat, input_len=point.input_len,
                output_len=scenario.output_len,
                num_requests=point.num_requests, seed=scenario.seed,
                workload_hash=serving_workload.workload_hash(
                    seed=scenario.seed, input_len=point.input_len, output_len=scenario.output_len,
                    num_requests=point.num_requests, load=point.load,
                ),
                started_at=time.time(), model=model_name(scenario.model), gpu=gpu,
                server_info={**without_bundled_model_paths(info, scenario.model),
                             "metrics_clock": "modelled" if opts.modelled_clock else "wall"},
                backend_flags=_flags(spec, opts), kernels=kernels, environment=environment,
            )
            run_id = store.begin_run(run)
            run_ids.append(run_id)
            _measure(run, run_id, point, warmup, scenario, opts, url, store, progress, server)
    return run_ids


def _measure(
    run: RunRecord, run_id: int, point: LoadPoint, warmup: int, scenario: Scenario, opts: BenchOptions,
    url: str, store: ResultStore, progress: BenchProgress, server: ServerProcess | None,
) -> None:
    prompts, measured_digests = _workload(scenario.seed, point.num_requests, point.input_len)
    warmup_prompts, warmup_digests = _workload(scenario.seed + 1, warmup, point.input_len)
    arrivals = (
        serving_workload.arrival_times(point.num_requests, point.rate, point.burstiness, scenario.seed)
        if point.rate is not None else None
    )
    digests = {**dict(enumerate(measured_digests)), **{-1 - i: d for i, d in enumerate(warmup_digests)}}
    if opts.modelled_clock:
        arrivals = _send_load_hint(url, point, arrivals, digests, warmup)
    label = f"{run.backend} {point.label} #{run.repeat + 1}"
    progress.step_started(label, point.num_requests + warmup)
    records: list[RequestRecord] = []

    def on_complete(record: RequestRecord) -> None:
        if opts.modelled_clock and record.error is None:
            _use_modelled_times(record, url, digests[record.index])
        store.add_request(run_id, record)
        records.append(record)
        progress.request_done()

    try:
        client.run(client.run_load(
            url, prompts, scenario.output_len, concurrency=point.concurrency, arrivals=arrivals,
            warmup_prompts=warmup_prompts, on_complete=on_complete, api=opts.api,
            timeouts=opts.timeouts,
        ))
    except KeyboardInterrupt:
        _ignore_stop_signals()
        with stop_signals_held():
            store.finish_run(run_id, "interrupted", error=_interruption(),
                             summary=summarize(records, opts.slo))
        raise RunInterrupted(run_id) from None
    except Exception as exc:  # the run ends failed with the requests it has, whatever broke it
        error = f"{type(exc).__name__}: {exc}"
        with stop_signals_held():
            store.finish_run(run_id, "failed", error=error, summary=summarize(records, opts.slo))
        raise UserError(f"run {run_id} failed: {error}", exit_code=1) from exc
    summary = summarize(records, opts.slo)
    if server is not None and not server.alive:
        error = f"server died during the run; last log lines ({server.log_path}):\n{server.log_tail()}"
        store.finish_run(run_id, "failed", error=error, summary=summary)
        raise ServerError(f"run {run_id}: {error}")
    failed = [r for r in records if r.error]
    if failed:
        store.finish_run(run_id, "failed", error=f"{len(failed)} request(s) failed: {failed[0].error}", summary=summary)
    else:
        store.finish_run(run_id, "ok", summary=summary)
    progress.step_done(label, "ok" if not failed else f"{len(failed)} failed")


@functools.lru_cache(maxsize=4)
def _workload(seed: int, count: int, input_len: int) -> tuple[list[list[int]], list[str]]:
    """A workload's prompts and their digests, made once for every repeat and backend (a 128K-token prompt takes
    ~20 ms)."""
    prompts = serving_workload.make_prompts(seed, count, input_len)
    return prompts, [prompt_digest(prompt) for prompt in prompts]


def _send_load_hint(url: str, point: LoadPoint, arrivals: list[float] | None, digests: dict[int, str],
                    warmup: int) -> list[float] | None:
    """Tell the simulator how this repeat's load arrives; returns the client's arrival schedule: an open loop's
    requests are all sent at once, the simulator holding each until its modelled arrival."""
    hint: dict[str, Any] = {"expected": point.concurrency or point.num_requests,
                            "requests": point.num_requests + warmup}
    if arrivals is not None:
        hint["arrivals"] = {digests[i]: offset for i, offset in enumerate(arrivals)}
    _post_json(f"{url}/sim_load", hint)
    return None if arrivals is None else [0.0] * len(arrivals)


def _use_modelled_times(record: RequestRecord, url: str, digest: str) -> None:
    """Replace the client's timestamps of a finished request by the simulator's modelled ones (one token each)."""
    times = _get_json(f"{url}/sim_clock/{digest}")
    record.dispatch_s = times["arrival_s"]
    record.chunk_s = times["token_s"]
    record.chunk_tokens = [1] * len(record.chunk_s)
    record.completion_s = record.chunk_s[-1]


def estimated_seconds(scenario: Scenario, specs: list[BackendSpec], opts: BenchOptions) -> float:
    """A rough wall-clock duration of the whole bench, from the latency model (one H200): modelled time at the
    pace the engine runs, plus the simulator's cost of moving the prompts or a real server's start."""
    shape = load_model_shape(scenario.model)
    pace = opts.time_scale if opts.engine == "sim" else 1.0
    total = 0.0
    for spec in specs:
        model = LatencyModel(spec.sim, shape)
        for point in scenario.points():
            requests = point.num_requests + scenario.warmup_requests
            modelled = point_seconds(model, point.input_len, scenario.output_len, requests, point.concurrency,
                                     point.rate)
            prompt_tokens = requests * point.input_len
            cost = SIM_SECONDS_PER_PROMPT_TOKEN * prompt_tokens if opts.engine == "sim" else 0.0
            total += scenario.repeats * (modelled * pace + cost)
        total += SERVER_START_S.get(opts.engine, 0.0)
    return total


def _flags(spec: BackendSpec, opts: BenchOptions) -> list[str]:
    """The server flags that define what was measured, parallelism included."""
    parallel = ["--tp-size", str(opts.tp), "--dp-size", str(opts.dp)] if opts.engine == "sglang" else []
    return [*spec.sglang_args, *parallel, *opts.server_args_for(spec)]


def progress_bar(console: Console) -> ServerBar:
    """The progress display of commands that start one server at a time and add their own tasks."""
    return ServerBar(console)
