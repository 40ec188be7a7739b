"""The MpFA paged KV cache of one layer, as the sm90 kernels write and read it.

Tokens live in *slots*, numbered like SGLang's KV pool: ``slot = page * page_size + offset``; the KV-write path
receives the slots of the new tokens (SGLang's ``out_cache_loc``) and decode reads a request's tokens through a
page table [batch, max_pages] (token t of request b sits in slot ``page_table[b, t // page_size] * page_size +
t % page_size``). K codes and V are token-major like SGLang's ``k_buffer`` / ``v_buffer``; the small per-token
values (K scales, Delta_S) are head-major, so that the keys of one KV head in consecutive slots (a page) are
contiguous bytes:

* ``k_codes``  uint8 [num_slots, Hkv, d/2]: centered K in NVFP4, two e2m1 codes per byte (element 2i in the low
  nibble), blocks of 16 along head_dim; no global scale.
* ``k_scales`` float8_e4m3fn [Hkv, num_slots, d/16]: one e4m3 scale per 16-element block.
* ``v``        float8_e4m3fn [num_slots, Hkv, d]: V with scale 1.0 (saturating at +-448).
* ``delta_s``  bfloat16 [Hkv, num_slots, `delta_s_row`(group)]: Delta_S[j, h] = Q_bar[h] . K_c[j, h // group] of
  the token's request at [h // group, j, h % group]; the entries past the group are padding, never written or read.

Why head-major: a decode warp reads one KV head, and DRAM delivers 32-byte sectors. Interleaved across heads
([slot, Hkv, 8] scales, [slot, Hq] Delta_S), each token cost the warp a sector of each for 8 bytes it used (4x
over-read of both streams); head-major, 32 consecutive keys of a head are 256 contiguous bytes of scales and
256 (group <= 4) or 512 (group 5..8) of Delta_S. K codes (64 B) and V (128 B) rows already fill whole sectors.

The centered NVFP4 Q of the current step (``CenteredQuery``) has the same per-head layout as a K row.
Every K code and V row is 16-byte aligned for d = 128 (64 and 128 bytes); scale and Delta_S rows are 8 or 16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import NVFP4_BLOCK

SUPPORTED_HEAD_DIMS = (128,)
DELTA_S_ROW_ALIGN = 4  # BF16 entries: every (KV head, slot) row of Delta_S is a multiple of 8 bytes


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the sm90 MpFA kernels support head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")


def delta_s_row(group: int) -> int:
    """BF16 entries of one (KV head, slot) row of Delta_S: the GQA group rounded up to a multiple of 4 (group 5 ->
    8). Rows of 8 or 16 bytes (every group the kernels take, <= 8) never straddle a 32-byte sector or a 16-byte
    vector and keep every 4-byte word aligned, whatever the slot (scattered pages included); a 12-byte row
    (group 5 -> 6) would straddle a sector every fourth slot. Costs 6 of 216 bytes per token and KV head at
    group 5, nothing at group 4 or 8."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return -(-group // DELTA_S_ROW_ALIGN) * DELTA_S_ROW_ALIGN


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
    group: int  # query heads per KV head (Delta_S rows are padded, so its shape does not say)

    def __post_init__(self) -> None:
        slots, hkv, d = self.v.shape
        shapes = {"k_codes": (slots, hkv, d // 2), "k_scales": (hkv, slots, d // NVFP4_BLOCK),
                  "delta_s": (hkv, slots, delta_s_row(self.group))}
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(getattr(self, name).shape)}")

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
        slots, group = num_pages * page_size, num_q_heads // num_kv_heads
        return cls(
            torch.empty((slots, num_kv_heads, head_dim // 2), dtype=torch.uint8, device=device),
            torch.empty((num_kv_heads, slots, head_dim // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((slots, num_kv_heads, head_dim), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((num_kv_heads, slots, delta_s_row(group)), dtype=torch.bfloat16, device=device),
            page_size,
            group,
        )

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def head_dim(self) -> int:
        return self.v.shape[2]

    def fill_(self, byte: int) -> MpfaKVCache:
        """Set every byte of the cache (tests poison it before a write)."""
        for field in (self.k_codes, self.k_scales, self.v, self.delta_s):
            field.view(torch.uint8).fill_(byte)
        return self

    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all heads, Delta_S padding included (what decode reads per token)."""
        fields = (self.k_codes, self.k_scales, self.v, self.delta_s)
        return sum(x.numel() * x.element_size() for x in fields) // self.num_slots

    def token_scales(self, slots: torch.Tensor) -> torch.Tensor:
        """K scales of ``slots`` [T] token-major: [T, Hkv, d/16] (the `NVFP4Tensor` scales of those K rows)."""
        return self.k_scales[:, slots].transpose(0, 1)

    def token_delta_s(self, slots: torch.Tensor) -> torch.Tensor:
        """Delta_S of ``slots`` [T] token-major, padding dropped: [T, Hq] (query head h at column h)."""
        return self.delta_s[:, slots, :self.group].transpose(0, 1).reshape(len(slots), self.num_q_heads)
