"""What there is to run: `mpfa backends` (with the kernels each runs), `mpfa scenarios` and `mpfa metrics`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from .common import PrefillKernelOption, cli_errors, console

if TYPE_CHECKING:
    from ..results.metrics.registry import Metric


@cli_errors
def backends(
    model: Annotated[str, typer.Option(help="The served model whose heads choose MpFA's prefill kernel: bundled config name or model directory.")] = "llama-3.1-8b",
    prefill_kernel: PrefillKernelOption = None,
) -> None:
    """List the backends, the kernels each runs for the model, and whether each can run on SGLang here; then the
    kernel-bench-only variants (`mpfa profile prefill|decode`)."""
    from rich.table import Table

    from ...backends.specs import BACKENDS, KERNEL_VARIANTS
    from ..reports.tables import folding
    from ..harness.scenario import load_model_shape
    from ..harness.served_kernels import check_prefill_kernel, describe_kernels, launch_page_size, served_kernels

    prefill_kernel = check_prefill_kernel(prefill_kernel)
    shape = load_model_shape(model)
    table = Table(title=f"Attention backends — kernels for {shape.name} ({shape.q_heads}:{shape.kv_heads} heads)",
                  caption="MpFA's prefill kernel: fp8 where the shape takes it, else mma-sync; override: "
                          "--prefill-kernel or $MPFA_PREFILL_KERNEL (fp8, exact, mma-sync)")
    for col in ("name", "description", "kernels", "SGLang flags", "on this machine"):
        table.add_column(col)
    for spec in BACKENDS.values():
        missing = spec.missing()
        if spec.plugin and spec.plugin in missing:
            state = "[red]not built yet[/] (MpFA SGLang plugin); sim engine only"
        elif missing:
            state = f"[yellow]sim only[/] (missing {', '.join(missing)})"
        else:
            state = "[green]available[/]"
        kernels = served_kernels(spec, shape.q_heads, shape.kv_heads, launch_page_size(spec), prefill_kernel)
        table.add_row(spec.name, spec.description, describe_kernels(kernels), " ".join(spec.sglang_args), state)
    console.print(folding(table))
    variants = Table(title="Kernel-bench variants — mpfa profile prefill|decode only; no server runs them")
    for col in ("name", "description", "its kernels served by"):
        variants.add_column(col)
    for variant in KERNEL_VARIANTS.values():
        served_by = f"mpfa bench {variant.serve_as}" if variant.serve_as else "-"
        variants.add_row(variant.name, variant.description, served_by)
    console.print(folding(variants))


@cli_errors
def scenarios() -> None:
    """List the bundled scenarios."""
    from rich.table import Table

    from ..reports.tables import folding, plain
    from ..harness.scenario import available_scenarios, load_scenario

    table = Table(title="Scenarios")
    for col in ("name", "model", "points", "output", "requests", "repeats", "description"):
        table.add_column(col)
    for name in available_scenarios():
        s = load_scenario(name)
        table.add_row(plain(name), plain(s.model), ", ".join(p.label for p in s.points()), str(s.output_len),
                      "/".join(sorted({str(p.num_requests) for p in s.points()}, key=int)), str(s.repeats),
                      plain(s.description))
    console.print(folding(table))


@cli_errors
def metrics(explain: Annotated[bool, typer.Option("--explain/--no-explain", help="Print each metric's definition.")] = False) -> None:
    """Explain the metrics every run reports."""
    from ..results.metrics import registry
    from ..results.metrics.serving import GLOSSARY

    if not explain:
        console.print("metrics: " + ", ".join([*registry.METRICS, *GLOSSARY]) + "  (use --explain for definitions)")
        return
    for metric in registry.METRICS.values():
        console.print(f"[bold]{metric.name}[/] ({_declared(metric)}): {metric.explanation}")
    for term, text in GLOSSARY.items():
        console.print(f"[bold]{term}[/]: {text}")
    stats = ", ".join(s.name if s.label == s.name else f"{s.name} (printed {s.label})"
                      for s in registry.STATS.values())
    compared = [registry.column(key) for key in registry.shown_in(registry.Report.COMPARE)]
    console.print(f"[bold]column names[/]: a distribution's columns are <metric>_<unit>_<stat> (ttft_ms_p99), stat "
                  f"one of {stats}; tables print " + ", ".join(f"{c.label} for {c.key}" for c in compared) + ".")


def _declared(metric: Metric) -> str:
    """'ms; lower is better', with the column's key where it is not the metric's name."""
    columns = metric.columns()
    key = f"{columns[0].key}; " if len(columns) == 1 and columns[0].key != metric.name else ""
    return key + metric.unit + (f"; {metric.better} is better" if metric.better else "")
