"""The simulator's latency model: SIMULATED step times per attention backend, not measurements.

The simulator (`mpfa serve-sim`) sleeps for these times so the whole benchmark path (scheduling, streaming,
client, metrics, store, reports) can run without a GPU. The numbers are a roofline sketch of one H200 serving
one model; the per-backend efficiencies and K/V bytes (each backend's `SimulatedCosts`, declared with its spec)
are plausible assumptions chosen to make the backends differ the way their designs suggest, never results.
Nothing measured on the simulator says anything about real kernels.

Notation: P = parameters that take part in the per-token matmuls (all layers + LM head), W = weight bytes,
L = layers, H = query heads, d = head dim, Hkv = KV heads, F = dense BF16 peak FLOP/s, B = HBM bandwidth.

    linear(t)        = max(2·P·t / (GEMM_EFFICIENCY·F),  W / (WEIGHT_STREAM_EFFICIENCY·B))   # t tokens in a step
    prefill(n_1..n_k) = overhead + linear(Σ (n_i − c_i)) + Σ 4·L·H·d·(n_i(n_i+1) − c_i(c_i+1))/2 / (attention_efficiency·F)
    decode(c_1..c_k)  = overhead + linear(k) + Σ c_i · kv_bytes_per_token / (kv_bandwidth_efficiency·B)
    kv_bytes_per_token = L·Hkv·d·(k_bytes_per_element + v_bytes_per_element)
    kv_capacity_tokens = (MEM_FRACTION_STATIC·HBM_BYTES − W) / kv_bytes_per_token

The prefill attention term counts QKᵀ and PV (2 matmuls × 2 FLOP per multiply-add) over the causal half of
the n×n score matrix, less the rows of the c_i prompt tokens a prefix cache already holds (their queries are not
computed; the new ones still attend to the whole context); decode attention is bound by reading each running request's KV cache once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...backends.specs import BF16_BYTES_PER_ELEMENT, SimulatedCosts

# One H200 (SXM), from the public spec sheet.
HBM_BYTES = 141e9
HBM_BANDWIDTH = 4.8e12  # bytes/s
DENSE_BF16_FLOPS = 989e12

# Assumed fractions of peak, shared by every backend (the backends differ only in attention and KV cache).
GEMM_EFFICIENCY = 0.6
WEIGHT_STREAM_EFFICIENCY = 0.8
MEM_FRACTION_STATIC = 0.85  # share of HBM for weights + KV cache, as SGLang's --mem-fraction-static


@dataclass(frozen=True)
class ModelShape:
    """The geometry of the served model, which is all the latency model needs of it."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_hf_config(cls, name: str, config: dict[str, Any]) -> "ModelShape":
        """From a HuggingFace `config.json` of a dense decoder (Llama/Qwen style, gated MLP)."""
        try:
            hidden = int(config["hidden_size"])
            q_heads = int(config["num_attention_heads"])
            return cls(
                name=name,
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                q_heads=q_heads,
                kv_heads=int(config.get("num_key_value_heads", q_heads)),
                head_dim=int(config.get("head_dim") or hidden // q_heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ValueError(f"model config '{name}' lacks {exc.args[0]}") from None

    @property
    def matmul_params(self) -> int:
        """Parameters each token multiplies through: attention and gated-MLP projections, and the LM head."""
        attention = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> float:
        embedding = 0 if self.tied_embeddings else self.vocab * self.hidden
        return BF16_BYTES_PER_ELEMENT * (self.matmul_params + embedding)


@dataclass(frozen=True)
class LatencyModel:
    """Simulated step times of one backend serving one model (seconds, before any time scaling)."""

    costs: SimulatedCosts  # the backend's, from its spec
    model: ModelShape

    @property
    def kv_bytes_per_token(self) -> float:
        m = self.model
        return m.layers * m.kv_heads * m.head_dim * (self.costs.k_bytes_per_element + self.costs.v_bytes_per_element)

    @property
    def kv_capacity_tokens(self) -> int:
        free = MEM_FRACTION_STATIC * HBM_BYTES - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"model '{self.model.name}' does not fit in the simulated GPU's memory")
        return int(free // self.kv_bytes_per_token)

    def _linear_seconds(self, tokens: int) -> float:
        compute = 2 * self.model.matmul_params * tokens / (GEMM_EFFICIENCY * DENSE_BF16_FLOPS)
        stream = self.model.weight_bytes / (WEIGHT_STREAM_EFFICIENCY * HBM_BANDWIDTH)
        return max(compute, stream)

    def prefill_seconds(self, prompt_lens: Sequence[int], cached_lens: Sequence[int] | None = None) -> float:
        """One prefill step over new prompts of these lengths (each also yields its first output token), of which
        the first `cached_lens` tokens each are in the prefix cache (default: none)."""
        if not prompt_lens:
            raise ValueError("a prefill step needs at least one prompt")
        cached = list(cached_lens) if cached_lens is not None else [0] * len(prompt_lens)
        if len(cached) != len(prompt_lens) or not all(0 <= c < n for c, n in zip(cached, prompt_lens)):
            raise ValueError("each prompt's cached tokens must be in [0, its length)")
        m = self.model
        pairs = sum((n * (n + 1) - c * (c + 1)) / 2 for n, c in zip(prompt_lens, cached))
        attention = 4 * m.layers * m.q_heads * m.head_dim * pairs / (self.costs.attention_efficiency * DENSE_BF16_FLOPS)
        return self.costs.step_overhead_s + self._linear_seconds(sum(prompt_lens) - sum(cached)) + attention

    def decode_step_seconds(self, context_lens: Sequence[int]) -> float:
        """One decode step for running requests whose KV caches hold these many tokens each."""
        if not context_lens:
            raise ValueError("a decode step needs at least one running request")
        kv_read = sum(context_lens) * self.kv_bytes_per_token / (self.costs.kv_bandwidth_efficiency * HBM_BANDWIDTH)
        return self.costs.step_overhead_s + self._linear_seconds(len(context_lens)) + kv_read


def point_seconds(model: LatencyModel, input_len: int, output_len: int, num_requests: int,
                  concurrency: int | None, rate: float | None) -> float:
    """Rough modelled duration of one load point: closed loops run in rounds of `concurrency` requests, each a
    batched prefill and `output_len - 1` decode steps at the mean context; an open loop lasts its arrivals plus
    one request's service time. An estimate for planning, not what a run will measure."""
    def round_seconds(batch: int) -> float:
        contexts = [input_len + output_len // 2] * batch
        return model.prefill_seconds([input_len] * batch) + (output_len - 1) * model.decode_step_seconds(contexts)

    if rate is not None:
        return num_requests / rate + round_seconds(1)
    batch = min(concurrency or num_requests, num_requests)
    full, rest = divmod(num_requests, batch)
    return full * round_seconds(batch) + (round_seconds(rest) if rest else 0.0)
