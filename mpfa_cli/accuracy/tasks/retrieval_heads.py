"""Which attention heads read a needle question's answer, and how much a quantized variant perturbs them there.

For one question of a needle task (`long_context.needle_items`: the prompts `mpfa accuracy serve` sends), one FP32
forward pass of the model captures every layer's post-RoPE Q/K/V (`capture.run_capturing`). At the prompt's last
`rows` positions (the last one predicts the answer's first token) it reports, per layer and query head:

* the float64 attention mass of the last position on the asked needle's tokens and on the other needles' tokens
  (`needle_spans`): heads whose mass sits on the needles are the ones that retrieve;
* the relative L2 error there of a reference variant's attention output (`reference.attention`, the Q/K means taken
  over the whole prompt, as the served kernels and `attention_swap` freeze them for a one-chunk prompt) against
  float64 attention of the same BF16 Q/K/V.

The served results say that a variant loses multi-key questions; this says in which layers and heads its error falls
where the model retrieves. Run: ``mpfa accuracy heads --model DIR --task niah-multikey --length 8192 --question 13``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernel_error import relative_l2
from ..capture import LayerQKV
from ....kernels.reference import VARIANTS, attention, attention_float64
from ....kernels.smoothing import SmoothingMeans, masked_means
from .items import GenerationItem
from .long_context import NEEDLE
from .tokens import TaskTokenizer

_NEEDLE_TEXT = re.compile(re.escape(NEEDLE).replace(re.escape("{key}"), r"(?P<key>[\w-]+)")
                          .replace(re.escape("{value}"), r"(?P<value>\d+)"))


@dataclass(frozen=True)
class NeedleSpan:
    """One needle of a prompt: its key and value, and its tokens' positions [start, end) in the prompt."""

    key: str
    value: str
    start: int
    end: int


@dataclass(frozen=True)
class HeadRow:
    """One query head at the answer positions: mass on the asked needle / on the others (last position, float64
    attention) and the variant's relative L2 error against float64 over the last `rows` positions."""

    layer: int
    head: int
    mass_asked: float
    mass_others: float
    error: float


def needle_spans(tok: TaskTokenizer, item: GenerationItem) -> tuple[NeedleSpan, list[NeedleSpan]]:
    """The asked needle (the one whose value is the answer) and the others, located in `item.prompt` by their ids
    (`needle_items` inserts each needle's ids whole)."""
    prompt = list(item.prompt)
    found = []
    for match in _NEEDLE_TEXT.finditer(tok.decode(prompt)):
        ids = tok.encode(NEEDLE.format(key=match["key"], value=match["value"]))
        starts = [i for i in range(len(prompt) - len(ids) + 1) if prompt[i:i + len(ids)] == ids]
        if len(starts) != 1:
            raise ValueError(f"needle {match['key']}: its ids occur {len(starts)} times in the prompt, not once")
        found.append(NeedleSpan(match["key"], match["value"], starts[0], starts[0] + len(ids)))
    asked = [n for n in found if n.value in item.answers]
    if len(asked) != 1:
        raise ValueError(f"{item.id}: {len(asked)} needles carry the answer {item.answers}, not one")
    return asked[0], [n for n in found if n is not asked[0]]


def head_rows(layers: Sequence[LayerQKV], scaling: float, asked: NeedleSpan, others: Sequence[NeedleSpan],
              variant: str, rows: int = 16) -> list[HeadRow]:
    """Per layer and query head (see the module docstring); layers' q/k/v are [S, H, d] of one prompt."""
    out: list[HeadRow] = []
    for lay in layers:
        q, k, v = lay.q, lay.k, lay.v
        group = q.shape[1] // k.shape[1]
        means = (SmoothingMeans(masked_means(q[None].float()), masked_means(k[None].float()))
                 if VARIANTS[variant].smoothing else None)
        answer = q[-rows:]
        ref = attention_float64(answer, k, v, causal=True, sm_scale=scaling)
        got = attention(answer, k, v, variant=variant, causal=True, sm_scale=scaling, means=means)
        scores = torch.einsum("hd,shd->hs", q[-1].double(), k.double().repeat_interleave(group, dim=1)) * scaling
        probs = torch.softmax(scores, dim=-1)  # the last position sees every key
        for head in range(q.shape[1]):
            others_mass = sum(float(probs[head, n.start:n.end].sum()) for n in others)
            out.append(HeadRow(lay.layer, head, float(probs[head, asked.start:asked.end].sum()), others_mass,
                               relative_l2(got[:, head], ref[:, head])))
    return out


def retrieval_summary(rows: Sequence[HeadRow], threshold: float = 0.1) -> dict[str, float | int]:
    """Mean variant error over the heads putting >= `threshold` of the last position's mass on the needles (asked and
    others), and over the rest; how many of each."""
    retrieving = [r for r in rows if r.mass_asked + r.mass_others >= threshold]
    rest = [r for r in rows if r.mass_asked + r.mass_others < threshold]

    def mean(xs: Sequence[HeadRow]) -> float:
        return sum(r.error for r in xs) / len(xs) if xs else float("nan")

    return {"retrieving": len(retrieving), "error_retrieving": mean(retrieving), "rest": len(rest),
            "error_rest": mean(rest)}


def print_retrieval_heads(model: str, console, *, task: str = "niah-multikey", length: int = 8192, question: int = 0,
                          seed: int = 0, variant: str = "mpfa-qk8tile-psum", rows: int = 16, top: int = 12,
                          device: str = "cpu") -> list[HeadRow]:
    """Build question `question` of `task` at `length` tokens for `model` (as `accuracy serve` does), capture its
    Q/K/V, print the `top` heads by needle mass and the mean errors; every head's row is returned."""
    from rich.table import Table

    from ..capture import run_capturing
    from .data import essay_text
    from .generation import load_model
    from .long_context import Haystack, needle_items
    from .tokens import HFTokenizer

    lm = load_model(model, device)
    tok = HFTokenizer(lm.tokenizer, lm.name)
    (item,) = needle_items(tok, task, Haystack.from_text(tok, essay_text()), length, 1, seed, question)
    asked, others = needle_spans(tok, item)
    captured, scaling = run_capturing(lm.model, torch.tensor([item.prompt], device=lm.device),
                                      range(lm.model.config.num_hidden_layers))
    result = head_rows([captured[i] for i in sorted(captured)], scaling, asked, others, variant, rows)
    table = Table(title=f"{item.id}: asked {asked.key} ({asked.value}); heads by the last position's needle mass; "
                        f"{variant} error vs float64 over the last {rows} positions", title_justify="left")
    for column in ("layer", "head", "mass asked", "mass others", "error"):
        table.add_column(column, justify="right")
    for r in sorted(result, key=lambda r: -(r.mass_asked + r.mass_others))[:top]:
        table.add_row(str(r.layer), str(r.head), f"{r.mass_asked:.3f}", f"{r.mass_others:.3f}", f"{r.error:.4f}")
    console.print(table)
    s = retrieval_summary(result)
    console.print(f"mean error: {s['error_retrieving']:.4f} over the {s['retrieving']} heads with >= 10% of the mass "
                  f"on the needles, {s['error_rest']:.4f} over the other {s['rest']}", highlight=False)
    return result
