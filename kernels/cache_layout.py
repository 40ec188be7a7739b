"""The MpFA paged KV cache of one layer, as the sm90 kernels write and read it.

Tokens live in *slots*, numbered like SGLang's KV pool: ``slot = page * page_size + offset``; the KV-write path
receives the slots of the new tokens (SGLang's ``out_cache_loc``) and decode reads a request's tokens through a
page table [batch, max_pages] (token t of request b sits in slot ``page_table[b, t // page_size] * page_size +
t % page_size``). Per slot, token-major like SGLang's ``k_buffer`` / ``v_buffer``:

* ``k_codes``  uint8 [num_slots, Hkv, d/2]: centered K in NVFP4, two e2m1 codes per byte (element 2i in the low
  nibble), blocks of 16 along head_dim; no global scale.
* ``k_scales`` float8_e4m3fn [num_slots, Hkv, d/16]: one e4m3 scale per 16-element block.
* ``v``        float8_e4m3fn [num_slots, Hkv, d]: V with scale 1.0 (saturating at +-448).
* ``delta_s``  bfloat16 [num_slots, Hq]: Delta_S[j, h] = Q_bar[h] . K_c[j, h // group] of the token's request.

The centered NVFP4 Q of the current step (``CenteredQuery``) has the same per-head layout as a K row.
Every row of a token is 16-byte aligned for d = 128 (64 + 8 + 128 bytes per KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpfa.kernels.formats import NVFP4_BLOCK

SUPPORTED_HEAD_DIMS = (128,)


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the sm90 MpFA kernels support head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")


@dataclass(frozen=True)
class CenteredQuery:
    """Centered NVFP4 Q: ``codes`` uint8 [tokens, Hq, d/2], ``scales`` float8_e4m3fn [tokens, Hq, d/16]."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def allocate(cls, num_tokens: int, num_q_heads: int, head_dim: int, device: torch.device | str) -> CenteredQuery:
        check_head_dim(head_dim)
        return cls(
            torch.empty((num_tokens, num_q_heads, head_dim // 2), dtype=torch.uint8, device=device),
            torch.empty((num_tokens, num_q_heads, head_dim // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=device),
        )


@dataclass(frozen=True)
class MpfaKVCache:
    """One layer's MpFA cache (see the module docstring for the layout)."""

    k_codes: torch.Tensor
    k_scales: torch.Tensor
    v: torch.Tensor
    delta_s: torch.Tensor
    page_size: int

    @classmethod
    def allocate(
        cls,
        num_pages: int,
        page_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> MpfaKVCache:
        check_head_dim(head_dim)
        if num_pages <= 0 or page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"need num_pages > 0 and a power-of-two page_size, got {num_pages} and {page_size}")
        if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"Hq ({num_q_heads}) must be a positive multiple of Hkv ({num_kv_heads})")
        slots = num_pages * page_size
        return cls(
            torch.empty((slots, num_kv_heads, head_dim // 2), dtype=torch.uint8, device=device),
            torch.empty((slots, num_kv_heads, head_dim // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((slots, num_kv_heads, head_dim), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((slots, num_q_heads), dtype=torch.bfloat16, device=device),
            page_size,
        )

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def num_q_heads(self) -> int:
        return self.delta_s.shape[1]

    @property
    def head_dim(self) -> int:
        return self.v.shape[2]

    def fill_(self, byte: int) -> MpfaKVCache:
        """Set every byte of the cache (tests poison it before a write)."""
        for field in (self.k_codes, self.k_scales, self.v, self.delta_s):
            field.view(torch.uint8).fill_(byte)
        return self

    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all heads (what decode reads per token)."""
        return sum(x[0].numel() * x.element_size() for x in (self.k_codes, self.k_scales, self.v, self.delta_s))


def slots_of(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots [sum(seq_lens)] of every request's tokens in order, through the page table (host-side glue)."""
    lengths = seq_lens.detach().to("cpu", torch.int64)
    table = page_table.detach().to("cpu", torch.int64)
    request = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(int(lengths.sum())) - starts[request]
    return table[request, position // page_size] * page_size + position % page_size
