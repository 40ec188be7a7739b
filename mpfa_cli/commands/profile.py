"""`mpfa profile`: attention kernels side by side at one shape, the fp8 prefill kernel's ablation ladder, or a
serving run's GPU-time breakdown (needs a GPU)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import DbOption, cli_errors, console, open_store, progress_line
from ..errors import ProfileError, UserError
from ..results.store import ResultStore

PROFILE_KINDS = ("prefill", "decode", "serving", "characterize")


@cli_errors
def profile(
    kind: Annotated[str, typer.Argument(help="prefill, decode (kernel microbenchmarks), serving (a live server's kernel breakdown) or characterize (where the fp8 prefill kernel's time goes: compile-time ablations).")],
    seq: Annotated[str, typer.Option(help="Prompt length (prefill, serving) or KV length (decode), e.g. 64k.")] = "64k",
    batch: Annotated[int, typer.Option(help="Requests in the batch.")] = 1,
    heads: Annotated[str, typer.Option(help="Query:KV heads.")] = "32:8",
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension of the attention shape.")] = 128,
    backend: Annotated[str, typer.Option("--backend", "-b", help="Comma-separated backends (serving: one).")] = "fa3-fp8,fa4-bf16,flashinfer-fp8,mpfa",
    ncu: Annotated[bool, typer.Option("--ncu/--no-ncu", help="Also profile each kernel with Nsight Compute.")] = False,
    ncu_full: Annotated[bool, typer.Option("--ncu-full/--no-ncu-full", help="Also run Nsight Compute's full set per kernel: what bounds it (issue, occupancy, bank conflicts) and where its warps wait (stall samples per hot loop).")] = False,
    nsys: Annotated[bool, typer.Option("--nsys/--no-nsys", help="Also trace (Nsight Systems, else the PyTorch profiler).")] = False,
    steps: Annotated[int, typer.Option(help="serving: scheduler steps in each profile window.")] = 8,
    url: Annotated[Optional[str], typer.Option(help="serving: profile a server someone else started.")] = None,
    model: Annotated[str, typer.Option(help="serving: bundled config name or model directory.")] = "llama-3.1-8b",
    out: Annotated[Path, typer.Option(help="Directory for raw results (JSON, ncu CSV, traces).")] = Path("mpfa-profiles"),
    db: DbOption = None,
) -> None:
    """Profile attention: kernels side by side at one shape, or a serving run's GPU-time breakdown (needs a GPU)."""
    from ...profiles.attention_workload import parse_heads, parse_seq

    if kind not in PROFILE_KINDS:
        raise UserError(f"unknown profile kind '{kind}'; valid: {', '.join(PROFILE_KINDS)}")
    try:
        length = parse_seq(seq)
        if kind == "characterize":
            _profile_characterize(length, batch, parse_heads(heads), head_dim, out, db)
            return
        if kind == "serving":
            _profile_serving(length, batch, steps, backend, url, model, out, db)
            return
        from ...profiles.microbench import run_profile
        from ...profiles.profile_sections import render_profile
        from ...profiles.registry import parse_backends

        result = run_profile(kind, length, batch, parse_heads(heads), head_dim, parse_backends(backend), ncu, nsys,
                             out, progress=progress_line, ncu_full=ncu_full)
    except (ValueError, ProfileError) as exc:
        raise UserError(str(exc)) from None
    render_profile(result, console)
    with open_store(db) as store:
        _store_profile(store, kind, result.device, asdict(result.workload), result.to_json())


def _store_profile(store: ResultStore, kind: str, gpu: str, params: dict, result: dict) -> None:
    profile_id = store.add_profile(kind, gpu, params, result)
    console.print(f"stored profile {profile_id} in {store.path}")


def _profile_characterize(seq: int, batch: int, heads: tuple[int, int], head_dim: int, out: Path,
                          db: Path | None) -> None:
    """The fp8 prefill kernel's ablation ladder (paper Fig. 3) with FA4-BF16 and FlashInfer-FP8 as context."""
    from ...profiles.characterize import render_characterize, run_characterize

    result = run_characterize(seq, batch, heads, head_dim, out, progress=progress_line)
    render_characterize(result, console)
    with open_store(db) as store:
        _store_profile(store, "characterize", result.device, asdict(result.workload), result.to_json())


def _profile_serving(
    input_len: int, batch: int, steps: int, backend: str, url: str | None, model: str, out: Path, db: Path | None
) -> None:
    """Launch SGLang for one backend (or use --url), profile a prefill and a decode window, store the breakdown."""
    from ..bench.runner import BenchOptions, progress_bar, served
    from ..harness.engines import gpu_label, resolve_backends, resolve_engine
    from ...profiles.serving import profile_serving
    from ...profiles.serving_report import render_serving

    if "," in backend:
        raise UserError("profile serving takes one backend")
    engine = resolve_engine("sglang", url)
    (spec,) = resolve_backends(backend, engine)
    opts = BenchOptions(engine=engine, run_dir=out, url=url)
    with open_store(db) as store:  # a database that cannot be used fails before the server starts
        with progress_bar(console) as progress, served(spec, model, input_len + steps + 64, opts, progress) as (
            server_url, _, _,
        ):
            result = profile_serving(server_url, input_len, batch, steps, out, progress=progress_line)
        render_serving(result, console)
        gpu = gpu_label()
        params = {"backend": spec.name, "input_len": input_len, "batch": batch, "steps": steps,
                  "server": result.server}
        _store_profile(store, "serving", gpu, params, result.to_json())
