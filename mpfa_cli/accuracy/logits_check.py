"""`mpfa logits --predicted FILE`: the measured |Δ logprob| against the CPU prediction of the attention numerics.

`mpfa accuracy predict-logits` runs the same checkpoint and prompts on the CPU with only the attention swapped for
each backend's reference variant (`BackendSpec.numerics`) and writes the rows `mpfa logits` writes.
A served backend computes its variant's numerics if its prompt mean |Δ logprob| against the reference backend lands
within a factor of the predicted one, both ways: far above means the served kernels add error of their own (a
bug), far below that they do not run the numerics they claim (e.g. a BF16 fallback). The band is wide because
the servers run the rest of the model in BF16, the prediction in float32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...backends.specs import BACKENDS, BackendSpec
from ..errors import UserError
from ..harness.scenario import load_model_shape
from ..harness.served_kernels import REFERENCE_PREFILL, launch_page_size, runs_mpfa_kernels, served_kernels


@dataclass(frozen=True)
class PredictionCheck:
    backend: str
    variant: str
    input_len: int
    measured: float
    predicted: float

    def ratio(self) -> float:
        return self.measured / self.predicted

    def within(self, factor: float) -> bool:
        return 1 / factor <= self.ratio() <= factor


DIRECT_NUMERICS = {"mpfa": "qk4-pv8-direct", "mpfa-qk8tile-psum": "qk8tile-psum-direct"}  # without the centering


def served_numerics(specs: list[BackendSpec], model: str, prefill_kernel: str | None = None) -> dict[str, str | None]:
    """Backend name -> the reference variant its server computes: `BackendSpec.numerics`, except that MpFA's prompt
    (prefill) runs the numerics of the prefill kernel its servers run for ``model`` (`served_kernels`, with
    ``prefill_kernel`` or ``$MPFA_PREFILL_KERNEL`` passed on to the servers): the fp8 kernel's "mpfa-qk8tile-psum",
    the exact and mma-sync kernels' the paper's "mpfa"; ``mpfa-direct`` that variant without the centering (None
    where the reference has no such variant: its row is not checked); each under the servers' ``$MPFA_NUMERICS``
    (`ServedNumerics.variant`: "mpfa-had128-k46" for "mpfa" under had128-k46)."""
    if not any(runs_mpfa_kernels(s) for s in specs):
        return {s.name: s.numerics for s in specs}
    from ...kernels.served_numerics import SERVED_NUMERICS
    from ...kernels.sm90.dispatch import PREFILL_KERNELS

    mpfa = BACKENDS["mpfa"]
    shape = load_model_shape(model)
    kernels = served_kernels(mpfa, shape.q_heads, shape.kv_heads, launch_page_size(mpfa), prefill_kernel)
    prompt = mpfa.numerics if kernels["prefill"] == REFERENCE_PREFILL else PREFILL_KERNELS[kernels["prefill"]].numerics
    option = SERVED_NUMERICS[kernels["numerics"]]
    direct = DIRECT_NUMERICS.get(prompt)  # None: no such reference variant
    served = {"mpfa": option.variant(prompt), "qk4-pv8-direct": direct and option.variant(direct)}
    return {s.name: served.get(s.numerics, s.numerics) for s in specs}


def load_prediction(path: Path) -> dict[str, Any]:
    try:
        prediction = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--predicted {path}: cannot read a prediction JSON ({exc})") from None
    if not isinstance(prediction, dict) or not isinstance(prediction.get("rows"), list) or "ref" not in prediction:
        raise UserError(f"--predicted {path}: not a `mpfa accuracy predict-logits --json` file")
    return prediction


def check_against_prediction(result, prediction: dict[str, Any],
                             numerics: dict[str, str | None]) -> list[PredictionCheck]:
    """One check per measured row (other than the reference's) with a prediction for its variant and length.
    `numerics`: backend name -> its reference variant. The prediction's reference must be the reference backend's."""
    ref_variant = numerics.get(result.ref)
    if prediction["ref"] != ref_variant:
        raise UserError(f"the prediction compares against {prediction['ref']!r}, but the reference backend "
                        f"{result.ref} computes {ref_variant!r}")
    if prediction.get("seed") is not None and prediction["seed"] != result.seed:
        raise UserError(f"the prediction used prompt seed {prediction['seed']}, this run {result.seed}")
    predicted = {(r["backend"], r["input_len"]): r.get("prefill_mean_abs") for r in prediction["rows"]
                 if r.get("error") is None}
    checks = []
    for row in result.rows:
        variant = numerics.get(row.backend)
        value = predicted.get((variant, row.input_len))
        if row.backend == result.ref or row.error or row.prefill_mean_abs is None or not value:
            continue
        checks.append(PredictionCheck(row.backend, variant, row.input_len, row.prefill_mean_abs, value))
    if not checks:
        raise UserError("the prediction has no row for any measured backend and input length")
    return checks


def render_checks(checks: list[PredictionCheck], factor: float, console) -> None:
    from rich.table import Table

    table = Table(title=f"Prompt mean |Δ logprob|: measured vs predicted (within {factor}x either way)",
                  title_justify="left")
    for column in ("backend", "variant", "input", "measured", "predicted", "measured / predicted", "status"):
        table.add_column(column, justify="left" if column in ("backend", "variant", "status") else "right")
    for c in checks:
        status = "[green]ok[/]" if c.within(factor) else "[red]outside[/]"
        table.add_row(c.backend, c.variant, str(c.input_len), f"{c.measured:.3g}", f"{c.predicted:.3g}",
                      f"{c.ratio():.2f}", status)
    console.print(table)
