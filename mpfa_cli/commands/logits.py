"""`mpfa logits`: do backends compute the same model? Prompt and greedy-output logprobs against a reference backend,
optionally checked against the CPU prediction of each backend's attention numerics."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (DbOption, EngineOption, PortOption, PrefillKernelOption, ReadyTimeoutOption, RunDirOption,
                     ServerArgOption, TimeScaleOption, UrlsOption, cli_errors, console, number_list, open_store)
from ..errors import UserError


@cli_errors
def logits(
    backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends (the reference runs first).")] = "fa4-bf16,flashinfer-fp8,mpfa-direct,mpfa",
    ref: Annotated[str, typer.Option("--ref", help="Reference backend (added to --backend if missing).")] = "fa4-bf16",
    input_len: Annotated[str, typer.Option("--input-len", help="Comma-separated prompt lengths.")] = "512,4096",
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts per input length.")] = 4,
    output_len: Annotated[int, typer.Option("--output-len", help="Greedy output tokens per prompt.")] = 16,
    seed: Annotated[int, typer.Option(help="Prompt seed; on SGLang also --random-seed for every server.")] = 0,
    model: Annotated[str, typer.Option(help="Bundled config name (dummy weights) or a model directory.")] = "llama-3.1-8b",
    engine: EngineOption = "auto",
    url: UrlsOption = None,
    max_mean_abs_dlogprob: Annotated[Optional[float], typer.Option("--max-mean-abs-dlogprob", help="Exit 1 when a backend's prefill or decode mean |Δ logprob| exceeds this.")] = None,
    predicted: Annotated[Optional[Path], typer.Option("--predicted", help="CPU prediction (`mpfa accuracy predict-logits --json`): exit 1 when a backend's prompt mean |Δ logprob| is not within --predicted-factor of it.")] = None,
    predicted_factor: Annotated[float, typer.Option("--predicted-factor", help="With --predicted: the ratio of measured to predicted mean |Δ logprob| allowed either way (> 1; 1.5 passes 0.67x-1.5x).")] = 1.5,
    prefill_kernel: PrefillKernelOption = None,
    port: PortOption = None,
    time_scale: TimeScaleOption = 1.0,
    ready_timeout: ReadyTimeoutOption = None,
    server_arg: ServerArgOption = None,
    run_dir: RunDirOption = None,
    db: DbOption = None,
) -> None:
    """Do backends compute the same model? Prompt (prefill) and greedy output (decode) logprobs vs a reference."""
    from .side_by_side import options_per_backend, served_backends
    from ..harness.engines import gpu_label, resolve_backends
    from ..accuracy.logits import render, run_logits, workload_params
    from ..accuracy.logits_check import check_against_prediction, load_prediction, render_checks, served_numerics
    from ..harness.served_kernels import check_prefill_kernel

    lengths = number_list(input_len, "--input-len")
    if any(n < 2 for n in lengths):
        raise UserError("--input-len: every length must be >= 2 (position 0 has no logprob)")
    if prompts < 1 or output_len < 1:
        raise UserError("--prompts and --output-len must be >= 1")
    if predicted_factor <= 1:
        raise UserError(f"--predicted-factor must be > 1, got {predicted_factor}")
    prefill_kernel = check_prefill_kernel(prefill_kernel)
    prediction = load_prediction(predicted) if predicted is not None else None  # a bad file fails before any server
    chosen_engine, names, url_of = served_backends(backend, ref, url, engine, ref_with_urls=True)
    ordered = [ref] + [n for n in names if n != ref]
    specs = resolve_backends(",".join(ordered), chosen_engine)
    if len(specs) < 2:
        raise UserError("give at least one backend besides the reference")
    numerics = served_numerics(specs, model, prefill_kernel)  # a kernel the model does not take fails here
    extra = list(server_arg or [])
    if chosen_engine == "sglang" and "--random-seed" not in extra:
        extra += ["--random-seed", str(seed)]  # dummy weights are seeded by SGLang itself (1234); this fixes the rest

    with open_store(db) as store:
        options_for = options_per_backend(chosen_engine, url_of, run_dir or store.path.parent / "runs", port,
                                          time_scale, ready_timeout, extra, prefill_kernel)
        if chosen_engine == "sim":
            console.print("[yellow]engine: sim — every number below is SIMULATED (hash values, not a model)[/]")
        result = run_logits(specs, ref, lengths, prompts, output_len, seed, model, options_for, console)
        render(result, console)
        if predicted is not None:
            checks = check_against_prediction(result, prediction, numerics)
            render_checks(checks, predicted_factor, console)
        gpu = gpu_label(result.simulated)
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
