"""The attention problem being profiled, and the work it implies: exact FLOPs and the bytes a kernel must move.

FLOPs count the two matmuls only (QK^T and PV, 2 FLOPs per multiply-add each), over the (query, key) pairs
the mask keeps: a causal prefill of S tokens keeps S(S+1)/2 pairs per sequence and query head, a decode step
against an S-token cache keeps S. Softmax work and the masked half of diagonal tiles are not counted.

Bytes are the minimum traffic: Q read once, O written once, the KV cache read once, at the sizes the backend
stores them in (the cache's per-token size comes from `mpfa.kernels.kv_capacity`). Page tables, indices and
split-KV partials are not counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..kernels.kv_capacity import kv_bytes_per_token

KINDS = ("prefill", "decode")
_SEQ_SUFFIX = {"": 1, "k": 1024, "m": 1024 * 1024}


@dataclass(frozen=True)
class TensorFormat:
    """How a backend stores its tensors: bytes per element of Q and O, and its KV-cache format (one of
    `mpfa.kernels.kv_capacity.CACHE_FORMATS`, which gives the cache's bytes per token and KV head)."""

    q: float
    o: float
    kv_cache: str


BF16 = TensorFormat(q=2, o=2, kv_cache="bf16")
BF16_Q_FP8_KV = TensorFormat(q=2, o=2, kv_cache="fp8")
FP8_Q_FP8_KV = TensorFormat(q=1, o=2, kv_cache="fp8")  # FA3 with an FP8 cache: Q cast to e4m3, BF16 out
MPFA = TensorFormat(q=2, o=2, kv_cache="mpfa")  # NVFP4 K + scales, FP8 V, and the BF16 Delta_S side cache


@dataclass(frozen=True)
class AttentionWorkload:
    """One attention call: `seq` is the prompt length (prefill) or the KV-cache length (decode)."""

    kind: str
    seq: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown profile kind {self.kind!r} (choose from {', '.join(KINDS)})")
        for name in ("seq", "batch", "q_heads", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"query heads ({self.q_heads}) must be a multiple of KV heads ({self.kv_heads})")
        if self.head_dim % 16:
            raise ValueError(f"head-dim must be a multiple of 16, got {self.head_dim}")

    @property
    def q_len(self) -> int:
        """Query tokens per sequence."""
        return self.seq if self.kind == "prefill" else 1

    @property
    def pairs_per_head(self) -> int:
        """(query, key) pairs one query head of one sequence attends over."""
        return self.seq * (self.seq + 1) // 2 if self.kind == "prefill" else self.seq

    def flops(self) -> int:
        return 4 * self.batch * self.q_heads * self.head_dim * self.pairs_per_head

    def q_elements(self) -> int:
        """Elements of Q (and of O)."""
        return self.batch * self.q_len * self.q_heads * self.head_dim

    def kv_cache_bytes(self, fmt: TensorFormat) -> float:
        """Bytes of every sequence's KV cache (K and V, plus any side data the format keeps per token)."""
        per_token_head = kv_bytes_per_token(fmt.kv_cache, self.head_dim, self.q_heads // self.kv_heads)
        return self.batch * self.seq * self.kv_heads * per_token_head

    def bytes_needed(self, fmt: TensorFormat) -> float:
        return self.q_elements() * (fmt.q + fmt.o) + self.kv_cache_bytes(fmt)

    def label(self) -> str:
        return (f"{self.kind} seq={self.seq} batch={self.batch} heads={self.q_heads}:{self.kv_heads} "
                f"head_dim={self.head_dim}")


def parse_seq(text: str) -> int:
    """'16384', '64k' (x1024) or '1m' (x1024^2) -> tokens."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"bad sequence length {text!r} (expected a positive count like 16384 or 64k)")
    return int(match.group(1)) * _SEQ_SUFFIX[match.group(2).lower()]


def parse_heads(text: str) -> tuple[int, int]:
    """'32:8' -> (32 query heads, 8 KV heads); '32' -> (32, 32)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not match:
        raise ValueError(f"bad heads {text!r} (expected QUERY:KV like 32:8)")
    q_heads = int(match.group(1))
    return q_heads, int(match.group(2) or q_heads)

