"""`mpfa bench` (measure scenarios against backends) and `mpfa serve-sim` (the built-in simulated server)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .common import DB_HELP, cli_errors, console, err_console, number_list, open_store
from .selection import REFERENCE_HELP
from ..errors import UserError
from ..harness.request_timeouts import BadTimeout, Timeouts
from ..harness.sim_knobs import SimKnobs, knobs_label, parse_fraction

if TYPE_CHECKING:  # the bench itself is imported when the command runs
    from ..bench.goodput import GoodputSearch
    from ..bench.runner import BenchOptions
    from ..harness.scenario import Scenario

DEFAULT_TIMEOUTS = Timeouts()
GOODPUT_SHARE = 0.9  # --goodput-search: the share of requests meeting every SLO, as AIPerf's and vLLM's goodput
GOODPUT_PROBES = 8  # and the most rates each search measures

SIM_TIME_SCALE = 1e-4  # the simulator runs 10000x faster than modelled unless asked otherwise
SIM_BACKENDS = "fa4-bf16,flashinfer-fp8,mpfa"  # bench's default backends on the simulator
SERVER_BACKENDS = "fa4-bf16,flashinfer-fp8"  # and on SGLang or a --url server


WORKLOAD, SERVER, SIMULATOR, TIMEOUTS, OUTPUT = "Workload", "Server", "Simulator", "Timeouts", "Output"


@cli_errors
def bench(
    scenario: Annotated[str, typer.Option("--scenario", "-s", metavar="NAME|FILE", rich_help_panel=WORKLOAD, help="Scenario name or .toml path (see `mpfa scenarios`).")] = "smoke",
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", metavar="LIST", rich_help_panel=WORKLOAD, help=f"Comma-separated backends (see `mpfa backends`; default: {SIM_BACKENDS} on the simulator, {SERVER_BACKENDS} on a server).")] = None,
    model: Annotated[Optional[str], typer.Option(metavar="NAME|DIR", rich_help_panel=WORKLOAD, help="Bundled config name (dummy weights) or a model directory.")] = None,
    concurrency: Annotated[Optional[str], typer.Option(metavar="LIST", rich_help_panel=WORKLOAD, help="Override: comma-separated concurrency list.")] = None,
    rate: Annotated[Optional[str], typer.Option(metavar="LIST", rich_help_panel=WORKLOAD, help="Override: comma-separated request rates (req/s).")] = None,
    input_len: Annotated[Optional[str], typer.Option("--input-len", metavar="LIST", rich_help_panel=WORKLOAD, help="Override: comma-separated input lengths.")] = None,
    points: Annotated[Optional[str], typer.Option("--points", metavar="LIST", rich_help_panel=WORKLOAD, help="Only these points, e.g. 128K:c=1,64K:c=8 (see `mpfa scenarios`).")] = None,
    output_len: Annotated[Optional[int], typer.Option("--output-len", metavar="N", rich_help_panel=WORKLOAD, help="Override: output tokens per request.")] = None,
    num_requests: Annotated[Optional[int], typer.Option("--num-requests", metavar="N", rich_help_panel=WORKLOAD, help="Override: measured requests per point and repeat.")] = None,
    warmup_requests: Annotated[Optional[int], typer.Option("--warmup-requests", metavar="N", rich_help_panel=WORKLOAD, help="Override: unmeasured requests each server gets before the first repeat at each input length.")] = None,
    repeats: Annotated[Optional[int], typer.Option(metavar="N", rich_help_panel=WORKLOAD, help="Override: repeats of every point.")] = None,
    seed: Annotated[Optional[int], typer.Option(metavar="N", rich_help_panel=WORKLOAD, help="Override: seed of the prompts' token ids (and of --sim-noise).")] = None,
    slo: Annotated[Optional[str], typer.Option(metavar="KEY=TIME,...", rich_help_panel=WORKLOAD, help="Goodput SLO, e.g. ttft=2s,tpot=50ms (a bare number is ms): each run's summary adds goodput, the requests per second that met every bound given.")] = None,
    speedup: Annotated[Optional[float], typer.Option(metavar="X", rich_help_panel=WORKLOAD, help="Override: a trace scenario's replay speed-up (send times are the trace's timestamps divided by it).")] = None,
    goodput_search: Annotated[bool, typer.Option("--goodput-search/--no-goodput-search", rich_help_panel=WORKLOAD, help="Per backend and input length, find the highest request rate (Poisson) at which --goodput-share of the requests meet --slo, by a bounded sweep from the scenario's lowest rate (else 1/s); every probe is a stored run.")] = False,
    goodput_share: Annotated[float, typer.Option(metavar="SHARE", rich_help_panel=WORKLOAD, help="With --goodput-search: the share of requests that must meet every SLO.")] = GOODPUT_SHARE,
    goodput_probes: Annotated[int, typer.Option(metavar="N", rich_help_panel=WORKLOAD, help="With --goodput-search: the most load points each search measures.")] = GOODPUT_PROBES,
    engine: Annotated[str, typer.Option(metavar="NAME", rich_help_panel=SERVER, help="auto (sglang with a GPU, else sim), sim, sglang.")] = "auto",
    url: Annotated[Optional[str], typer.Option(metavar="URL", rich_help_panel=SERVER, help="Benchmark a server someone else started; its /get_server_info must confirm --backend.")] = None,
    backend_label: Annotated[Optional[str], typer.Option("--backend-label", metavar="NAME", rich_help_panel=SERVER, help="With --url, instead of --backend: the backend to store the runs under, unchecked (for servers that report none).")] = None,
    api: Annotated[str, typer.Option(metavar="NAME", rich_help_panel=SERVER, help="With --url: sglang (native /generate), openai (/v1/completions) or openai-chat (/v1/chat/completions: the prompt's token ids go as text, in decimal; the server's own prompt count is stored).")] = "sglang",
    prefill_kernel: Annotated[Optional[str], typer.Option("--prefill-kernel", metavar="NAME", rich_help_panel=SERVER, help="MpFA prefill kernel: fp8, exact or mma-sync (default: the best for the model's shape; also $MPFA_PREFILL_KERNEL).")] = None,
    port: Annotated[Optional[int], typer.Option(metavar="PORT", rich_help_panel=SERVER, help="Preferred server port (another is picked if it is in use).")] = None,
    tp: Annotated[int, typer.Option(metavar="N", rich_help_panel=SERVER, help="SGLang tensor parallelism.")] = 1,
    dp: Annotated[int, typer.Option(metavar="N", rich_help_panel=SERVER, help="SGLang data parallelism.")] = 1,
    server_arg: Annotated[Optional[list[str]], typer.Option("--server-arg", metavar="FLAG", rich_help_panel=SERVER, help="Extra server flag, SGLang's or serve-sim's (repeatable; --server-arg=--flag=value).")] = None,
    time_scale: Annotated[float, typer.Option(metavar="X", rich_help_panel=SIMULATOR, help="Wall seconds per modelled second: the pace only, the metrics are in modelled time at any value.")] = SIM_TIME_SCALE,
    real_time: Annotated[bool, typer.Option("--real-time/--no-real-time", rich_help_panel=SIMULATOR, help="Run at the modelled speed and time requests on the client's clock.")] = False,
    sim_slowdown: Annotated[float, typer.Option(metavar="X", rich_help_panel=SIMULATOR, help="Multiply every modelled step time by X (1.2: a 20% slower backend), for CI rehearsals; shown in the SIMULATED label.")] = 1.0,
    sim_noise: Annotated[str, typer.Option(metavar="PCT", rich_help_panel=SIMULATOR, help="Each repeat's step times vary by this relative standard deviation (e.g. 3%), seeded by --seed: repeats differ, reproducibly.")] = "0%",
    ready_timeout: Annotated[Optional[float], typer.Option(metavar="SECONDS", rich_help_panel=TIMEOUTS, help="Seconds to wait for each server to get ready.")] = None,
    connect_timeout: Annotated[float, typer.Option(metavar="SECONDS", rich_help_panel=TIMEOUTS, help="Seconds a request may take to connect.")] = DEFAULT_TIMEOUTS.connect_s,
    first_token_timeout: Annotated[float, typer.Option(metavar="SECONDS", rich_help_panel=TIMEOUTS, help="Seconds from a request's dispatch to its first streamed bytes.")] = DEFAULT_TIMEOUTS.first_token_s,
    chunk_timeout: Annotated[float, typer.Option(metavar="SECONDS", rich_help_panel=TIMEOUTS, help="Seconds of silence tolerated between a stream's chunks.")] = DEFAULT_TIMEOUTS.chunk_s,
    request_timeout: Annotated[float, typer.Option(metavar="SECONDS", rich_help_panel=TIMEOUTS, help="Seconds a whole request may take; a request over any timeout fails with the reason.")] = DEFAULT_TIMEOUTS.request_s,
    ref: Annotated[Optional[str], typer.Option("--ref", metavar="BACKEND", rich_help_panel=OUTPUT, help=REFERENCE_HELP)] = None,
    output_format: Annotated[str, typer.Option("--format", metavar="FORMAT", rich_help_panel=OUTPUT, help="The summary as a table, json, csv or md (Markdown); json/csv/md go to stdout, the rest to stderr.")] = "table",
    wide: Annotated[bool, typer.Option("--wide/--narrow", rich_help_panel=OUTPUT, help="One flat table of every point (needs ~140+ columns).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose/--quiet", "-v", rich_help_panel=OUTPUT, help="Progress of every step's requests too, not only the overall one.")] = False,
    run_dir: Annotated[Optional[Path], typer.Option(metavar="DIR", rich_help_panel=OUTPUT, help="Where server logs go (default: beside the database).")] = None,
    db: Annotated[Optional[Path], typer.Option("--db", metavar="FILE", rich_help_panel=OUTPUT, help=DB_HELP)] = None,
) -> None:
    """Run a scenario against one or more backends and store every request and the kernels each server ran."""
    from ..bench.runner import BenchOptions, RunInterrupted, estimated_seconds, run_bench
    from ..harness.client import APIS
    from ..harness.engines import refuse_sim_launch_flags, resolve_backends, resolve_engine
    from ..reports.tables import check_format, compare_table, compare_tables, default_reference, format_compare
    from ..harness.scenario import load_scenario
    from ..harness.served_kernels import check_prefill_kernel

    overrides = {
        "model": model, "output_len": output_len, "num_requests": num_requests,
        "warmup_requests": warmup_requests, "repeats": repeats, "seed": seed,
        "concurrency": number_list(concurrency, "--concurrency"), "rate": number_list(rate, "--rate", float),
        "input_len": number_list(input_len, "--input-len"), "speedup": speedup,
    }
    check_format(output_format)
    if api not in APIS:
        raise UserError(f"--api: '{api}' is not one of {', '.join(APIS)}")
    info = console if output_format == "table" else err_console  # keep stdout for the data
    if overrides["rate"] is not None:
        overrides["concurrency"] = None
    spec = load_scenario(scenario, overrides)
    if overrides["rate"] is not None:
        spec.concurrency = []
    if points is not None:
        spec = spec.only([p for p in points.split(",") if p.strip()])
    if backend_label is not None and (url is None or backend is not None):
        raise UserError("--backend-label names the backend of a --url server, instead of --backend")
    backend = backend_label or backend
    search = _goodput_search(spec, slo, goodput_share, goodput_probes, output_format) if goodput_search else None
    chosen_engine = resolve_engine(engine, url)
    specs = resolve_backends(backend or (SIM_BACKENDS if chosen_engine == "sim" else SERVER_BACKENDS), chosen_engine,
                             spec.model)
    if chosen_engine != "sglang" and (tp, dp) != (1, 1):
        raise UserError("--tp/--dp apply to the sglang engine only")
    knobs = _sim_knobs(sim_slowdown, sim_noise, spec.seed)
    if chosen_engine == "sim":
        refuse_sim_launch_flags(list(server_arg or []))
    if knobs.active and chosen_engine != "sim":
        raise UserError("--sim-slowdown/--sim-noise apply to the simulator only (--engine sim)")
    with open_store(db) as store:
        opts = BenchOptions(
            engine=chosen_engine, run_dir=run_dir or store.path.parent / "runs", url=url, api=api, port=port,
            time_scale=1.0 if real_time else time_scale, real_time=real_time, ready_timeout_s=ready_timeout, tp=tp, dp=dp, server_args=list(server_arg or []),
            slo=_parse_slo(slo) if slo else None,
            prefill_kernel=check_prefill_kernel(prefill_kernel), verbose=verbose,
            timeouts=_timeouts(connect_timeout, first_token_timeout, chunk_timeout, request_timeout),
            labelled=backend_label is not None, sim_knobs=knobs,
        )
        if chosen_engine == "sim":
            label = ", ".join(["SIMULATED", *filter(None, [knobs_label(knobs.server_info())])])
            info.print(f"[yellow]engine: sim — every number below is {label} (no GPU, no model)[/]")
        if search is None:
            info.print(f"{len(specs)} backend(s) x {len(spec.points())} point(s) x {spec.repeats} repeat(s); "
                       f"estimated duration {_duration(estimated_seconds(spec, specs, opts))} "
                       f"({_pace(opts)})", highlight=False)  # Rich would colour '0x' of '10000x' as hex
        else:
            info.print(f"{len(specs)} backend(s) x {len(spec.input_len)} input length(s): goodput search of at most "
                       f"{search.most_probes} rate(s) each ({_pace(opts)})", highlight=False)
        try:
            run_ids = run_bench(spec, specs, opts, store, info, steps=search and search.steps,
                                most_steps=search and search.most_probes * len(spec.input_len))
        except RunInterrupted as exc:
            err_console.print(f"[yellow]{exc}[/]")
            raise typer.Exit(130) from None
        runs = store.get_runs(run_ids)
        info.print(f"stored runs {run_ids[0]}–{run_ids[-1]} in {store.path}")
        if any(r.status != "ok" for r in runs):
            raise UserError("some runs failed: see `mpfa runs` and `mpfa show RUN`", exit_code=1)
        ref = ref or default_reference(runs)
        if search is not None:
            from ..bench.goodput import goodput_json, goodput_table
            if output_format == "json":
                print(goodput_json(search), end="")
            else:
                console.print(goodput_table(search))
        elif output_format != "table":
            print(format_compare(runs, ref, output_format), end="")
        else:
            console.print(compare_table(runs, ref) if wide else compare_tables(runs, ref))


def _sim_knobs(slowdown: float, noise: str, seed: int) -> SimKnobs:
    """The simulator's CI-rehearsal knobs from `--sim-slowdown` and `--sim-noise` (seeded by the scenario's seed)."""
    try:
        return SimKnobs(slowdown, parse_fraction(noise, "--sim-noise"), seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _duration(seconds: float) -> str:
    return f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min"


def _pace(opts: BenchOptions) -> str:
    if opts.engine != "sim":
        return ("from the latency model of one H200" + ("; assumes ~90 s per SGLang server start" if opts.engine ==
                                                         "sglang" else "; the --url server's own speed may differ"))
    if opts.real_time:
        return "real time: requests timed on the client's clock"
    return (f"{1 / opts.time_scale:.0f}x faster than modelled; metrics in modelled time; "
            "--real-time for the modelled speed")


def _timeouts(connect: float, first_token: float, chunk: float, request: float) -> Timeouts:
    """The request timeouts from their flags (`first_token_s` is `--first-token-timeout`)."""
    try:
        return Timeouts(connect_s=connect, first_token_s=first_token, chunk_s=chunk, request_s=request)
    except BadTimeout as exc:
        flag = exc.field.removesuffix("_s").replace("_", "-")
        raise UserError(f"--{flag}-timeout: expected a positive number of seconds") from None


def _goodput_search(scenario: Scenario, slo: str | None, share: float, probes: int, output_format: str
                    ) -> GoodputSearch:
    """The search `--goodput-search` asks for, its flags checked."""
    from ..bench.goodput import MAX_PROBES, GoodputSearch

    if slo is None:
        raise UserError("--goodput-search needs --slo, e.g. --slo ttft=2s,tpot=50ms")
    if scenario.trace is not None:
        raise UserError("--goodput-search sweeps request rates; a trace replay sets its own send times")
    if not 0 < share <= 1:
        raise UserError(f"--goodput-share: expected a share in (0, 1], got {share:g}")
    if not 1 <= probes <= MAX_PROBES:
        raise UserError(f"--goodput-probes: expected an integer in [1, {MAX_PROBES}], got {probes}")
    if output_format not in ("table", "json"):
        raise UserError("--goodput-search prints its answer as a table or json")
    return GoodputSearch(scenario, _parse_slo(slo), share, probes)


_SLO_UNITS_MS = {"ms": 1.0, "s": 1000.0, "": 1.0}


def _parse_slo(text: str) -> dict[str, float]:
    """`ttft=2s,tpot=50ms` or `ttft=2000,tpot=50` (a bare number is ms) -> {"ttft": 2000.0, "tpot": 50.0}."""
    from ..results.metrics.per_request import SLO_KEYS

    slo: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        number, unit = re.fullmatch(r"\s*(.*?)\s*(ms|s|)\s*", value).groups()  # type: ignore[union-attr]
        try:
            slo[key.strip()] = float(number) * _SLO_UNITS_MS[unit]
        except ValueError:
            raise UserError(f"--slo: expected key=value pairs such as ttft=2s,tpot=50ms (a bare number is ms), "
                            f"got '{text}'") from None
        if key.strip() not in SLO_KEYS or not 0 < slo[key.strip()] < math.inf:
            raise UserError(f"--slo: '{part}' is not valid; keys: {', '.join(SLO_KEYS)}, values > 0 (ms or s)")
    return slo


@cli_errors
def serve_sim(
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 30000,
    host: Annotated[str, typer.Option(help="Address to serve on (keep it on loopback).")] = "127.0.0.1",
    backend: Annotated[str, typer.Option(help="Backend whose latency model and server info to simulate.")] = "fa4-bf16",
    model: Annotated[str, typer.Option(help="Bundled model config whose shape the latency model uses.")] = "llama-3.1-8b",
    time_scale: Annotated[float, typer.Option(help="Multiply every modelled time by this.")] = 1.0,
    prefill_kernel: Annotated[Optional[str], typer.Option("--mpfa-prefill-kernel", help="The MpFA prefill kernel it says it simulates, as the SGLang plugin's flag (fp8, exact, mma-sync).")] = None,
    startup_delay: Annotated[float, typer.Option(help="Seconds /health_generate answers 503 (tests readiness).")] = 0.0,
    die_after_requests: Annotated[Optional[int], typer.Option(help="Exit abruptly after this many completed requests (fault tests).")] = None,
    sim_slowdown: Annotated[float, typer.Option(metavar="X", help="Multiply every modelled step time by X (1.2: a 20% slower backend), for CI rehearsals; reported in /get_server_info.")] = 1.0,
    sim_noise: Annotated[str, typer.Option(metavar="PCT", help="Each load phase's (a bench repeat's) step times vary by this relative standard deviation, e.g. 3%.")] = "0%",
    sim_noise_seed: Annotated[int, typer.Option(metavar="N", help="Seed of --sim-noise: the same seed, the same variation.")] = 0,
    disable_radix_cache: Annotated[bool, typer.Option("--disable-radix-cache/--radix-cache", help="Model no prefix cache, as SGLang's flag (`mpfa bench` gives it unless the workload shares prefixes); the cache is on by default, as SGLang's.")] = False,
) -> None:
    """Serve SGLang's HTTP API on a deterministic latency model (every number it produces is simulated)."""
    from ..harness.engines import serving_backend
    from ..harness.server import is_loopback, port_free
    from ..harness.sim_server import run_sim_server

    if not is_loopback(host):
        err_console.print(f"warning: serving on {host}, reachable from other machines (--host 127.0.0.1 keeps it on "
                          "this one)", markup=False, highlight=False, soft_wrap=True)
    if not port_free(port, host):
        raise UserError(f"port {port} on {host} is already in use")
    serving_backend(backend)
    run_sim_server(host, port, backend, model=model, time_scale=time_scale, prefill_kernel=prefill_kernel,
                   startup_delay=startup_delay, die_after_requests=die_after_requests,
                   knobs=_sim_knobs(sim_slowdown, sim_noise, sim_noise_seed), radix_cache=not disable_radix_cache)
