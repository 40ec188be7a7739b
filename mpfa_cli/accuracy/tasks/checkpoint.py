"""A GGUF model as a BF16 transformers checkpoint that a serving engine loads with `--model DIR`.

transformers dequantizes the GGUF weights (asked to explicitly where it can keep them packed: `GgufConfig(dequantize=
True)`); the checkpoint holds those values in BF16 (the weights of the quantized release, not of the original BF16
one), the tokenizer with its chat template, the config and the generation config. Convert with the transformers
version the server uses, so that it reads the config it wrote.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .generation import model_files


def export_checkpoint(source: str, out: Path) -> Path:
    """Write `source` (see `generation.model_files`) to the new directory `out` in BF16."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: give a new directory")
    where, extra, _ = model_files(source)
    if "gguf_file" in extra and hasattr(transformers, "GgufConfig"):  # transformers that can keep GGUF blocks packed
        extra = {**extra, "quantization_config": transformers.GgufConfig(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16, **extra)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(where, gguf_file=extra.get("gguf_file")).save_pretrained(out)
    return out
