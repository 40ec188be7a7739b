"""Calibrated FP8 KV-cache scales in a BF16 checkpoint, in the one form SGLang 0.5.15.post1 applies with FA3.

How that SGLang reads KV scales (paths under `sglang/srt/`):

* A Qwen2 checkpoint's tensors load only under the model's own parameter names: `models/qwen2.py`
  (`Qwen2ForCausalLM.load_weights`) never calls `model_loader/weight_utils.py` `maybe_remap_kv_scale_name` (llama.py
  and qwen3.py do), so `self_attn.k_scale`, `k_proj.k_scale` or `k_proj.output_scale` are dropped ("Parameter ...
  not found in params_dict").
* Those parameters exist only where a quantization config gives each `RadixAttention` (`layers/radix_attention.py`,
  `k_scale = None` otherwise) a KV-cache method: `layers/quantization/kv_cache.py` `BaseKVCacheMethod` registers
  `attn.k_scale` and `attn.v_scale`, one float32 scalar each, and its `process_weights_after_loading` accepts one
  value per tensor only ("Only support per-tensor scaling factor for fp8 KV cache"). compressed-tensors'
  `kv_cache_scheme` gets no such method in this version (`compressed_tensors.py` `get_quant_method`).
* `--quantization-param-path FILE.json` (`kv_cache_scales_loader`, `Qwen2Model.load_kv_cache_scales`) sets one
  Python float per layer for K and V alike, which the FA3 backend cannot use: it calls `layer.k_scale.expand`.
* With an FP8 cache, `layers/attention/flashattention_backend.py` stores `k / k_scale` and `v / v_scale`
  (`mem_cache/memory_pool.py` `MHATokenToKVPool.set_kv_buffer`: the post-bias, post-RoPE K the model hands the
  attention) and passes `k_scale.expand(batch, kv_heads)` as FA3's `k_descale` (V alike). FA3 takes a descale per
  sequence and KV head, but SGLang fills it with the layer's one value, and divides the cache writes by it: **one K
  and one V scale per layer is the finest this path serves.** Q is cast to e4m3 unscaled, as in `fa3-fp8`.

So the scales are tensors `model.layers.{i}.self_attn.attn.k_scale` / `v_scale` (float32 scalars) in
`kv_scales.safetensors` beside the weights, and the server that applies them is started with a ModelOpt FP8
quantization config that quantizes no module (`--json-model-override-args`, `SGLANG_ARGS`):
`configs/model_config.py` reads a `quantization_config` of quant_method "modelopt" as modelopt_fp8, and
`layers/quantization/modelopt_quant.py` (`ModelOptQuantConfig._get_quant_method`) gives every linear layer, all
matched by `ignore: ["*"]`, the unquantized method and every RadixAttention `ModelOptFp8KVCacheMethod`. Only the
backend that asks for the scales carries the override: other backends load the same directory unchanged (SGLang
drops the scale tensors their model lacks). A `hf_quant_config.json` in the directory would instead be read by every
server, and would turn the BF16 cache of `--kv-cache-dtype auto` into FP8 (`model_executor/model_runner.py`
`configure_kv_cache_dtype`). transformers loads the checkpoint as before: a lone `model.safetensors` is read alone,
and a sharded checkpoint's index lists the scales (which SGLang needs there: it loads only indexed files), left
unused as unexpected keys.

These names hold for Qwen2 (`Qwen2ForCausalLM`) alone: loaders that do remap scale names (llama.py, qwen3.py) would
turn `self_attn.attn.k_scale` into `self_attn.attn.attn.k_scale` and drop it, so other architectures are refused.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SCALES_FILE = "kv_scales.safetensors"
PROVENANCE_FILE = "kv_scales.json"  # how the scales were calibrated, beside them
INDEX_FILE = "model.safetensors.index.json"
OPERANDS = ("k", "v")
ARCHITECTURES = ("Qwen2ForCausalLM",)  # whose SGLang loader takes the scales under `scale_name`
QUANTIZATION_CONFIG = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                       "ignore": ["*"]}
SGLANG_ARGS = ("--json-model-override-args", json.dumps({"quantization_config": QUANTIZATION_CONFIG}))


class KVScalesError(ValueError):
    """A checkpoint without usable KV scales, or scales that cannot be written."""


def scale_name(layer: int, operand: str) -> str:
    """The parameter SGLang loads the `operand` ("k" or "v") scale of `layer` into."""
    return f"model.layers.{layer}.self_attn.attn.{operand}_scale"


def layer_count(directory: Path) -> int:
    """The checkpoint's layer count, from its config.json; a KVScalesError for an architecture not served here."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KVScalesError(f"{directory}: no config.json with num_hidden_layers ({type(exc).__name__})") from None
    if not set(config.get("architectures") or ()) & set(ARCHITECTURES):
        raise KVScalesError(f"{directory}: architecture {config.get('architectures')} is not one whose SGLang loader "
                            f"takes the scales under these names ({', '.join(ARCHITECTURES)})")
    return layers


def _check(scales: Mapping[str, Sequence[float]], layers: int) -> None:
    for operand, values in scales.items():
        if len(values) != layers:
            raise KVScalesError(f"{len(values)} {operand.upper()} scales for {layers} layers")
        bad = [i for i, s in enumerate(values) if not (math.isfinite(s) and s > 0)]
        if bad:
            raise KVScalesError(f"layer {bad[0]}: {operand.upper()} scale {values[bad[0]]} is not a positive number")


def write_kv_scales(directory: Path, k: Sequence[float], v: Sequence[float],
                    provenance: Mapping[str, Any]) -> dict[str, Any]:
    """Write one K and one V scale per layer into the checkpoint `directory` (`SCALES_FILE`, listed in its index if
    it has one) and `provenance` with the scales as `PROVENANCE_FILE`; returns what that file holds."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    scales = {"k": [float(s) for s in k], "v": [float(s) for s in v]}
    _check(scales, layer_count(directory))
    tensors = {scale_name(layer, op): torch.tensor(s, dtype=torch.float32)
               for op, values in scales.items() for layer, s in enumerate(values)}
    save_file(tensors, directory / SCALES_FILE, metadata={"format": "pt"})
    index = directory / INDEX_FILE
    if index.exists():
        listing = json.loads(index.read_text())
        listing["weight_map"].update(dict.fromkeys(tensors, SCALES_FILE))
        index.write_text(json.dumps(listing, indent=2) + "\n")
    record = {**provenance, "k_scale": scales["k"], "v_scale": scales["v"]}
    (directory / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def read_kv_scales(directory: Path) -> dict[str, list[float]]:
    """The K and V scales per layer ({"k": [...], "v": [...]}) that SGLang would load from `directory`; a
    KVScalesError says why there are none."""
    directory = Path(directory)
    path = directory / SCALES_FILE
    if not path.is_file():
        raise KVScalesError(f"{directory} has no {SCALES_FILE}")
    layers = layer_count(directory)
    index = directory / INDEX_FILE
    if index.exists() and SCALES_FILE not in json.loads(index.read_text()).get("weight_map", {}).values():
        raise KVScalesError(f"{INDEX_FILE} does not list {SCALES_FILE}, so SGLang would not load it")
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            stored = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise KVScalesError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    scales: dict[str, list[float]] = {}
    for op in OPERANDS:
        names = [scale_name(i, op) for i in range(layers)]
        if wrong := next((n for n in names if n not in stored or stored[n].numel() != 1), None):
            raise KVScalesError(f"{path}: {wrong} is {'not one value' if wrong in stored else 'missing'}")
        scales[op] = [float(stored[n]) for n in names]
    _check(scales, layers)
    return scales
