"""Predict on the CPU the |Δ logprob| that `mpfa logits` should measure: attention numerics alone, same prompts.

    mpfa accuracy predict-logits DIR --input-len 512,2048 --prompts 2 --seed 0 --variant mpfa --ref bf16 \
        [--json out.json]

DIR is a checkpoint (e.g. `mpfa accuracy random-checkpoint`). The model runs in float32 on the CPU with its
attention swapped for a variant of the numerics reference (`mpfa.mpfa_cli.accuracy.tasks.attention_swap`), so the only
difference between two variants is the attention math; it reads the prompts `mpfa logits --seed S --prompts N`
sends (`mpfa.mpfa_cli.accuracy.logits.prompts_for`), one at a time (batch 1), and takes each prompt's logprobs as a server's
prefill returns them: position i holds log p(token i | tokens < i), i = 1..L-1, and the top-1 token. The same
`compare` / `reference_stats` as `mpfa logits` turn them into the rows, whose prefill fields keep their names, so
the JSON reads like the measured one. Variants are the reference's: `bf16` for fa4-bf16, `fp8` for flashinfer-fp8,
`mpfa` for mpfa, `qk4-pv8-direct` for mpfa-direct.

What the prediction leaves out: the servers run the rest of the model (projections, MLP, norms, LM head) in BF16,
here float32, and the BF16 rounding of each layer's output can amplify or add to an attention difference; the
servers' kernels round like their reference variants only up to summation order. A variant asked that equals the
reference is computed again, not copied: its zero deltas check that the pipeline is deterministic.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import UserError
from .logits import NEAR_UNIFORM_STD, Row, Sample, compare, format_number, format_share, prompts_for, reference_stats
from ...kernels.reference import VARIANTS
from .tasks.attention_swap import VariantAttention, install

ROW_FIELDS = ("backend", "input_len", "prompts", "error", "prefill_positions", "prefill_mean_abs", "prefill_p99_abs",
              "prefill_max_abs", "prefill_top1_agree")  # a Row's prefill part: no output tokens are generated here
ProgressFn = Callable[[str, int, int, float], None]  # (variant, input_len, prompt index, seconds)


@dataclass
class Prediction:
    checkpoint: str
    ref: str
    variants: list[str]
    seed: int
    prompts: int
    rows: list[Row]  # one per variant x input length, the reference's first
    reference: dict[int, dict[str, float | None]]  # input_len -> reference_stats
    seconds_per_prompt: dict[str, dict[int, float]]  # variant -> input_len -> mean CPU seconds of one prompt

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows"] = [{k: v for k, v in asdict(row).items() if k in ROW_FIELDS} for row in self.rows]
        out["reference"] = {str(k): v for k, v in self.reference.items()}
        out["seconds_per_prompt"] = {v: {str(n): s for n, s in by_len.items()}
                                     for v, by_len in self.seconds_per_prompt.items()}
        return out


@torch.inference_mode()
def prompt_sample(model, attention: VariantAttention, prompt: list[int]) -> Sample:
    """One prompt's prefill logprobs and top-1 ids, computed with the installed variant `attention`."""
    attention.reset()
    ids = torch.tensor([prompt])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return Sample(prompt_logprobs=logprobs.tolist(), prompt_top_ids=logits.argmax(-1).tolist(), output_ids=[],
                  output_logprobs=[])


def variant_samples(
    model, variant: str, prompts: dict[int, list[list[int]]], progress: ProgressFn | None = None
) -> tuple[dict[int, list[Sample]], dict[int, float]]:
    """Every prompt's sample with `variant` installed, per input length, and the mean seconds of one prompt."""
    attention = install(model, variant)
    samples: dict[int, list[Sample]] = {}
    seconds: dict[int, float] = {}
    for n, batch in prompts.items():
        samples[n], took = [], []
        for index, prompt in enumerate(batch):
            start = time.perf_counter()
            samples[n].append(prompt_sample(model, attention, prompt))
            took.append(time.perf_counter() - start)
            if progress:
                progress(variant, n, index, took[-1])
        seconds[n] = sum(took) / len(took)
    return samples, seconds


def check_arguments(variants: list[str], ref: str, input_lens: list[int], count: int) -> None:
    unknown = [v for v in [ref, *variants] if v not in VARIANTS]
    if unknown:
        raise UserError(f"unknown attention variant {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not variants:
        raise UserError("give at least one variant to compare with the reference")
    if any(n < 2 for n in input_lens) or not input_lens:
        raise UserError("--input-len: every length must be >= 2 (position 0 has no logprob)")
    if count < 1:
        raise UserError("--prompts must be >= 1")


def load_model(checkpoint: Path):
    """The checkpoint in float32 on the CPU, for inference."""
    from transformers import AutoModelForCausalLM

    if not (Path(checkpoint) / "config.json").is_file():
        raise UserError(f"{checkpoint} is not a checkpoint directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def predict(
    checkpoint: Path, variants: list[str], ref: str, input_lens: list[int], count: int, seed: int,
    progress: ProgressFn | None = None,
) -> Prediction:
    """Each variant's prefill logprobs on `mpfa logits`' prompts, compared with the reference variant's."""
    check_arguments(variants, ref, input_lens, count)
    model = load_model(checkpoint)
    prompts = {n: prompts_for(seed, count, n) for n in input_lens}
    vocab = model.config.get_text_config().vocab_size
    if (top := max(max(p) for batch in prompts.values() for p in batch)) >= vocab:
        raise UserError(f"the prompts hold token id {top}, past the model's vocabulary of {vocab}")
    ref_samples, ref_seconds = variant_samples(model, ref, prompts, progress)
    rows = [compare(ref, n, ref_samples[n], ref_samples[n]) for n in input_lens]
    seconds = {ref: ref_seconds}
    for variant in variants:
        samples, seconds[variant] = variant_samples(model, variant, prompts, progress)
        rows += [compare(variant, n, ref_samples[n], samples[n]) for n in input_lens]
    return Prediction(checkpoint=str(checkpoint), ref=ref, variants=list(variants), seed=seed, prompts=count,
                      rows=rows, reference={n: reference_stats(ref_samples[n]) for n in input_lens},
                      seconds_per_prompt=seconds)


def render(prediction: Prediction, console) -> None:
    from rich.table import Table

    table = Table(title=f"Predicted prefill logprobs vs {prediction.ref} (CPU, {prediction.checkpoint})",
                  title_justify="left")
    for column in ("variant", "input", "prompts", "mean |Δlp|", "p99 |Δlp|", "max |Δlp|", "top-1 agree",
                   "s / prompt"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for index, row in enumerate(prediction.rows):
        mark = " (ref)" if index < len(prediction.reference) else ""  # the first rows: the reference vs itself
        table.add_row(row.backend + mark, str(row.input_len), str(row.prompts), format_number(row.prefill_mean_abs),
                      format_number(row.prefill_p99_abs), format_number(row.prefill_max_abs),
                      format_share(row.prefill_top1_agree),
                      f"{prediction.seconds_per_prompt[row.backend][row.input_len]:.1f}")
    console.print(table)
    for n, stats in prediction.reference.items():
        console.print(f"{prediction.ref} at {n}: prompt logprobs mean {stats['prompt_logprob_mean']:.4f}, "
                      f"std {stats['prompt_logprob_std']:.3g}", highlight=False)
        if stats["prompt_logprob_std"] < NEAR_UNIFORM_STD:
            console.print(f"[yellow]near-uniform logits (std < {NEAR_UNIFORM_STD}): attention barely reaches them[/]")

