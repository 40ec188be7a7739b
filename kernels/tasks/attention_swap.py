"""Swap a transformers model's attention computation for a variant of the numerics reference.

transformers (5.x) calls the function registered under the model's `attn_implementation` with query [B, Hq, S, d]
and the cache-updated key/value [B, Hkv, S_k, d] (RoPE applied, GQA heads not repeated); `VariantAttention`
registers one such function per variant that runs the reference (`attention_one_sequence`: the tiled
`mpfa.kernels.attention` with all KV tiles computed at once) instead, so only the attention math
changes (projections, RoPE, cache and LM head stay the model's own).

Smoothing variants (mpfa, qk4-pv16, qk4-pv4) center Q and K with per-request means taken over the prompt and then
frozen: the prefill call of each layer (query length == key length) computes the means from that layer's prompt
Q/K and keeps them; later calls of the same request (decode steps, or a continuation scored on top of the prompt's
cache) reuse them. Call `reset()` before each new request.

Limits: one unpadded sequence per call (batch 1), causal decoder self-attention, no sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpfa.kernels.reference import (
    VARIANTS,
    attend_prepared,
    attention_one_sequence,
    piecewise_keys,
    prepare_one_sequence,
)
from mpfa.kernels.smoothing import SmoothingMeans, sequence_means


class AttentionSwapError(ValueError):
    """The model or the call does not fit what the swapped attention supports."""


def implementation_name(variant: str) -> str:
    """The `attn_implementation` name under which a variant is registered."""
    return f"mpfa_{variant}"


@dataclass(frozen=True)
class _KeyOperands:
    """A layer's prepared key operands for the current request and the keys (as the model passed them) they are of."""

    keys: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    delta_s: torch.Tensor | None


class VariantAttention:
    """The attention function of one reference variant, with the frozen means of the current request.

    Where the variant prepares each key on its own (`piecewise_keys`), the prepared K/V/Delta_S of the keys seen so
    far are kept per layer and only new keys are prepared (a decode step quantizes one token, not the whole
    cache); a call whose earlier keys differ from the kept ones (another request, a re-scored prefix of other
    length) prepares everything again."""

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise AttentionSwapError(f"unknown attention variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        self.variant = variant
        self.smoothing = VARIANTS[variant].smoothing
        self.keep_keys = piecewise_keys(variant)
        self._means: dict[int, SmoothingMeans] = {}
        self._keys: dict[int, _KeyOperands] = {}

    def reset(self) -> None:
        """Forget the frozen means and kept keys: the next call of every layer is a new request's prefill."""
        self._means.clear()
        self._keys.clear()

    def _layer_means(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> SmoothingMeans | None:
        if not self.smoothing:
            return None
        if q.shape[0] == k.shape[0]:  # prefill: means over the prompt's BF16 Q/K, frozen for the request
            one = torch.tensor([0, q.shape[0]])
            q16, k16 = q.to(torch.bfloat16), k.to(torch.bfloat16)
            self._means[layer] = SmoothingMeans(sequence_means(q16, one), sequence_means(k16, one))
        elif layer not in self._means:
            raise AttentionSwapError(f"layer {layer}: a decode call before any prefill (call reset() per request)")
        return self._means[layer]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[0] != 1:
            raise AttentionSwapError(f"the swapped attention runs one sequence per call, got batch {query.shape[0]}")
        if kwargs.get("sliding_window") is not None:
            raise AttentionSwapError("sliding-window attention is not supported by the swapped attention")
        # [1, H, S, d] -> [S, H, d], the reference's packed layout
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        means = self._layer_means(module.layer_idx, q, k)
        sm_scale = module.scaling if scaling is None else scaling
        if VARIANTS[self.variant].q == "exact":
            out = attention_one_sequence(q, k, v, variant=self.variant, sm_scale=sm_scale)
        else:
            q_op, kept = self._operands(module.layer_idx, q, k, v, means)
            out = attend_prepared(q_op, kept.k, kept.v, kept.delta_s, variant=self.variant, sm_scale=sm_scale)
        return out.to(query.dtype)[None], None  # [1, S, Hq, d], no attention weights

    def _operands(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  means: SmoothingMeans | None) -> tuple[torch.Tensor, _KeyOperands]:
        """This call's Q operand and the operands of all its keys, reusing the kept ones of earlier keys."""
        start = k.shape[0] - q.shape[0]
        kept = self._keys.get(layer)
        reuse = (kept is not None and kept.keys.shape[0] >= start > 0
                 and torch.equal(kept.keys[:start], k[:start]))
        new = prepare_one_sequence(q, k[start:] if reuse else k, v[start:] if reuse else v, variant=self.variant,
                                   means=means)
        if reuse:
            ds = None if new.delta_s is None else torch.cat([kept.delta_s[:start], new.delta_s])
            ops = _KeyOperands(k, torch.cat([kept.k[:start], new.k]), torch.cat([kept.v[:start], new.v]), ds)
        else:
            ops = _KeyOperands(k, new.k, new.v, new.delta_s)
        if self.keep_keys:
            self._keys[layer] = ops
        return new.q, ops


def install(model, variant: str) -> VariantAttention:
    """Register `variant` with transformers and switch `model` to it; returns the function (for `reset()`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "use_sliding_window", False):
        raise AttentionSwapError("models with sliding-window attention are not supported")
    fn = VariantAttention(variant)
    name = implementation_name(variant)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)  # the mask is built but unused: causal, one sequence
    model.set_attn_implementation(name)
    return fn
