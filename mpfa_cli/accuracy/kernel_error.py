"""Kernel-level accuracy of the attention variants on real model activations.

For each captured layer, every variant of `mpfa.kernels.attention` runs causal prefill attention on the layer's
real Q/K/V, and its output is compared with the float64 reference on the same (BF16) inputs: the relative L2
error ``||O - O_ref||_F / ||O_ref||_F`` per layer and KV-head group (the query heads that share one KV head).
The recovery is the share of the unsmoothed ``qk4-pv8-direct`` error that MpFA's centering removes,
``(err_direct - err_mpfa) / err_direct``.

The NVFP4 scale report answers whether real Q/K need NVFP4's per-tensor FP32 global scale: without it the block
scale ``amax / 6`` must fit e4m3 (overflow above 448 is an error; scales below 2**-6 are subnormal and coarser,
at or below 2**-10 the block flushes to zero). It gives the block-scale range of the operands the kernels
quantize (raw for `qk4-pv8-direct`, centered for the smoothing variants) and the operand error with and without
the global scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .capture import ALL_LAYERS, ActivationSet, LayerQKV, capture_qkv
from ...kernels.formats import (E2M1_MAX, E4M3_MAX, NVFP4_BLOCK, FormatError, e4m3_amax_scale, fake_quant_nvfp4,
                                nvfp4_global_scale)
from .models import MODELS
from ...kernels.reference import CALIBRATED, VARIANTS, attention, attention_float64
from ...kernels.smoothing import center, sequence_means

DEFAULT_VARIANTS = ("bf16", "fp8", "qk4-pv16", "qk4-pv8-direct", "mpfa", "qk4-pv4")
RECOVERY_BASELINE, RECOVERY_TARGET = "qk4-pv8-direct", "mpfa"
E4M3_MIN_NORMAL = 2.0**-6
E4M3_FLUSH = 2.0**-10  # half the smallest e4m3 subnormal: a block scale at or below it rounds to 0


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64; NaN anywhere gives NaN."""
    ref = ref.double()
    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


def recovery(err_direct: float, err_mpfa: float) -> float:
    """Share of the direct (unsmoothed) error that smoothing removes."""
    return (err_direct - err_mpfa) / err_direct


def _check_variants(variants: Sequence[str]) -> list[str]:
    chosen = list(dict.fromkeys(variants))
    known = [*(v for v in VARIANTS if v != "float64"), *CALIBRATED]
    unknown = [v for v in chosen if v not in known]
    if not chosen or unknown:
        raise ValueError(f"unknown or missing variants {unknown or '(none)'}; choose from {', '.join(known)}")
    return chosen


def _variant_output(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                    block_n: int) -> torch.Tensor:
    """One variant's attention output; a `CALIBRATED` one with FP8 scales from this layer's own K and V (amax / 448
    per KV head over the same tokens: the best any calibration text can give these inputs)."""
    if name not in CALIBRATED:
        return attention(q, k, v, variant=name, causal=True, sm_scale=scaling, block_n=block_n)
    k_scale, v_scale = (e4m3_amax_scale(x.to(torch.bfloat16).float().abs().amax(dim=(0, 2))) for x in (k, v))
    return attention(q, k, v, variant=CALIBRATED[name], causal=True, sm_scale=scaling, block_n=block_n,
                     k_scale=k_scale, v_scale=v_scale)


def _layer_rows(model: str, lay: LayerQKV, q_heads: list[int], kv_heads: list[int], variants: list[str],
                scaling: float, device: torch.device, block_n: int) -> list[dict]:
    q, k, v = (x.to(device) for x in (lay.q, lay.k, lay.v))
    ref = attention_float64(q, k, v, causal=True, sm_scale=scaling)
    outs = {name: _variant_output(name, q, k, v, scaling, block_n) for name in variants}
    group = len(q_heads) // len(kv_heads)
    rows = []
    for g, kv_head in enumerate(kv_heads):
        heads = slice(g * group, (g + 1) * group)
        row: dict = {"model": model, "layer": lay.layer, "kv_head": kv_head, "q_heads": q_heads[heads]}
        row.update({name: relative_l2(outs[name][:, heads], ref[:, heads]) for name in variants})
        if RECOVERY_BASELINE in row and RECOVERY_TARGET in row:
            row["recovery"] = recovery(row[RECOVERY_BASELINE], row[RECOVERY_TARGET])
        rows.append(row)
    return rows


def load_or_capture(
    source: str | Path, *, layers: Sequence[int] | str | None = None, seq_len: int = 2048,
    cache_dir: Path | None = None
) -> ActivationSet:
    """An activation file (optionally keeping only `layers`; ``"all"``: every captured one), or a model name of
    `models.MODELS` to capture (`capture.select_layers`: default `capture.evenly_spaced_layers`)."""
    if str(source) in MODELS:
        return capture_qkv(str(source), layers, seq_len=seq_len, cache_dir=cache_dir)
    if not Path(source).is_file():
        raise ValueError(f"{source}: neither an activation file nor a known model ({', '.join(sorted(MODELS))})")
    acts = ActivationSet.load(Path(source))
    if layers not in (None, ALL_LAYERS):
        missing = sorted(set(layers) - {lay.layer for lay in acts.layers})
        if missing:
            raise ValueError(f"{source}: layers {missing} were not captured")
        acts.layers = [lay for lay in acts.layers if lay.layer in set(layers)]
    return acts


def run_kernel_accuracy(
    acts: ActivationSet,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    device: str | torch.device = "cpu",
    block_n: int = 128,
) -> list[dict]:
    """One row per (layer, KV head): model, layer, kv_head, q_heads, the relative L2 error of each variant vs
    float64, and `recovery` when both qk4-pv8-direct and mpfa ran. `device` runs the reference there (CPU or CUDA);
    `block_n` is its KV tile (the P roundings see the running max per tile; `mpfa-qk8tile` scales K per tile)."""
    chosen = _check_variants(variants)
    rows: list[dict] = []
    for lay in acts.layers:
        rows.extend(_layer_rows(acts.model, lay, acts.q_heads, acts.kv_heads, chosen, acts.scaling,
                                torch.device(device), block_n))
    return rows


def summarize(rows: list[dict], variants: Sequence[str]) -> dict:
    """Mean error of each variant over all rows; recovery both as the mean of per-row recoveries and as the
    recovery of the mean errors."""
    if not rows:
        raise ValueError("no accuracy rows to summarize")
    mean = {v: sum(r[v] for r in rows) / len(rows) for v in variants}
    if "recovery" in rows[0]:
        mean["recovery"] = sum(r["recovery"] for r in rows) / len(rows)
        mean["recovery_of_mean"] = recovery(mean[RECOVERY_BASELINE], mean[RECOVERY_TARGET])
    return mean


def render_accuracy_table(rows: list[dict], variants: Sequence[str]) -> Table:
    """Rich table: one line per (layer, KV head) plus the mean line."""
    chosen = _check_variants(variants)
    model = rows[0]["model"] if rows else "?"
    table = Table(title=f"Attention output relative L2 error vs float64 ({model}, causal prefill)")
    table.add_column("layer", justify="right")
    table.add_column("kv head", justify="right")
    for v in chosen:
        table.add_column(v, justify="right")
    with_recovery = bool(rows) and "recovery" in rows[0]
    if with_recovery:
        table.add_column("recovery", justify="right")
    for r in rows:
        cells = [str(r["layer"]), str(r["kv_head"]), *(f"{r[v]:.3e}" for v in chosen)]
        table.add_row(*cells, *([f"{r['recovery']:.1%}"] if with_recovery else []))
    if rows:
        mean = summarize(rows, chosen)
        cells = ["mean", "", *(f"{mean[v]:.3e}" for v in chosen)]
        table.add_row(*cells, *([f"{mean['recovery']:.1%}"] if with_recovery else []), style="bold")
    return table


def _block_scales(x: torch.Tensor) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, NVFP4_BLOCK)).abs().amax(-1) / E2M1_MAX


def _operand_error(x: torch.Tensor, global_scale: torch.Tensor | None) -> float:
    try:
        return relative_l2(fake_quant_nvfp4(x, global_scale), x)
    except FormatError:
        return float("inf")  # a block scale overflows e4m3: unusable without the global scale


def _scale_row(model: str, layer: int, name: str, x: torch.Tensor) -> dict:
    scales = _block_scales(x)
    return {
        "model": model,
        "layer": layer,
        "operand": name,
        "amax": float(x.float().abs().max()),
        "max_block_scale": float(scales.max()),
        "min_block_scale": float(scales[scales > 0].min()),
        "overflow": bool(scales.max() > E4M3_MAX),
        "subnormal_blocks": float((scales < E4M3_MIN_NORMAL).float().mean()),
        "flushed_blocks": float(((scales <= E4M3_FLUSH) & (scales > 0)).float().mean()),
        "err_no_global": _operand_error(x, None),
        "err_global": _operand_error(x, nvfp4_global_scale(x)),
    }


def nvfp4_scale_report(acts: ActivationSet) -> list[dict]:
    """Per layer and operand (q, k raw; q, k centered over the sequence): block-scale range and NVFP4 error."""
    rows = []
    for lay in acts.layers:
        q, k = lay.q.float(), lay.k.float()
        one_sequence = torch.tensor([0, q.shape[0]])
        q_c = center(q, sequence_means(q, one_sequence), one_sequence)
        k_c = center(k, sequence_means(k, one_sequence), one_sequence)
        operands = {"q": q, "k": k, "q centered": q_c, "k centered": k_c}
        rows.extend(_scale_row(acts.model, lay.layer, name, x) for name, x in operands.items())
    return rows


def render_scale_table(rows: list[dict]) -> Table:
    """Rich table of `nvfp4_scale_report` rows, one line per operand over all layers: extremes of amax and of the
    block scales (with the layer holding the largest amax), layers that overflow, and mean fractions and errors."""
    model = rows[0]["model"] if rows else "?"
    table = Table(title=f"NVFP4 block scales amax/6 without a global scale ({model}); e4m3 max {E4M3_MAX:g}")
    columns = ("operand", "max amax (layer)", "min scale", "max scale", "overflow layers", "subnormal", "flushed",
               "mean err", "mean err w/ global")
    for col in columns:
        table.add_column(col, justify="right")
    operands = list(dict.fromkeys(r["operand"] for r in rows))
    for name in operands:
        group = [r for r in rows if r["operand"] == name]
        worst = max(group, key=lambda r: r["amax"])
        n = len(group)
        table.add_row(
            name,
            f"{worst['amax']:.3g} ({worst['layer']})",
            f"{min(r['min_block_scale'] for r in group):.3g}",
            f"{max(r['max_block_scale'] for r in group):.3g}",
            str(sum(r["overflow"] for r in group)),
            f"{sum(r['subnormal_blocks'] for r in group) / n:.3%}",
            f"{sum(r['flushed_blocks'] for r in group) / n:.3%}",
            f"{sum(r['err_no_global'] for r in group) / n:.4e}",
            f"{sum(r['err_global'] for r in group) / n:.4e}",
        )
    return table


def print_kernel_accuracy(
    source: str | Path,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    layers: Sequence[int] | str | None = None,
    seq_len: int = 2048,
    device: str | torch.device = "cpu",
    block_n: int = 128,
    cache_dir: Path | None = None,
    console: Console | None = None,
) -> list[dict]:
    """The whole study on one source (see `load_or_capture`): print the error table, the mean recoveries and the
    NVFP4 scale table; return the error rows."""
    console = console or Console()
    acts = load_or_capture(source, layers=layers, seq_len=seq_len, cache_dir=cache_dir)
    rows = run_kernel_accuracy(acts, variants, device=device, block_n=block_n)
    console.print(render_accuracy_table(rows, variants))
    mean = summarize(rows, _check_variants(variants))
    if "recovery" in mean:
        console.print(
            f"recovery of the {RECOVERY_BASELINE} error by {RECOVERY_TARGET}: {mean['recovery']:.1%} "
            f"(mean over rows), {mean['recovery_of_mean']:.1%} (of the mean errors)"
        )
    console.print(render_scale_table(nvfp4_scale_report(acts)))
    return rows
