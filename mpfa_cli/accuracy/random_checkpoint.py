"""A seeded random checkpoint of a model config, at full width, that SGLang loads with `mpfa logits --model DIR`.

    mpfa accuracy random-checkpoint --model llama-3.1-8b --layers 4 --seed 0 --out DIR

Why: SGLang's `--load-format dummy` draws every weight, norms included, from U(-1e-3, 1e-3); the attention output
then sits below BF16's rounding of the residual stream and cannot reach the logits (see `mpfa.mpfa_cli.accuracy.logits`), so
comparing backends' logprobs checks only the plumbing. Here norm weights are ones and every other parameter is
N(0, std), GPT-2 style (std 0.02, the configs' `initializer_range`): normalized activations have unit scale, the scaled
Q K^T scores spread by ~1.6 (llama-3.1-8b: a softmax neither uniform nor one-hot), and attention moves the logits,
which themselves spread by ~std·sqrt(hidden).

Names and shapes come from the transformers model built on the meta device, so any architecture transformers
knows works; `named_parameters()` lists a tied `lm_head` once (as the embedding), so tied models store no copy.
Each tensor is drawn in `dtype` from its own `torch.Generator`, seeded by (seed, parameter name): the values do
not depend on the order of generation nor on the layer count (a 4-layer checkpoint holds the first 4 layers of
the 32-layer one). A CPU and a CUDA generator give different bits from the same seed (same distribution), so a
checkpoint is reproducible bit for bit on the kind of device that drew it (`device`, recorded in config.json).

Tensors are drawn one at a time and written in shards of at most `shard_bytes` (one larger tensor gets a shard of
its own), HuggingFace's sharded layout: `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
No tokenizer is written: SGLang runs with `--skip-tokenizer-init` and the prompts are token ids.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..harness.scenario import model_dir

SHARD_BYTES = 2 * 10**9
MARKER = "mpfa_random_checkpoint"  # the config.json field that says what drew the weights
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a 64-bit hash of (seed, name)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def parameter_shapes(config: dict[str, Any]) -> dict[str, torch.Size]:
    """Every stored parameter's name and shape, in the model's order, from the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"transformers cannot build a causal LM from this config.json: {str(exc)[:200]}") from None
    return {name: p.shape for name, p in model.named_parameters()}


def draw(name: str, shape: torch.Size, seed: int, std: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One parameter: ones for norm weights, else N(0, std) from its own generator; on the CPU."""
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator(device).manual_seed(parameter_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator).cpu()


def plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Parameter names grouped in order into shards of at most `shard_bytes` (a larger tensor: a shard alone)."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if not shards or used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_random_checkpoint(
    model: str, out: Path, layers: int | None, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.bfloat16,
    device: str | None = None, shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write config.json and random safetensors weights for `model` (a bundled config name or a directory with a
    config.json) to `out`, which must not exist or be empty; `layers` replaces num_hidden_layers. Returns `out`.
    `device`: where to draw (default: CUDA when available, else the CPU)."""
    source = model_dir(model)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output {out} exists and is not an empty directory")
    if layers is not None and layers < 1:
        raise UserError(f"--layers must be >= 1, got {layers}")
    if not std > 0:
        raise UserError(f"--std must be > 0, got {std}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here")
    config = json.loads((source / "config.json").read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
        if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (transformers 5 configs)
            config["layer_types"] = config["layer_types"][:layers]
    config.pop("dtype", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config[MARKER] = {"seed": seed, "std": std, "source": model, "device": torch.device(device).type}
    shapes = parameter_shapes(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    from safetensors.torch import save_file

    sizes = {name: shape.numel() * dtype.itemsize for name, shape in shapes.items()}
    shards = plan_shards(sizes, shard_bytes)
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: draw(name, shapes[name], seed, std, dtype, device) for name in names}
        save_file(tensors, out / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
        del tensors  # before the next shard is drawn: at most one shard in memory
    index_json = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return out
