"""`mpfa bench`: for each backend, get a server, confirm what it runs, and measure every load point x repeat.

Each run records the attention kernels its server ran (`served_kernels`): what the server reports (the simulator
says what it simulates), else what the backend runs for the model's shape with the user's prefill kernel, which
MpFA's servers are given as a server argument.
Every finished request is written to the store as it completes (`recorder`: a database that cannot take it
leaves it in a recovery file), so a server crash or Ctrl-C loses only the requests in flight; the run is then
marked failed or interrupted. Whatever fails once a run has begun ends it failed, never left running.

A server is confirmed before it is measured: the backend and KV-cache dtype its `/get_server_info` reports must be
the backend's, and the model it serves the scenario's; the reply is read with a size limit and a deadline, and a
redirect is refused (`server_json`). What is stored of it and of the server flags has its secrets redacted.

On the simulator, unless `real_time`, requests are timed on the latency model's clock: before each repeat the
server is told how the load arrives (`sim_server.LoadHint`), so it runs as fast as `time_scale` lets it and each
request still joins the same batch step; every finished request's arrival and token times are then read from the
server in modelled seconds. The stored numbers are the same at any speed-up.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from ...backends.specs import BackendSpec
from ..harness import client, conversations, serving_workload
from ..results.metrics.summary import summarize
from ..harness.engines import (READY_TIMEOUT_S, SGLANG_HIGHEST_PORT, gpu_label, model_name, radix_cache_args,
                               sglang_launch, sim_launch)
from ..harness.environment import collect_environment
from ..errors import UserError
from ..harness.latency_model import LatencyModel, point_seconds
from .progress import BenchProgress, ServerBar
from ..harness.records import RequestRecord, RunRecord
from ..reports.tables import CAVEAT_MARK
from ..harness.redaction import redact_args, redact_info
from ..harness.prefix_workloads import MultiTurn
from ..harness.scenario import LoadPoint, Scenario, is_bundled_model, load_model_shape, without_bundled_model_paths
from ..harness.served_kernels import (SGLANG_DEFAULT_KV_CACHE_DTYPES, kernel_server_args, launch_page_size,
                                      served_kernels)
from ..harness.server_json import fetch_json
from ..harness.sim_knobs import SimKnobs
from ..harness.sim_server import prompt_digest
from ..harness.trace import Trace
from ..harness.server import STOP_SIGNALS, ServerError, ServerProcess, pick_port, stop_signals_held
from ..results.store import ResultStore
from .recorder import RunRecorder


INVOCATION_DIGITS = 8  # of a bench call's random hex id: shown whole, and unlikely to repeat in one database


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
    sim_knobs: SimKnobs = field(default_factory=SimKnobs)  # simulator: slowdown and seeded noise (CI rehearsals)
    invocation: str = field(default_factory=lambda: uuid.uuid4().hex[:INVOCATION_DIGITS])  # this bench call's id

    @property
    def modelled_clock(self) -> bool:
        """Requests are timed on the simulator's latency model, not on the client's clock."""
        return self.engine == "sim" and not self.real_time

    def server_args_for(self, spec: BackendSpec) -> list[str]:
        """The extra server flags of ``spec``'s server: the user's, and the prefill kernel for MpFA's."""
        return [*kernel_server_args(spec, self.prefill_kernel), *self.server_args]


# For `estimated_seconds`, as measured with the simulator on a 2-core CPU: its cost per prompt token sent (serialized,
# parsed, hashed); the bench's own start (imports, environment); the fixed cost of each step (a run begun and closed
# in the store, the simulator's load hint and the wait for its first requests) and of each request (its stream, the
# store's write and, on the modelled clock, the read of its modelled times). A server's start-to-stop: the simulator's
# (ready in 1-1.5 s, polled every 0.5 s, stopped in ~0.3 s, checked); SGLang's is an assumption, not a measurement:
# ~90 s for an 8B model with dummy weights and CUDA graphs captured (a real checkpoint loads longer). A --url
# server is already running.
SIM_SECONDS_PER_PROMPT_TOKEN = 0.3e-6
BENCH_START_S = 0.5
STEP_OVERHEAD_S = 0.03
REQUEST_OVERHEAD_S = 0.002
SERVER_START_S = {"sim": 1.6, "sglang": 90.0}


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
    `must_report`, one that does not say what it runs). A backend whose spec names no KV-cache dtype runs SGLang's
    default one: a server reporting another (an FP8 cache for a BF16 backend) is refused too."""
    accepted = {key: (want,) for key, want in spec.expect.items()}
    accepted.setdefault("kv_cache_dtype", SGLANG_DEFAULT_KV_CACHE_DTYPES)
    reported = {key: _find_key(info, key) for key in accepted}
    for key, wants in accepted.items():
        got = reported[key]
        if got is not None and str(got) not in wants:
            raise UserError(f"server reports {key}={str(got)[:80]}, but backend '{spec.name}' asks for "
                            f"{' or '.join(wants)}", exit_code=1)
    if must_report and all(reported[key] is None for key in spec.expect):
        raise UserError(f"the server reports no {', '.join(spec.expect)} to check backend '{spec.name}' against; "
                        f"name it with --backend-label {spec.name} to store its runs under that name unchecked",
                        exit_code=1)


def verify_model(info: dict[str, Any], model: str) -> None:
    """Refuse a server that serves another model than `model` (a bundled config's name or a model directory): the
    last part of the `model_path` or `served_model_name` it reports, if it reports one (SGLang does), must be the
    model's name (letter case aside)."""
    want = model_name(model)
    names: list[str] = []
    for key in ("model_path", "served_model_name"):
        found = _find_key(info, key)
        names += [name for name in (found if isinstance(found, list) else [found]) if isinstance(name, str)]
    if names and not any(_last_part(name) == want.lower() for name in names):
        raise UserError(f"server serves model {names[0][:200]!r}, but the scenario's model is '{want}' (give "
                        "--model with the served model's config: a bundled name or its directory)", exit_code=1)


def _last_part(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


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
    spec: BackendSpec, model: str, context_len: int, opts: BenchOptions, progress: BenchProgress | ServerBar,
    radix_cache: bool = False,
) -> Iterator[tuple[str, dict[str, Any], ServerProcess | None]]:
    """A ready server for `spec` (launched, or the one at --url): yields its URL, server info and process. A
    launched server has its prefix (radix) cache on only with `radix_cache`. A server whose `/get_server_info`
    contradicts the backend or the model is refused; a --url server must report its backend, unless that was
    given as a label."""
    if opts.engine == "url":
        url = opts.url.rstrip("/")
        info = fetch_json(f"{url}/get_server_info")
        if not opts.labelled:
            verify_server(info, spec, must_report=True)
        verify_model(info, model)
        yield url, info, None
        return
    port = pick_port(opts.port, highest=65535 if opts.engine == "sim" else SGLANG_HIGHEST_PORT)
    if opts.engine == "sim":
        launch = sim_launch(spec, port, opts.time_scale, model, [*opts.sim_knobs.args(), *opts.server_args_for(spec)],
                            radix_cache)
    else:
        launch = sglang_launch(spec, port, model, context_len, opts.tp, opts.dp, opts.server_args_for(spec),
                               radix_cache)
    url = f"http://127.0.0.1:{port}"
    log = opts.run_dir / f"server-{spec.name}-{int(time.time())}.log"
    with ServerProcess(launch.command, log, url, launch.env) as server:
        progress.server(f"{spec.name}: starting server")
        timeout = opts.ready_timeout_s or READY_TIMEOUT_S[opts.engine]
        took = server.wait_ready(timeout, on_tick=lambda _: progress.tick())
        progress.server(f"{spec.name}: server ready after {took:.0f} s")
        info = fetch_json(f"{url}/get_server_info")
        verify_server(info, spec)
        verify_model(info, model)
        if opts.engine != "sim":  # the simulator loads no weights
            verify_weights(info, model)
        yield url, info, server


Step = tuple[LoadPoint, int, int]  # (point, repeat, warmup requests)
# A backend's steps, one at a time: each step's measured requests are sent back in, so that a search
# (`goodput.py`) can choose its next point from the last one's outcome.
Steps = Generator[Step, list[RequestRecord], None]


def run_bench(
    scenario: Scenario, specs: list[BackendSpec], opts: BenchOptions, store: ResultStore, console: Console,
    steps: Callable[[BackendSpec], Steps] | None = None, most_steps: int | None = None,
) -> list[int]:
    """Measure every backend, the scenario's plan (`run_plan`) or the `steps` given, at most `most_steps` per
    backend; returns the ids of the runs it stored."""
    shape = load_model_shape(scenario.model)
    # The heads of one tensor-parallel rank (SGLang replicates KV heads over ranks beyond their count). A prefill
    # kernel that shape does not take fails here, before any server starts.
    q_heads, kv_heads = shape.q_heads // opts.tp, max(1, shape.kv_heads // opts.tp)
    expected = {spec.name: served_kernels(spec, q_heads, kv_heads, launch_page_size(spec), opts.prefill_kernel)
                for spec in specs}
    environment = collect_environment()
    gpu = gpu_label(opts.engine == "sim", environment["gpus"])
    context_len = max(scenario.input_len) + scenario.output_len + 64
    if opts.modelled_clock and scenario.trace is not None:
        _check_modelled_trace(scenario.trace)
    recorder = RunRecorder(store, opts.run_dir)
    plan = run_plan(scenario)
    step_count = len(plan) if steps is None else most_steps
    requests = len(specs) * (sum(point.num_requests + warmup for point, _, warmup in plan) if steps is None else
                             step_count * scenario.num_requests + scenario.warmup_requests * len(scenario.input_len))
    try:
        with _signals_interrupt(), BenchProgress(console, len(specs) * step_count, requests, opts.verbose) as progress:
            for spec in specs:
                backend_steps = _fixed(plan) if steps is None else steps(spec)
                _run_backend(spec, scenario, backend_steps, opts, recorder, console, progress, expected[spec.name],
                             environment, gpu, context_len)
        recorder.require_present()
    finally:
        recorder.close()
    return recorder.run_ids


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


def _fixed(plan: list[Step]) -> Steps:
    """A plan's steps, whatever each measured."""
    for step in plan:
        yield step


def _run_backend(
    spec: BackendSpec, scenario: Scenario, steps: Steps, opts: BenchOptions,
    recorder: RunRecorder, console: Console, progress: BenchProgress, expected_kernels: dict[str, str],
    environment: dict[str, Any], gpu: str, context_len: int,
) -> None:
    """One backend's server and every step of the plan on it."""
    with served(spec, scenario.model, context_len, opts, progress, scenario.shares_prefixes) as (url, info, server):
        simulated = opts.engine == "sim" or info.get("simulated") is True  # a JSON true, not "false" or 1
        # A simulated run's numbers come from the latency model, not from the code the caveat is about.
        caveat = None if simulated else spec.caveat_for(os.environ)
        if caveat:
            console.print(Text(f"{spec.name} {CAVEAT_MARK} caveat: {caveat}", style="yellow"))
        kernels = _reported_kernels(info) or expected_kernels
        server_info = redact_info(without_bundled_model_paths(info, scenario.model))
        page_size = _find_key(info, "page_size")
        declared = workload_declaration(scenario, page_size if isinstance(page_size, int) and page_size > 0
                                        else launch_page_size(spec))
        run_number = 0
        step = next(steps, None)
        while step is not None:
            point, repeat, warmup = step
            run = RunRecord(
                scenario=scenario.name, backend=spec.name, engine=opts.engine, simulated=simulated,
                caveat=caveat, load=point.load, repeat=repeat, input_len=point.input_len,
                output_len=scenario.output_len,
                num_requests=point.num_requests, seed=scenario.seed,
                workload_hash=serving_workload.workload_hash(
                    seed=scenario.seed, input_len=point.input_len, output_len=scenario.output_len,
                    num_requests=point.num_requests, load=point.load, **_sharing(scenario),
                    **({"trace_sha256": point.trace.sha256} if point.trace is not None else {}),
                ),
                started_at=time.time(), model=model_name(scenario.model), gpu=gpu,
                server_info={**server_info, "metrics_clock": "modelled" if opts.modelled_clock else "wall",
                             "workload": declared},
                backend_flags=_flags(spec, opts, scenario.shares_prefixes), kernels=kernels, environment=environment,
                invocation=opts.invocation,
            )
            recorder.begin(run)
            records = _measure(run, point, warmup, scenario, opts, url, recorder, progress, server, run_number)
            run_number += 1
            step = _send(steps, records)


def _send(steps: Steps, records: list[RequestRecord]) -> Step | None:
    """The next step, given what the last one measured; None once there is none."""
    try:
        return steps.send(records)
    except StopIteration:
        return None


def _sharing(scenario: Scenario) -> dict[str, Any]:
    """What a workload that shares prefixes adds to its hash (nothing for unshareable prompts: their hash stays)."""
    if scenario.trace is not None:
        return {"trace_blocks": "per-run"}  # block tokens keyed by the run, first tokens distinct per block
    if scenario.workload is None:
        return {}
    return {"workload": {"kind": scenario.workload.kind, **dataclasses.asdict(scenario.workload)}}


def workload_declaration(scenario: Scenario, page_size: int) -> dict[str, Any]:
    """What a run's workload declares of its prefix sharing, stored with the run (`server_info["workload"]`): its
    kind, whether the server was asked for its prefix cache, and the prompt tokens the measured requests should
    find cached on pages of `page_size` (0 for prompts that share nothing)."""
    workload = scenario.workload
    if workload is None and scenario.shares_prefixes:
        assert scenario.trace is not None
        return {"kind": "trace", "prefix_cache": True, "page_size": page_size,
                "most_cached_tokens": scenario.trace.most_cached_tokens(page_size)}
    if workload is None:
        return {"kind": "unshared", "prefix_cache": False, "expected_cached_tokens": 0}
    expected = (workload.expected_cached_tokens(page_size, scenario.output_len) if isinstance(workload, MultiTurn)
                else workload.expected_cached_tokens(page_size))
    return {"kind": workload.kind, "prefix_cache": True, "page_size": page_size,
            "expected_cached_tokens": expected}


def _reported_kernels(info: dict[str, Any]) -> dict[str, str] | None:
    """The kernels a server says it runs (the simulator does), if it says; anything but names is refused."""
    kernels = info.get("kernels")
    if kernels is None or kernels == {}:
        return None
    if not (isinstance(kernels, dict) and all(isinstance(v, str) for v in kernels.values())):
        raise UserError(f"server reports kernels={str(kernels)[:80]}, not an object of kernel names", exit_code=1)
    return kernels


def _measure(
    run: RunRecord, point: LoadPoint, warmup: int, scenario: Scenario, opts: BenchOptions,
    url: str, recorder: RunRecorder, progress: BenchProgress, server: ServerProcess | None, run_number: int = 0,
) -> list[RequestRecord]:
    """Measure one step of the plan into its run (begun): whatever happens, the run ends ok, failed or
    interrupted. Returns its measured requests (warmup aside)."""
    label = f"{run.backend} {point.label} #{run.repeat + 1}"
    records: list[RequestRecord] = []
    digests: dict[int, str] = {}

    def on_complete(record: RequestRecord) -> None:
        if opts.modelled_clock and record.error is None:
            _use_modelled_times(record, url, digests[record.index])
        recorder.add(record)
        records.append(record)
        progress.request_done()

    try:
        if isinstance(scenario.workload, MultiTurn):
            _converse(scenario.workload, point, warmup, scenario, opts, url, run_number, digests, on_complete,
                      progress, label)
        else:
            if point.trace is not None:
                prompts, output_lens, arrivals = _trace_point(point, scenario.seed, run_number)
                warmup_prompts = _unshared(scenario.seed + 1, warmup, point.input_len)
            else:
                prompts, warmup_prompts = _prompts(scenario, point, warmup, run_number)
                output_lens = None
                arrivals = (
                    serving_workload.arrival_times(point.num_requests, point.rate, point.burstiness, scenario.seed)
                    if point.rate is not None else None
                )
            digests.update({**{i: prompt_digest(p) for i, p in enumerate(prompts)},
                            **{-1 - i: prompt_digest(p) for i, p in enumerate(warmup_prompts)}})
            if opts.modelled_clock:
                arrivals = _send_load_hint(url, point, arrivals, digests, warmup)
            progress.step_started(label, point.num_requests + warmup)
            client.run(client.run_load(
                url, prompts, scenario.output_len, concurrency=point.concurrency, arrivals=arrivals,
                output_lens=output_lens, warmup_prompts=warmup_prompts, on_complete=on_complete, api=opts.api,
                timeouts=opts.timeouts,
            ))
    except KeyboardInterrupt:
        _ignore_stop_signals()
        with stop_signals_held():
            recorder.finish("interrupted", error=_interruption(), summary=summarize(records, opts.slo))
        raise RunInterrupted(run.id) from None
    except Exception as exc:  # the run ends failed with the requests it has, whatever broke it
        error = f"{type(exc).__name__}: {exc}"
        with stop_signals_held():
            recorder.finish("failed", error=error, summary=summarize(records, opts.slo))
        raise UserError(f"run {run.id} failed: {error}", exit_code=1) from exc
    summary = summarize(records, opts.slo)
    if server is not None and not server.alive:
        error = f"server died during the run; last log lines ({server.log_path}):\n{server.log_tail()}"
        recorder.finish("failed", error=error, summary=summary)
        raise ServerError(f"run {run.id}: {error}")
    failed = [r for r in records if r.error]
    if failed:
        recorder.finish("failed", error=f"{len(failed)} request(s) failed: {failed[0].error}", summary=summary)
    else:
        recorder.finish("ok", error=None, summary=summary)
    progress.step_done(label, "ok" if not failed else f"{len(failed)} failed")
    return [r for r in records if not r.warmup]


def _trace_point(point: LoadPoint, seed: int, run_number: int) -> tuple[list[list[int]], list[int], list[float]]:
    """A trace point's prompts for run `run_number` of the plan, their own output lengths and their send times."""
    assert point.trace is not None
    return (_trace_workload(point.trace, seed, run_number)[0], point.trace.output_lengths(),
            point.trace.send_times(point.speedup))


def _check_modelled_trace(trace: Trace) -> None:
    """The simulator's modelled clock tells requests apart by their prompt: a trace that repeats one cannot be
    replayed on it."""
    first_at: dict[str, int] = {}
    for index, digest in enumerate(_trace_workload(trace, 0, 0)[1]):
        if (first := first_at.setdefault(digest, index)) != index:
            raise UserError(f"trace {trace.name}: requests {first + 1} and {index + 1} have the same prompt, which "
                            "the simulator's modelled clock cannot tell apart; replay it with --real-time")


@functools.lru_cache(maxsize=2)
def _trace_workload(trace: Trace, seed: int, run_number: int) -> tuple[list[list[int]], list[str]]:
    """A trace's prompts for one run of the plan and their digests, made once for every backend."""
    prompts = trace.prompts(seed, run_number)
    return prompts, [prompt_digest(prompt) for prompt in prompts]


def _prompts(scenario: Scenario, point: LoadPoint, warmup: int, run_number: int
             ) -> tuple[list[list[int]], list[list[int]]]:
    """(measured, warmup) prompts of the plan's run `run_number`: unshareable ones, the same at every repeat, or
    a shared-prefix workload's, fresh for every run so that none hits the cache another filled."""
    if scenario.workload is None:
        return (_unshared(scenario.seed, point.num_requests, point.input_len),
                _unshared(scenario.seed + 1, warmup, point.input_len))
    return scenario.workload.prompts(scenario.seed, run_number, warmup, scenario.warmup_requests)


@functools.lru_cache(maxsize=4)
def _unshared(seed: int, count: int, input_len: int) -> list[list[int]]:
    """A workload's prompts, made once for every repeat and backend (a 128K-token prompt takes ~20 ms)."""
    return serving_workload.make_prompts(seed, count, input_len)


def _converse(workload: MultiTurn, point: LoadPoint, warmup: int, scenario: Scenario, opts: BenchOptions, url: str,
              run_number: int, digests: dict[int, str], on_complete: Any, progress: BenchProgress,
              label: str) -> None:
    """One run of a multi-turn workload (`conversations`). On the simulator's modelled clock think time is paced
    at `time_scale` and, as the modelled clock does not run while it waits for requests, not modelled."""
    if opts.api != "sglang":
        raise UserError("multi-turn workloads need --api sglang: the next turn holds the output ids of the last, "
                        "which only SGLang's /generate returns")
    if opts.modelled_clock:
        _send_load_hint(url, point, None, digests, warmup)
    progress.step_started(label, point.num_requests + warmup)
    pace = opts.time_scale if opts.engine == "sim" else 1.0
    client.run(conversations.run_conversations(
        url, workload, scenario.seed, run_number, scenario.output_len, concurrency=point.concurrency or 1,
        think_time_s=workload.think_time_s * pace, warmup=warmup, max_warmup=scenario.warmup_requests,
        on_prompt=lambda index, prompt: digests.__setitem__(index, prompt_digest(prompt)),
        on_complete=on_complete, timeouts=opts.timeouts))


def _send_load_hint(url: str, point: LoadPoint, arrivals: list[float] | None, digests: dict[int, str],
                    warmup: int) -> list[float] | None:
    """Tell the simulator how this repeat's load arrives; returns the client's arrival schedule: an open loop's
    requests are all sent at once, the simulator holding each until its modelled arrival."""
    hint: dict[str, Any] = {"expected": point.concurrency or point.num_requests,
                            "requests": point.num_requests + warmup}
    if arrivals is not None:
        hint["arrivals"] = {digests[i]: offset for i, offset in enumerate(arrivals)}
    fetch_json(f"{url}/sim_load", hint)
    return None if arrivals is None else [0.0] * len(arrivals)


def _use_modelled_times(record: RequestRecord, url: str, digest: str) -> None:
    """Replace the client's timestamps of a finished request by the simulator's modelled ones (one token each)."""
    times = fetch_json(f"{url}/sim_clock/{digest}")
    record.dispatch_s = times["arrival_s"]
    record.chunk_s = times["token_s"]
    record.chunk_tokens = [1] * len(record.chunk_s)
    record.completion_s = record.chunk_s[-1]


def estimated_seconds(scenario: Scenario, specs: list[BackendSpec], opts: BenchOptions) -> float:
    """A rough wall-clock duration of the whole bench: each point's modelled time (the latency model of one H200)
    at the pace the engine runs, plus what the model leaves out: the simulator's cost of moving the prompts, the
    fixed costs of the bench, of each step and request, and each server's start and stop (`SERVER_START_S`)."""
    shape = load_model_shape(scenario.model)
    pace = opts.time_scale if opts.engine == "sim" else 1.0
    total = BENCH_START_S
    for spec in specs:
        model = LatencyModel(spec.sim, shape)
        for point in scenario.points():
            requests = point.num_requests + scenario.warmup_requests
            rate = point.rate
            if point.trace is not None and (span := point.trace.send_times(point.speedup)[-1]) > 0:
                rate = point.num_requests / span  # the replay's mean rate
            modelled = point_seconds(model, point.input_len, scenario.output_len, requests, point.concurrency, rate)
            prompt_tokens = requests * point.input_len
            cost = SIM_SECONDS_PER_PROMPT_TOKEN * prompt_tokens if opts.engine == "sim" else 0.0
            total += scenario.repeats * (modelled * pace + cost + STEP_OVERHEAD_S + requests * REQUEST_OVERHEAD_S)
        total += SERVER_START_S.get(opts.engine, 0.0)
    return total


def _flags(spec: BackendSpec, opts: BenchOptions, radix_cache: bool = False) -> list[str]:
    """The server flags that define what was measured, parallelism and a launched server's prefix cache included,
    as stored: secrets redacted."""
    parallel = ["--tp-size", str(opts.tp), "--dp-size", str(opts.dp)] if opts.engine == "sglang" else []
    cache = radix_cache_args(radix_cache) if opts.engine != "url" else []
    return redact_args([*spec.sglang_args, *parallel, *cache, *opts.server_args_for(spec)])


def progress_bar(console: Console) -> ServerBar:
    """The progress display of commands that start one server at a time and add their own tasks."""
    return ServerBar(console)
