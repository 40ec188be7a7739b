"""The numerics variant study (issue 45, docs/accuracy.md "Variant study"): `kernel_error` rows summarized per
candidate numerics with what it costs in KV-cache bytes, and FP8 K on only the heads whose NVFP4 K errs most.

Errors are `kernel_error.run_kernel_accuracy`'s relative L2 per (layer, KV head). A KV head's output depends only on
its own K/V, so a per-head mix of two variants (NVFP4 K on most heads, FP8 K on a few) has exactly the rows of one
or the other: `fp8_k_on_worst_heads` forms it from the two variants' rows without running it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ...kernels.formats import NVFP4_BLOCK
from ...kernels.kv_capacity import kv_bytes_per_token
from .kernel_error import load_or_capture, run_kernel_accuracy
from ...kernels.reference import CALIBRATED, E4M3_ROW, NVFP4_E4M3_ROW, NVFP4_E4M3_TILE, VARIANTS

BASELINE = "mpfa"
NVFP4_K, FP8_K = "mpfa", "mpfa-k8"
STUDY_VARIANTS = ("bf16", "fp8", "fp8-calibrated", "mpfa", "mpfa-qk8tile-psum", "mpfa-q8", "mpfa-had16", "mpfa-had128",
                  "mpfa-k46", "mpfa-q8-had16", "mpfa-q8-had128", "mpfa-q8-k46", "mpfa-had16-k46", "mpfa-q8-had128-k46",
                  "mpfa-k8", "mpfa-q8-k8")
FP8_K_SHARES = (0.125, 0.25)
# the uncentered baselines' caches (`kv_capacity` formats)
_BASELINE_CACHES = {"bf16": "bf16", "fp8": "fp8", **{name: "fp8" for name in CALIBRATED}}


def k_bytes(k_format: str, head_dim: int) -> float:
    """Cache bytes of one token's K in one KV head: NVFP4 codes and e4m3 block scales, or e4m3 values and one
    power-of-two (e8m0) scale byte for ``e4m3-row``."""
    if k_format == E4M3_ROW:
        return head_dim + 1
    if k_format in ("nvfp4", NVFP4_E4M3_ROW, NVFP4_E4M3_TILE):  # the requantized formats cache NVFP4
        return head_dim / 2 + head_dim / NVFP4_BLOCK
    raise ValueError(f"no cache size for K format {k_format!r}")


def kv_bytes(variant: str, head_dim: int, group_size: int) -> float:
    """KV-cache bytes per token per KV head: a baseline's (bf16, fp8) or, for a centered (`mpfa`-like) variant,
    `kv_capacity`'s mpfa figure with K in the variant's format (Q's format, rotations and K's scale choice change
    no byte)."""
    if variant in _BASELINE_CACHES:
        return kv_bytes_per_token(_BASELINE_CACHES[variant], head_dim, group_size)
    return kv_bytes_per_token("mpfa", head_dim, group_size) - k_bytes("nvfp4", head_dim) \
        + k_bytes(VARIANTS[variant].k, head_dim)


def summarize_variants(rows: list[dict], variants: Sequence[str], head_dim: int, group_size: int) -> list[dict]:
    """Per variant: description, KV bytes per token per KV head, mean and worst (layer, KV head) error, and the
    ratio of its mean error to `mpfa`'s (when mpfa ran)."""
    out = []
    for name in variants:
        errors = [r[name] for r in rows]
        worst = max(rows, key=lambda r: r[name])
        mean = sum(errors) / len(errors)
        out.append({
            "variant": name,
            "description": VARIANTS[CALIBRATED.get(name, name)].description,
            "bytes": kv_bytes(name, head_dim, group_size),
            "mean": mean,
            "worst": worst[name],
            "worst_head": (worst["layer"], worst["kv_head"]),
            "vs_mpfa": mean / (sum(r[BASELINE] for r in rows) / len(rows)) if BASELINE in rows[0] else None,
        })
    return out


def fp8_k_on_worst_heads(rows: list[dict], share: float, head_dim: int, group_size: int,
                         nvfp4: str = NVFP4_K, fp8: str = FP8_K) -> dict:
    """The per-head mix: FP8 K (variant ``fp8``) on the ``share`` of (layer, KV head) rows where ``nvfp4`` errs most,
    NVFP4 K elsewhere -> the heads switched, mean and worst error, and the mean KV bytes per token per KV head."""
    if not 0 <= share <= 1:
        raise ValueError(f"share must be in [0, 1], got {share}")
    count = round(share * len(rows))
    switched = sorted(rows, key=lambda r: r[nvfp4], reverse=True)[:count]
    chosen = {(r["layer"], r["kv_head"]) for r in switched}
    errors = [r[fp8] if (r["layer"], r["kv_head"]) in chosen else r[nvfp4] for r in rows]
    extra = (kv_bytes(fp8, head_dim, group_size) - kv_bytes(nvfp4, head_dim, group_size)) * count / len(rows)
    return {"heads": sorted(chosen), "mean": sum(errors) / len(errors), "worst": max(errors),
            "bytes": kv_bytes(nvfp4, head_dim, group_size) + extra}


def render_study_table(summary: list[dict], model: str) -> Table:
    """Rich table of `summarize_variants` rows."""
    table = Table(title=f"Variant study: attention relative L2 error vs float64 per (layer, KV head) ({model})")
    for col in ("variant", "KV bytes/token/KV head", "mean", "worst (layer, KV head)", "mean vs mpfa"):
        table.add_column(col, justify="right")
    for s in summary:
        ratio = "" if s["vs_mpfa"] is None else f"{s['vs_mpfa']:.3f}"
        table.add_row(s["variant"], f"{s['bytes']:g}", f"{s['mean']:.4f}",
                      f"{s['worst']:.4f} {s['worst_head']}", ratio)
    return table


def print_variant_study(
    source: str | Path,
    variants: Sequence[str] = STUDY_VARIANTS,
    *,
    layers: Sequence[int] | str | None = None,
    seq_len: int = 2048,
    group_size: int | None = None,
    console: Console | None = None,
) -> list[dict]:
    """The study on one source (`kernel_error.load_or_capture`): print the summary table, the per-head errors and
    FP8 K on the worst ``FP8_K_SHARES`` of heads (when mpfa and mpfa-k8 ran); return the per-head rows.
    ``group_size``: the model's Hq / Hkv for the byte counts (default: the captured heads', which a fixture that
    keeps a few query heads per KV head understates)."""
    console = console or Console()
    acts = load_or_capture(source, layers=layers, seq_len=seq_len)
    rows = run_kernel_accuracy(acts, variants)
    head_dim = acts.layers[0].q.shape[-1]
    group = group_size or len(acts.q_heads) // len(acts.kv_heads)
    console.print(render_study_table(summarize_variants(rows, variants, head_dim, group), acts.model))
    for r in rows:
        console.print(f"layer {r['layer']} KV head {r['kv_head']}: " + " ".join(f"{v} {r[v]:.4f}" for v in variants))
    if NVFP4_K in variants and FP8_K in variants:
        for share in FP8_K_SHARES:
            mix = fp8_k_on_worst_heads(rows, share, head_dim, group)
            console.print(f"FP8 K on the worst {share:.1%} of heads {mix['heads']}: mean {mix['mean']:.4f}, "
                          f"worst {mix['worst']:.4f}, {mix['bytes']:g} bytes/token/KV head")
    return rows
