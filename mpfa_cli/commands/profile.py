"""`mpfa profile`: attention kernels side by side at one shape or over several, the fp8 prefill kernel's ablation
ladder, a serving run's GPU-time breakdown (these need a GPU), Nsight Compute pages read back, and the load
client's own overhead."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .common import DbOption, cli_errors, console, open_store, progress_line
from ..errors import ProfileError, ToolError, UserError
from ..results.store import ResultStore

profile_app = typer.Typer(help="Profile attention kernels, a serving run's GPU time, or the load client.",
                          no_args_is_help=True)

KERNEL_BACKENDS = "fa3-fp8,fa4-bf16,flashinfer-fp8,mpfa"
SWEEP_BACKENDS = "mpfa,fa3-fp8,flashinfer-fp8,fa4-bf16"
SWEEP_DEFAULTS = {"prefill": ("16k,64k", "1"), "decode": ("8192,32768,131072", "1,8")}  # kind -> (--seq, --batch)
SWEEP_SEQ_DEFAULTS = "; ".join(f"{kind} {seq}" for kind, (seq, _) in SWEEP_DEFAULTS.items())  # for the help
SWEEP_BATCH_DEFAULTS = "; ".join(f"{kind} {batch}" for kind, (_, batch) in SWEEP_DEFAULTS.items())

SeqOption = Annotated[str, typer.Option(help="Prompt length (prefill) or KV length (decode), e.g. 64k.")]
BatchOption = Annotated[int, typer.Option(help="Requests in the batch.")]
HeadsOption = Annotated[str, typer.Option(help="Query:KV heads.")]
OutOption = Annotated[Path, typer.Option(help="Directory for raw results (JSON, ncu CSV, traces).")]


def _report_console() -> Console:
    """The console for a report: the terminal's width, or `LOG_WIDTH` columns when stdout is a file or a pipe (where
    80 columns would fold its tables)."""
    from ...profiles.profile_sections import LOG_WIDTH

    return console if sys.stdout.isatty() else Console(width=LOG_WIDTH)


def _kernel_profile(kind: str) -> Callable[..., None]:
    """The `mpfa profile prefill` or `mpfa profile decode` command."""

    @cli_errors
    def command(
        seq: SeqOption = "64k",
        batch: BatchOption = 1,
        heads: HeadsOption = "32:8",
        head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension, a multiple of 16 (the MpFA kernels are built for 128 only; another value fails their rows).")] = 128,
        backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends.")] = KERNEL_BACKENDS,
        ncu: Annotated[bool, typer.Option("--ncu/--no-ncu", help="Also profile each kernel with Nsight Compute.")] = False,
        ncu_full: Annotated[bool, typer.Option("--ncu-full/--no-ncu-full", help="Also run Nsight Compute's full set per kernel: what bounds it (issue, occupancy, bank conflicts) and where its warps wait (stall samples per hot loop).")] = False,
        nsys: Annotated[bool, typer.Option("--nsys/--no-nsys", help="Also trace (Nsight Systems, else the PyTorch profiler).")] = False,
        out: OutOption = Path("mpfa-profiles"),
        db: DbOption = None,
    ) -> None:
        from ...profiles.attention_workload import parse_heads, parse_seq
        from ...profiles.microbench import run_profile
        from ...profiles.profile_sections import render_profile
        from ...profiles.registry import parse_backends

        with _profile_errors():
            result = run_profile(kind, parse_seq(seq), batch, parse_heads(heads), head_dim, parse_backends(backend),
                                 ncu, nsys, out, progress=progress_line, ncu_full=ncu_full)
        render_profile(result, _report_console())
        with open_store(db) as store:
            _store_profile(store, kind, result.device, asdict(result.workload), result.to_json())

    return command


profile_app.command("prefill", help="Time each backend's prefill kernel at one shape (GPU).")(
    _kernel_profile("prefill"))
profile_app.command("decode", help="Time each backend's decode kernel at one shape (GPU).")(_kernel_profile("decode"))


@profile_app.command("characterize")
@cli_errors
def characterize(
    seq: Annotated[str, typer.Option(help="Prompt length, e.g. 64k.")] = "64k",
    batch: BatchOption = 1,
    heads: HeadsOption = "32:8",
    out: OutOption = Path("mpfa-profiles"),
    db: DbOption = None,
) -> None:
    """The fp8 prefill kernel's ablation ladder (GPU).

    Where its time goes (paper Fig. 3): compile-time ablations of exp2, the row
    statistics, PV and the ΔS compensation at head dim 128, with FA4-BF16 and
    FlashInfer-FP8 as context.
    """
    from ...profiles.attention_workload import parse_heads, parse_seq
    from ...profiles.characterize import render_characterize, run_characterize

    with _profile_errors():
        result = run_characterize(parse_seq(seq), batch, parse_heads(heads), out_dir=out, progress=progress_line)
    render_characterize(result, _report_console())
    with open_store(db) as store:
        _store_profile(store, "characterize", result.device, asdict(result.workload), result.to_json())


@profile_app.command("sweep")
@cli_errors
def sweep(
    kind: Annotated[str, typer.Argument(help="prefill or decode.")],
    seq: Annotated[Optional[str], typer.Option(help=f"Comma-separated prompt (prefill) or KV (decode) lengths, e.g. 8k,128k (default: {SWEEP_SEQ_DEFAULTS}).")] = None,
    batch: Annotated[Optional[str], typer.Option(help=f"Comma-separated batch sizes (default: {SWEEP_BATCH_DEFAULTS}).")] = None,
    heads: HeadsOption = "32:8",
    backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends.")] = SWEEP_BACKENDS,
) -> None:
    """Kernel timings over several shapes in one table (GPU).

    Each backend's median time at every (length, batch), head dim 128.
    Prefill: TFLOP/s of the causal matmuls and the speedups over FA3-FP8
    (paged and contiguous) and FA4-BF16. Decode: the bytes read, their rate
    against the copy bandwidth measured in the same run, and the speedups over
    FA3-FP8 and FlashInfer-FP8.
    """
    from .common import number_list
    from ...profiles.attention_workload import parse_heads, parse_seq
    from ...profiles.bench_kernels import run_bench
    from ...profiles.registry import parse_backends

    if kind not in SWEEP_DEFAULTS:
        raise UserError(f"unknown sweep kind '{kind}'; valid: {', '.join(SWEEP_DEFAULTS)}")
    batches = number_list(batch or SWEEP_DEFAULTS[kind][1], "--batch")
    if any(b <= 0 for b in batches):
        raise UserError(f"--batch: batch sizes must be positive, got {batch}")
    with _profile_errors():
        seqs = [parse_seq(part) for part in (seq or SWEEP_DEFAULTS[kind][0]).split(",")]
        table = run_bench(kind, seqs, batches, parse_heads(heads), parse_backends(backend), progress_line)
    print(table)


@profile_app.command("serving")
@cli_errors
def serving(
    backend: Annotated[str, typer.Option("--backend", "-b", help="The one backend to serve and profile (with --url: the backend that server runs).")],
    seq: Annotated[str, typer.Option(help="Prompt tokens per request, e.g. 8k.")] = "64k",
    batch: Annotated[int, typer.Option(help="Prompts sent at once.")] = 1,
    steps: Annotated[int, typer.Option(help="Forward steps each profile window records.")] = 8,
    url: Annotated[Optional[str], typer.Option(help="Profile a server someone else started on this machine.")] = None,
    model: Annotated[str, typer.Option(help="Bundled config name or model directory.")] = "llama-3.1-8b",
    trim_events: Annotated[int, typer.Option("--trim-events", help="Also write each trace trimmed to this many GPU events, to commit as a test fixture (0: none; 1000 holds a few decode steps of an 8B model, tens of KB).")] = 0,
    out: OutOption = Path("mpfa-profiles"),
    db: DbOption = None,
) -> None:
    """A serving run's GPU time by kernel category (GPU).

    Launches SGLang for the backend (or uses --url), records a prefill and a
    decode window with SGLang's torch profiler and stores where the GPU time
    of each goes (paper Fig. 1).
    """
    from ..bench.runner import BenchOptions, progress_bar, served
    from ..harness.engines import gpu_label, resolve_backends, resolve_engine
    from ...profiles.attention_workload import parse_seq
    from ...profiles.serving import profile_serving, trim_for_fixture
    from ...profiles.serving_report import render_serving

    if "," in backend:
        raise UserError("profile serving takes one backend")
    if trim_events < 0:
        raise UserError(f"--trim-events must be >= 0, got {trim_events}")
    with _profile_errors():
        input_len = parse_seq(seq)
    engine = resolve_engine("sglang", url)
    (spec,) = resolve_backends(backend, engine)
    opts = BenchOptions(engine=engine, run_dir=out, url=url)
    with open_store(db) as store:  # a database that cannot be used fails before the server starts
        with _profile_errors(), progress_bar(console) as progress, served(
            spec, model, input_len + steps + 64, opts, progress
        ) as (server_url, _, _):
            result = profile_serving(server_url, input_len, batch, steps, out, progress=progress_line)
            trimmed = trim_for_fixture(result, trim_events) if trim_events else []
        render_serving(result, _report_console())
        for path in trimmed:
            console.print(f"trimmed trace: {path} ({path.stat().st_size / 1e3:.0f} KB)", highlight=False)
        params = {"backend": spec.name, "input_len": input_len, "batch": batch, "steps": steps,
                  "server": result.server}
        _store_profile(store, "serving", gpu_label(), params, result.to_json())


@profile_app.command("ncu-details")
@cli_errors
def ncu_details(files: Annotated[list[Path], typer.Argument(metavar="FILE", help="ncu --set full --csv --page details output.")]) -> None:
    """What bounds each kernel, from an ncu details page.

    Per profiled kernel: issue-slot use, occupancy and what limits it, memory
    throughput per level, bank conflicts (what `mpfa profile prefill
    --ncu-full` prints for the kernels it profiles).
    """
    from ...profiles.ncu_details import parse_details, summary_section
    from ...profiles.profile_sections import render_sections

    sections = []
    for path in files:
        with _reading(path):
            sections += [summary_section(details) for details in parse_details(path.read_text(errors="replace"))]
    render_sections(sections, _report_console())


@profile_app.command("ncu-source")
@cli_errors
def ncu_source(files: Annotated[list[Path], typer.Argument(metavar="FILE", help="ncu --csv --page source --print-source sass output, plain or .gz.")]) -> None:
    """Where each kernel's warps wait, from an ncu source page.

    Per kernel: its hot loops (found by their backward branches), their stall
    reasons, what their scoreboard stalls wait on and their hottest
    instructions.
    """
    from ...profiles.ncu_source import hot_loops, parse_source_csv, read_text
    from ...profiles.profile_result import NcuFullResult
    from ...profiles.profile_sections import ncu_source_section, render_sections

    results = []
    for path in files:
        with _reading(path):
            pages = parse_source_csv(read_text(path))
            results.append(NcuFullResult(path.name, [], loops=[hot_loops(page) for page in pages]))
    render_sections([ncu_source_section(results)], _report_console())


@profile_app.command("client-overhead")
@cli_errors
def client_overhead(
    streams: Annotated[int, typer.Option(help="Concurrent streams.")] = 512,
    requests: Annotated[int, typer.Option(help="Requests per run (at least --streams).")] = 1024,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens per request.")] = 256,
    output_len: Annotated[int, typer.Option("--output-len", help="Output tokens per request.")] = 64,
    backend: Annotated[str, typer.Option(help="Backend whose latency model the simulator serves.")] = "fa4-bf16",
    time_scale: Annotated[float, typer.Option(help="Simulator time scale (1: the modelled H200).")] = 1.0,
    incremental: Annotated[bool, typer.Option("--incremental/--cumulative", help="The simulator streams only the new token ids per chunk (else all so far).")] = False,
    plain_asyncio: Annotated[bool, typer.Option("--plain-asyncio/--uvloop", help="Run the client on asyncio's own event loop, not uvloop.")] = False,
    runs: Annotated[int, typer.Option(help="Repeat the whole measurement on fresh simulators.")] = 1,
    reference: Annotated[bool, typer.Option("--reference/--no-reference", help="Also run a minimal reader: the floor this host sets.")] = False,
    realtime: Annotated[bool, typer.Option("--realtime/--no-realtime", help="Run client and simulator under SCHED_FIFO (root or CAP_SYS_NICE).")] = False,
) -> None:
    """What the load client itself adds to TTFT and ITL.

    Runs the client against the simulator (its own process, tracing when it
    sends each chunk) and reports per token the lag from the simulator's send
    to the client's stamp, the closed loop's refill delay, and whether the p99
    targets (TTFT lag < 1 ms, refill < 5 ms at 512 streams) were met.
    """
    from ...profiles.bench_client_overhead import OverheadOptions, report

    report(OverheadOptions(streams=streams, requests=requests, input_len=input_len, output_len=output_len,
                           backend=backend, time_scale=time_scale, incremental=incremental,
                           plain_asyncio=plain_asyncio, runs=runs, reference=reference, realtime=realtime))


@contextmanager
def _profile_errors() -> Iterator[None]:
    """A bad argument (ValueError) or a profile that cannot run here (ProfileError) as a one-line error."""
    try:
        yield
    except (ValueError, ProfileError) as exc:
        raise UserError(str(exc)) from None


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """An unreadable (or truncated .gz) file or one that is not the page asked for, as a one-line error."""
    try:
        yield
    except (OSError, EOFError) as exc:
        raise UserError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except ToolError as exc:
        raise UserError(f"{path}: {exc}") from None


def _store_profile(store: ResultStore, kind: str, gpu: str, params: dict, result: dict) -> None:
    profile_id = store.add_profile(kind, gpu, params, result)
    console.print(f"stored profile {profile_id} in {store.path}")
