"""`mpfa bench` (measure scenarios against backends) and `mpfa serve-sim` (the built-in simulated server)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .common import (DbOption, EngineOption, PortOption, PrefillKernelOption, ReadyTimeoutOption, RunDirOption,
                     ServerArgOption, cli_errors, console, err_console, number_list, open_store)
from ..errors import UserError
from ..harness.request_timeouts import BadTimeout, Timeouts

if TYPE_CHECKING:  # the bench itself is imported when the command runs
    from ..bench.runner import BenchOptions

DEFAULT_TIMEOUTS = Timeouts()

SIM_TIME_SCALE = 1e-4  # the simulator runs 10000x faster than modelled unless asked otherwise
SIM_BACKENDS = "fa4-bf16,flashinfer-fp8,mpfa"  # bench's default backends on the simulator
SERVER_BACKENDS = "fa4-bf16,flashinfer-fp8"  # and on SGLang or a --url server


@cli_errors
def bench(
    scenario: Annotated[str, typer.Option("--scenario", "-s", help="Scenario name or .toml path (see `mpfa scenarios`).")] = "smoke",
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", help=f"Comma-separated backends (see `mpfa backends`; default: {SIM_BACKENDS} on the simulator, {SERVER_BACKENDS} on a server).")] = None,
    engine: EngineOption = "auto",
    url: Annotated[Optional[str], typer.Option(help="Benchmark a server someone else started; its /get_server_info must confirm --backend.")] = None,
    backend_label: Annotated[Optional[str], typer.Option("--backend-label", help="With --url, instead of --backend: the backend to store the runs under, unchecked (for servers that report none).")] = None,
    api: Annotated[str, typer.Option(help="With --url: sglang (native /generate), openai (/v1/completions) or openai-chat (/v1/chat/completions: the prompt's token ids go as text, in decimal; the server's own prompt count is stored).")] = "sglang",
    model: Annotated[Optional[str], typer.Option(help="Bundled config name (dummy weights) or a model directory.")] = None,
    concurrency: Annotated[Optional[str], typer.Option(help="Override: comma-separated concurrency list.")] = None,
    rate: Annotated[Optional[str], typer.Option(help="Override: comma-separated request rates (req/s).")] = None,
    input_len: Annotated[Optional[str], typer.Option("--input-len", help="Override: comma-separated input lengths.")] = None,
    points: Annotated[Optional[str], typer.Option("--points", help="Only these points, e.g. 128K:c=1,64K:c=8 (see `mpfa scenarios`).")] = None,
    output_len: Annotated[Optional[int], typer.Option("--output-len", help="Override: output tokens per request.")] = None,
    num_requests: Annotated[Optional[int], typer.Option("--num-requests", help="Override: measured requests per point and repeat.")] = None,
    warmup_requests: Annotated[Optional[int], typer.Option("--warmup-requests", help="Override: unmeasured requests each server gets before the first repeat at each input length.")] = None,
    repeats: Annotated[Optional[int], typer.Option(help="Override: repeats of every point.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Override: seed of the prompts' token ids.")] = None,
    slo: Annotated[Optional[str], typer.Option(help="Goodput SLO in ms, e.g. ttft=2000,tpot=50: each run's summary adds goodput, the requests per second that met every bound given.")] = None,
    prefill_kernel: PrefillKernelOption = None,
    port: PortOption = None,
    tp: Annotated[int, typer.Option(help="SGLang tensor parallelism.")] = 1,
    dp: Annotated[int, typer.Option(help="SGLang data parallelism.")] = 1,
    time_scale: Annotated[float, typer.Option(help="Simulator only: wall seconds per modelled second (metrics are in modelled time at any value).")] = SIM_TIME_SCALE,
    real_time: Annotated[bool, typer.Option("--real-time/--no-real-time", help="Simulator only: run at the modelled speed and time requests on the client's clock.")] = False,
    ready_timeout: ReadyTimeoutOption = None,
    server_arg: ServerArgOption = None,
    run_dir: RunDirOption = None,
    db: DbOption = None,
    wide: Annotated[bool, typer.Option("--wide/--narrow", help="One flat table of every point (needs ~140+ columns).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose/--quiet", "-v", help="Progress of every step's requests too, not only the overall one.")] = False,
    output_format: Annotated[str, typer.Option("--format", help="The summary as a table, json, csv or md (Markdown); json/csv/md go to stdout, the rest to stderr.")] = "table",
    connect_timeout: Annotated[float, typer.Option(help="Seconds a request may take to connect.")] = DEFAULT_TIMEOUTS.connect_s,
    first_token_timeout: Annotated[float, typer.Option(help="Seconds from a request's dispatch to its first streamed bytes.")] = DEFAULT_TIMEOUTS.first_token_s,
    chunk_timeout: Annotated[float, typer.Option(help="Seconds of silence tolerated between a stream's chunks.")] = DEFAULT_TIMEOUTS.chunk_s,
    request_timeout: Annotated[float, typer.Option(help="Seconds a whole request may take; a request over any timeout fails with the reason.")] = DEFAULT_TIMEOUTS.request_s,
) -> None:
    """Run a scenario against one or more backends and store every request and the kernels each server ran."""
    from ..bench.runner import BenchOptions, RunInterrupted, estimated_seconds, run_bench
    from ..harness.client import APIS
    from ..harness.engines import resolve_backends, resolve_engine
    from ..reports.tables import check_format, compare_table, compare_tables, format_compare
    from ..harness.scenario import load_scenario
    from ..harness.served_kernels import check_prefill_kernel

    overrides = {
        "model": model, "output_len": output_len, "num_requests": num_requests,
        "warmup_requests": warmup_requests, "repeats": repeats, "seed": seed,
        "concurrency": number_list(concurrency, "--concurrency"), "rate": number_list(rate, "--rate", float),
        "input_len": number_list(input_len, "--input-len"),
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
    chosen_engine = resolve_engine(engine, url)
    specs = resolve_backends(backend or (SIM_BACKENDS if chosen_engine == "sim" else SERVER_BACKENDS), chosen_engine)
    if chosen_engine != "sglang" and (tp, dp) != (1, 1):
        raise UserError("--tp/--dp apply to the sglang engine only")
    with open_store(db) as store:
        opts = BenchOptions(
            engine=chosen_engine, run_dir=run_dir or store.path.parent / "runs", url=url, api=api, port=port,
            time_scale=1.0 if real_time else time_scale, real_time=real_time, ready_timeout_s=ready_timeout, tp=tp, dp=dp, server_args=list(server_arg or []),
            slo=_parse_slo(slo) if slo else None,
            prefill_kernel=check_prefill_kernel(prefill_kernel), verbose=verbose,
            timeouts=_timeouts(connect_timeout, first_token_timeout, chunk_timeout, request_timeout),
            labelled=backend_label is not None,
        )
        if chosen_engine == "sim":
            info.print("[yellow]engine: sim — every number below is SIMULATED (no GPU, no model)[/]")
        info.print(f"{len(specs)} backend(s) x {len(spec.points())} point(s) x {spec.repeats} repeat(s); "
                      f"estimated duration {_duration(estimated_seconds(spec, specs, opts))} "
                      f"({_pace(opts)})", highlight=False)  # Rich would colour '0x' of '10000x' as hex
        try:
            run_ids = run_bench(spec, specs, opts, store, info)
        except RunInterrupted as exc:
            err_console.print(f"[yellow]{exc}[/]")
            raise typer.Exit(130) from None
        runs = store.get_runs(run_ids)
        info.print(f"stored runs {run_ids[0]}–{run_ids[-1]} in {store.path}")
        if any(r.status != "ok" for r in runs):
            raise UserError("some runs failed: see `mpfa runs` and `mpfa show RUN`", exit_code=1)
        if output_format != "table":
            print(format_compare(runs, specs[0].name, output_format), end="")
        else:
            console.print(compare_table(runs, specs[0].name) if wide else compare_tables(runs, specs[0].name))


def _duration(seconds: float) -> str:
    return f"~{seconds:.0f} s" if seconds < 120 else f"~{seconds / 60:.0f} min"


def _pace(opts: BenchOptions) -> str:
    if opts.engine != "sim":
        return "from the latency model of one H200; the server's start is a guess"
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


def _parse_slo(text: str) -> dict[str, float]:
    """`ttft=2000,tpot=50` (milliseconds) -> {"ttft": 2000.0, "tpot": 50.0}."""
    from ..results.metrics.per_request import SLO_KEYS

    slo: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            slo[key.strip()] = float(value)
        except ValueError:
            raise UserError(f"--slo: expected key=milliseconds pairs such as ttft=2000,tpot=50, got '{text}'") from None
        if key.strip() not in SLO_KEYS or slo[key.strip()] <= 0:
            raise UserError(f"--slo: '{part}' is not valid; keys: {', '.join(SLO_KEYS)}, values > 0 ms")
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
                   radix_cache=not disable_radix_cache)
