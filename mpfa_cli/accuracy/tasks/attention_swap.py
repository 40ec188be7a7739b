"""Swap a transformers model's attention computation for a variant of the numerics reference.

transformers (5.x) calls the function registered under the model's `attn_implementation` with query [B, Hq, S, d]
and the cache-updated key/value [B, Hkv, K, d] (RoPE applied, GQA heads not repeated); `VariantAttention`
registers one such function per variant that runs the reference (`prepare_batch` + `attend_prepared_batch`: the
tiled `mpfa.kernels.attention` with all KV tiles computed at once, vectorized over the batch, its sums formed in
float64 and rounded once) instead, so only the attention math changes (projections, RoPE, cache and LM head stay
the model's own).

Batches: rows may be padded. The caller says which cache slots hold each row's tokens with `set_key_mask(mask)`
([B, K] bool over the slots the next forward call's keys will have: the cached ones, then its own tokens) before
each forward call, and gives explicit `position_ids` so RoPE sees each row's own positions; without a mask every
slot is a token (unpadded rows, e.g. batch 1). Each call gathers every row's valid keys, in slot order, into a
compact right-padded [B, Kmax] layout (one index op per tensor), so a row's KV tiles start at its first token as
when it runs alone, whatever the padding or the gaps left by padded decode steps; padding keys are masked (-inf
score: P = 0, running max unchanged) and padding queries give 0. transformers' own mask is not built (the
registered mask function returns None): the slot mask is the only masking. Each row's attention output is thus
that of running alone, bit for bit but for vanishing cases (sums in float64, see `VariantAttention`); the model's
own GEMMs (projections, MLP, LM head) may still round differently with the batch shape, and the variants'
BF16 / FP8 / NVFP4 roundings can turn such one-ulp differences into different greedy answers.

Smoothing variants (mpfa, qk4-pv16, qk4-pv4) center Q and K with per-request means taken over the prompt and then
frozen: the prefill call of each layer (query length == key length) computes each row's means from that layer's
BF16 Q/K of the row's valid prompt tokens (`masked_means`) and keeps them; later calls of the same batch (decode
steps, or continuations scored on top of the prompts' cache) reuse them. Call `reset()` before each new batch, and
`select_rows(index)` when the cache's rows are selected or repeated (`Cache.batch_select_indices`).

FP8 with calibrated scales (`fp8-calibrated`): the `fp8` variant with one K and one V scale per layer and KV head,
amax / 448 over a calibration text (`calibrate_kv_scales`: one BF16 forward pass, the largest |K| and |V| each KV
head saw), fixed for every request as a calibrated checkpoint's scales are; `fp8` itself uses scale 1.0, what a
server does without calibrated scales.

Limits: causal decoder self-attention, no sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....kernels.formats import e4m3_amax_scale
from ....kernels.reference import CALIBRATED, VARIANTS, attend_prepared_batch, piecewise_keys, prepare_batch
from ....kernels.smoothing import SmoothingMeans, masked_means


class AttentionSwapError(ValueError):
    """The model or the call does not fit what the swapped attention supports."""


SWAP_VARIANTS = (*VARIANTS, *CALIBRATED)

# (K scale, V scale) per layer, each one FP32 value per KV head [Hkv].
KVScales = dict[int, tuple[torch.Tensor, torch.Tensor]]


def implementation_name(variant: str) -> str:
    """The `attn_implementation` name under which a variant is registered."""
    return f"mpfa_{variant}"


@dataclass(frozen=True)
class _KeyOperands:
    """A layer's prepared key operands per cache slot [B, K, ...] for the current batch and the keys (as the model
    passed them, [B, K, Hkv, d]) they are of."""

    keys: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    delta_s: torch.Tensor | None

    def rows(self, index: torch.Tensor) -> _KeyOperands:
        pick = lambda x: None if x is None else x[index.to(x.device)]  # noqa: E731
        return _KeyOperands(pick(self.keys), pick(self.k), pick(self.v), pick(self.delta_s))


@dataclass(frozen=True)
class _Layout:
    """Where each row's tokens are among the cache slots of one forward call (the same for every layer).

    ``key_index`` [B, Kmax]: the slot of row b's j-th valid key (its slots past its count are padding, masked);
    ``query_positions`` [B, S]: the compact index of the last key each query sees, -1 for padding queries;
    ``key_lengths`` [B]; ``key_valid`` [B, K] / ``query_valid`` [B, S]: the slot mask. All None: every slot valid."""

    key_index: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    key_lengths: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # [B, 1]: arange(B), to index with key_index

    def compact(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """x [B, K, ...] per slot -> [B, Kmax, ...], each row's valid keys first."""
        if x is None or self.key_index is None:
            return x
        return x[self.rows, self.key_index]


class VariantAttention:
    """The attention function of one reference variant, with the frozen means of the current batch.

    Where the variant prepares each key on its own (`piecewise_keys`), the prepared K/V/Delta_S of the cache slots
    seen so far are kept per layer (per slot, before compaction, rows as in the cache) and only the slots of new
    tokens are prepared: a decode step quantizes one token per row, not the whole cache. A call whose earlier keys
    differ from the kept ones (another batch, a re-scored prefix of other length) prepares everything again.
    Kept in batched mode too: on the CPU it saves most of a decode step's time; on a GPU, where a call's time is
    its number of tensor ops, it neither helps nor costs much (the reuse check is one comparison).

    S, l and P V are summed exactly (`attend_prepared_batch(exact_sums=True)`) and the smoothing means too
    (`masked_means`): a row's attention output does not depend on the shapes BLAS sees, i.e. on the batch it runs
    in, bit for bit but for vanishing cases. ``block_n``: the KV tile size (the kernels' 128)."""

    block_n = 128
    score_elements = 1 << 27  # scores per chunk of query rows (float64 temporaries: a few GB at most)

    def __init__(self, variant: str, kv_scales: KVScales | None = None):
        if variant not in SWAP_VARIANTS:
            raise AttentionSwapError(f"unknown attention variant {variant!r}; choose one of {', '.join(SWAP_VARIANTS)}")
        if (variant in CALIBRATED) != (kv_scales is not None):
            raise AttentionSwapError(f"{variant}: calibrated K/V scales go with {', '.join(CALIBRATED)} only, "
                                     "and these need them (calibrate_kv_scales)")
        self.name = variant
        self.variant = CALIBRATED.get(variant, variant)
        self.kv_scales = kv_scales or {}
        self.kv_amax: KVScales | None = None  # when a dict: record each layer's per-head amax of K and V (bf16 only)
        self.smoothing = VARIANTS[self.variant].smoothing
        self.keep_keys = piecewise_keys(self.variant)
        self._means: dict[int, SmoothingMeans] = {}
        self._keys: dict[int, _KeyOperands] = {}
        self._key_mask: torch.Tensor | None = None
        self._layouts: dict[tuple, _Layout] = {}

    def reset(self) -> None:
        """Forget the frozen means, kept keys and slot mask: the next call of every layer is a new batch's prefill."""
        self._means.clear()
        self._keys.clear()
        self.set_key_mask(None)

    def set_key_mask(self, mask: torch.Tensor | None) -> None:
        """Which cache slots of the next forward call hold each row's tokens: bool [B, K], K the cache length after
        that call (a 2D `attention_mask` as transformers takes it); None: all of them. Set it before every forward
        call of a padded batch (a mask whose shape does not fit a call is an error)."""
        self._key_mask = None if mask is None else torch.as_tensor(mask).detach().to("cpu", torch.bool)
        if self._key_mask is not None and self._key_mask.dim() != 2:
            raise AttentionSwapError(f"the key mask must be [batch, keys], got shape {tuple(self._key_mask.shape)}")
        self._layouts.clear()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (repeats allowed) of the frozen means and kept keys, as `Cache.batch_select_indices`
        does to the model's cache (e.g. one row per choice on a cache prefilled once per question)."""
        index = torch.as_tensor(index).long()
        self._means = {layer: SmoothingMeans(m.q_mean[index.to(m.q_mean.device)], m.k_mean[index.to(m.k_mean.device)])
                       for layer, m in self._means.items()}
        self._keys = {layer: kept.rows(index) for layer, kept in self._keys.items()}
        self.set_key_mask(None if self._key_mask is None else self._key_mask[index.cpu()])

    def _layout(self, batch: int, len_q: int, len_k: int, device: torch.device) -> _Layout:
        key = (batch, len_q, len_k, str(device))
        if key in self._layouts:
            return self._layouts[key]
        mask = self._key_mask
        if mask is not None and tuple(mask.shape) != (batch, len_k):
            raise AttentionSwapError(f"the key mask is {tuple(mask.shape)} but the call has {batch} rows of {len_k} "
                                     "keys: set_key_mask before each forward call")
        if mask is None or bool(mask.all()):
            layout = _Layout()
        else:
            lengths = mask.sum(1)
            kmax = max(int(lengths.max()), 1)
            key_index = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)[:, :kmax]
            positions = mask.cumsum(1) - 1
            query_valid = mask[:, len_k - len_q:]
            query_positions = torch.where(query_valid, positions[:, len_k - len_q:], -1)
            rows = torch.arange(batch)[:, None]
            layout = _Layout(*(x.to(device) for x in (key_index, query_positions, lengths, mask, query_valid, rows)))
        self._layouts[key] = layout
        return layout

    def _layer_means(self, layer: int, q: torch.Tensor, k: torch.Tensor, layout: _Layout) -> SmoothingMeans | None:
        if not self.smoothing:
            return None
        if q.shape[1] == k.shape[1]:  # prefill: means over each row's BF16 prompt Q/K, frozen for the batch
            q16, k16 = q.to(torch.bfloat16), k.to(torch.bfloat16)
            self._means[layer] = SmoothingMeans(masked_means(q16, layout.query_valid),
                                                masked_means(k16, layout.key_valid))
        elif layer not in self._means:
            raise AttentionSwapError(f"layer {layer}: a decode call before any prefill (call reset() per request)")
        means = self._means[layer]
        if means.q_mean.shape[0] != q.shape[0]:
            raise AttentionSwapError(f"layer {layer}: means of {means.q_mean.shape[0]} rows for a call of "
                                     f"{q.shape[0]} rows (select_rows after selecting the cache's rows)")
        return means

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("sliding_window") is not None:
            raise AttentionSwapError("sliding-window attention is not supported by the swapped attention")
        layout = self._layout(query.shape[0], query.shape[2], key.shape[2], query.device)
        # [B, H, S, d] -> [B, S, H, d], the reference's padded-batch layout
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        means = self._layer_means(module.layer_idx, q, k, layout)
        if self.kv_amax is not None:
            self._record_amax(module.layer_idx, layout.compact(k), layout.compact(v), layout.key_lengths)
        sm_scale = module.scaling if scaling is None else scaling
        if self.keep_keys:
            q_op, kept = self._operands(module.layer_idx, q, k, v, means)
            k_op, v_op, ds = layout.compact(kept.k), layout.compact(kept.v), layout.compact(kept.delta_s)
        else:  # float64, NVFP4 V (blocked along tokens): compact the raw keys, then prepare them
            ops = prepare_batch(q, layout.compact(k), layout.compact(v), variant=self.variant, means=means,
                                key_lengths=layout.key_lengths, **self._scales(module.layer_idx))
            q_op, k_op, v_op, ds = ops.q, ops.k, ops.v, ops.delta_s
        out = self._attend_in_chunks(q_op, k_op, v_op, ds, sm_scale, layout)
        return out.to(query.dtype), None  # [B, S, Hq, d], no attention weights

    def _attend_in_chunks(self, q_op: torch.Tensor, k_op: torch.Tensor, v_op: torch.Tensor,
                          ds: torch.Tensor | None, sm_scale: float, layout: _Layout) -> torch.Tensor:
        """`attend_prepared_batch` over chunks of query rows, each with S no larger than `score_elements`, and only
        the KV tiles its last query reaches (the tiles past it are fully masked: they add exact zeros). Rows do not
        interact, so the output is that of one call, bit for bit; a 32K prompt's one call would need ~100 GB."""
        batch, len_q, num_q_heads = q_op.shape[:3]
        len_k = k_op.shape[1]
        positions = layout.query_positions
        if positions is None:  # every slot valid: query i sees keys up to i + len_k - len_q
            positions = (torch.arange(len_q, device=q_op.device) + (len_k - len_q)).expand(batch, len_q)
        lengths = layout.key_lengths
        if lengths is None:
            lengths = torch.full((batch,), len_k, device=q_op.device, dtype=torch.long)
        rows = max(1, self.score_elements // (batch * num_q_heads * len_k))
        outs = []
        for start in range(0, len_q, rows):
            chunk = positions[:, start:start + rows]
            reach = -(-(int(chunk.max()) + 1) // self.block_n) * self.block_n
            end = min(len_k, max(reach, self.block_n))
            outs.append(attend_prepared_batch(
                q_op[:, start:start + rows], k_op[:, :end], v_op[:, :end], None if ds is None else ds[:, :end],
                variant=self.variant, sm_scale=sm_scale, block_n=self.block_n, key_lengths=lengths.clamp(max=end),
                query_positions=chunk, exact_sums=True))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _operands(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  means: SmoothingMeans | None) -> tuple[torch.Tensor, _KeyOperands]:
        """This call's Q operand and the per-slot operands of all its keys, reusing the kept ones of earlier slots
        (only for variants that prepare keys piecewise: `keep_keys`)."""
        start = k.shape[1] - q.shape[1]
        kept = self._keys.get(layer)
        reuse = (kept is not None and kept.keys.shape[0] == k.shape[0] and kept.keys.shape[1] >= start > 0
                 and torch.equal(kept.keys[:, :start], k[:, :start]))
        new = prepare_batch(q, k[:, start:] if reuse else k, v[:, start:] if reuse else v, variant=self.variant,
                            means=means, **self._scales(layer))
        if reuse:
            ds = None if new.delta_s is None else torch.cat([kept.delta_s[:, :start], new.delta_s], 1)
            ops = _KeyOperands(k, torch.cat([kept.k[:, :start], new.k], 1), torch.cat([kept.v[:, :start], new.v], 1),
                               ds)
        else:
            ops = _KeyOperands(k, new.k, new.v, new.delta_s)
        self._keys[layer] = ops
        return new.q, ops


    def _scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The calibrated K/V scales of `layer` as `prepare_batch` arguments; none for uncalibrated variants."""
        if not self.kv_scales:
            return {}
        if layer not in self.kv_scales:
            raise AttentionSwapError(f"no calibrated K/V scales for layer {layer}")
        k_scale, v_scale = self.kv_scales[layer]
        return {"k_scale": k_scale, "v_scale": v_scale}

    def _record_amax(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None) -> None:
        """Fold the largest |K| and |V| of each KV head over the valid keys [B, L, Hkv, d] into `kv_amax`."""
        if lengths is not None:
            valid = (torch.arange(k.shape[1], device=k.device)[None] < lengths[:, None])[..., None, None]
            k, v = k.masked_fill(~valid, 0), v.masked_fill(~valid, 0)
        new = tuple(x.to(torch.bfloat16).float().abs().amax(dim=(0, 1, 3)).cpu() for x in (k, v))
        old = self.kv_amax.get(layer)
        self.kv_amax[layer] = new if old is None else (torch.maximum(old[0], new[0]), torch.maximum(old[1], new[1]))


def calibrate_kv_scales(model, ids: list[int]) -> KVScales:
    """Per layer, K and V scales per KV head, amax / 448 of the BF16 keys and values of one forward pass over `ids`
    (all-zero heads get 1.0)."""
    fn = install(model, "bf16")
    fn.kv_amax = {}
    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    if not fn.kv_amax:
        raise AttentionSwapError("the calibration pass reached no attention layer")
    return {layer: tuple(e4m3_amax_scale(a) for a in amax) for layer, amax in fn.kv_amax.items()}


def _no_mask(*_args, **_kwargs) -> None:
    """transformers' mask function for the swapped attention: none is built (the slot mask does the masking)."""
    return None


def install(model, variant: str, kv_scales: KVScales | None = None) -> VariantAttention:
    """Register `variant` (with its calibrated `kv_scales`, for `CALIBRATED` variants) with transformers and switch
    `model` to it; returns the function (for `reset()`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(model.config, "use_sliding_window", False):
        raise AttentionSwapError("models with sliding-window attention are not supported")
    fn = VariantAttention(variant, kv_scales)
    name = implementation_name(variant)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _no_mask)
    model.set_attn_implementation(name)
    return fn
