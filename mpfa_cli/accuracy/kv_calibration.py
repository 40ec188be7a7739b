"""Calibrate a checkpoint's FP8 KV-cache scales on held-out text and write them where SGLang reads them.

What: per layer, the largest |K| and the largest |V| the attention receives, K after its projection's bias and RoPE
(the tensors SGLang writes into its cache; `capture.run_capturing`, rounded to BF16 as a server hands them over),
over every token of the calibration prompts; scale = amax x margin / 448 (e4m3's largest, `e4m3_amax_scale`). One
K and one V scale per layer: the finest SGLang serves (`mpfa.backends.kv_scales`, which also says how they are
stored). The margin leaves room for keys larger than any the calibration saw (e.g. at positions past its prompts,
where RoPE turns a key's dimensions further); a value beyond the scaled range saturates at 448.

On what: the Python reference documentation's topics, as CPython ships them (`pydoc_data.topics`, the text `help()`
shows: prose with code, apt for a code model; in topic-name order, each once, joined by blank lines), cut into
`count` prompts, each one user turn of `tokens` tokens under the checkpoint's chat template, as the served prompts
are. No task is made of it: not the essays of the needle and RULER-style tasks, nor SQuAD or social_iqa, whose
source (the bigbench 1.0.0 sdist) the package index may lack anyway. It comes with Python, so no host has to fetch
it; its wording changes a little between Python versions, which the provenance names.
"""
from __future__ import annotations

import datetime
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ...backends.kv_scales import layer_count, write_kv_scales
from ...kernels.formats import E4M3_MAX, e4m3_amax_scale
from ..harness.environment import git_revision
from .capture import run_capturing
from .tasks.tokens import TaskTokenizer

INSTRUCTION = "Read the following documentation.\n\n"
SOURCE = f"Python {platform.python_version()} reference documentation topics (pydoc_data.topics), in name order"


def python_docs() -> list[str]:
    """The distinct topics of the running Python's reference documentation, in name order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ValueError("this Python lacks its reference documentation (pydoc_data), the calibration text") from None
    return list(dict.fromkeys(topics[name] for name in sorted(topics)))  # two names may share one text


def calibration_prompts(tok: TaskTokenizer, texts: Iterable[str], count: int, tokens: int) -> list[list[int]]:
    """`count` chat prompts of exactly `tokens` ids: `INSTRUCTION`, then the ids of `texts` (each followed by a
    blank line), consecutive across prompts (none repeated)."""
    if count < 1:
        raise ValueError(f"the calibration needs at least one prompt, got {count}")
    body = tokens - (len(tok.chat_ids(INSTRUCTION, [0])) - 1)  # the chat turn around one body id
    if body < 1:
        raise ValueError(f"{tokens} tokens do not hold the calibration prompt's chat turn")
    stream: list[int] = []
    prompts: list[list[int]] = []
    for text in texts:
        stream += tok.encode(text + "\n\n")
        while len(stream) >= body and len(prompts) < count:
            prompts.append(tok.chat_ids(INSTRUCTION, stream[:body]))
            stream = stream[body:]
        if len(prompts) == count:
            return prompts
    raise ValueError(f"the calibration text fills {len(prompts)} prompts of {tokens} tokens, not {count}")


def kv_amax(model, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest |K| and |V| (BF16, post-RoPE K) of each layer over every token of `prompts`: two [layers]
    float32 tensors. `model`: a transformers causal LM loaded with SDPA attention."""
    layers = model.config.num_hidden_layers
    device = next(model.parameters()).device
    k_amax, v_amax = torch.zeros(layers), torch.zeros(layers)
    for ids in prompts:
        captured, _ = run_capturing(model, torch.tensor([list(ids)], device=device), range(layers), q_sel=[])
        for layer, qkv in captured.items():
            k_amax[layer] = max(k_amax[layer], qkv.k.float().abs().amax().cpu())
            v_amax[layer] = max(v_amax[layer], qkv.v.float().abs().amax().cpu())
    return k_amax, v_amax


def calibrate_checkpoint(directory: Path, tok: TaskTokenizer, texts: Iterable[str], count: int, tokens: int,
                         margin: float, device: str) -> dict[str, Any]:
    """Calibrate the checkpoint `directory` (loaded by transformers in float32 on `device`) on `count` prompts of
    `tokens` tokens from `texts` and write its scales (`write_kv_scales`); returns what it wrote beside them."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # noise in the command's output
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if not margin >= 1:
        raise ValueError(f"the margin must be at least 1 (a scale below amax / {E4M3_MAX:g} clips), got {margin}")
    layer_count(directory)  # an architecture SGLang would not take the scales of fails before the calibration runs
    prompts = calibration_prompts(tok, texts, count, tokens)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    k_amax, v_amax = kv_amax(model.to(device).eval(), prompts)
    provenance = {
        "text": SOURCE, "instruction": INSTRUCTION, "tokenizer": tok.name, "prompts": count,
        "tokens_per_prompt": tokens, "tokens": count * tokens, "margin": margin,
        "scale": f"amax * margin / {E4M3_MAX:g}, one K and one V scale per layer",
        "k_amax": k_amax.tolist(), "v_amax": v_amax.tolist(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mpfa_revision": git_revision(),
    }
    return write_kv_scales(directory, e4m3_amax_scale(k_amax * margin).tolist(),
                           e4m3_amax_scale(v_amax * margin).tolist(), provenance)
