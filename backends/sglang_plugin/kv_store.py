"""The MpFA KV storage of all layers: one `MpfaKVCache` per layer plus the frozen means (SGLang-free).

Slots are SGLang's KV-pool slots (``out_cache_loc``, the ``req_to_token`` page table); the pool has
``size + page_size`` slots like SGLang's MHA pool (the first page absorbs the writes of CUDA-graph padding tokens).

Frozen means (``mpfa`` only) are stored per page, at the FIRST page of the sequence they center: ``q_mean`` BF16
[layers, pages, Hq, d] and ``k_mean`` BF16 [layers, pages, Hkv, d]; a request's means row is its first page
(``req_to_token[row, 0] // page_size``). Policy: a sequence's means are the per-head means of the Q and K of its
*first prefill chunk*, taken when a forward extends it from an empty prefix (``extend_prefix_len == 0``) and
written at its first page; later chunks and every decode step center with them. A request that reuses a cached
prefix (SGLang's radix cache: ``extend_prefix_len > 0``, pages shared with the request that wrote them) has that
writer's first page as its own, so it adopts the writer's means with no copy, and every page of the prefix, its
Delta_S included, is consistent with them: centering is exact with any mean, as long as both sides use the same
one. The means of a first page live as long as the page; a page is reused only after SGLang frees it, and the
sequence that reuses it as its first page writes new means. Page 0, SGLang's padding page, keeps zero means.
BF16, not FP32: the mean's precision only sets how well centering narrows the values to quantize (a BF16 mean is
within 2^-9 of the FP32 one). ``mpfa-direct`` keeps a single zero row (zero means: centering is the identity and
Delta_S is zero) and no per-page storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .pool_sizing import PoolGeometry
from ...kernels.cache_layout import MpfaKVCache
from ...kernels.smoothing import SmoothingMeans

MEANS_DTYPE = torch.bfloat16


@dataclass
class MpfaKVStore:
    """All layers' caches and means; ``layer(i)`` / ``means(i)`` index layers from 0 (the pool's first layer)."""

    caches: list[MpfaKVCache]
    q_mean: torch.Tensor
    k_mean: torch.Tensor
    smoothing: bool
    geometry: PoolGeometry

    @classmethod
    def allocate(cls, num_slots: int, page_size: int, geometry: PoolGeometry, smoothing: bool,
                 device: torch.device | str) -> MpfaKVStore:
        """Zero-filled storage for ``num_slots`` slots (rounded up to whole pages) and one means row per page."""
        if num_slots <= 0:
            raise ValueError(f"need num_slots > 0, got {num_slots}")
        num_pages = -(-num_slots // page_size)
        g = geometry
        caches = [
            MpfaKVCache.allocate(num_pages, page_size, g.num_q_heads, g.num_kv_heads, g.head_dim, device).fill_(0)
            for _ in range(g.num_layers)
        ]
        rows = num_pages if smoothing else 1
        q_mean = torch.zeros((g.num_layers, rows, g.num_q_heads, g.head_dim), dtype=MEANS_DTYPE, device=device)
        k_mean = torch.zeros((g.num_layers, rows, g.num_kv_heads, g.head_dim), dtype=MEANS_DTYPE, device=device)
        return cls(caches, q_mean, k_mean, smoothing, g)

    def layer(self, index: int) -> MpfaKVCache:
        return self.caches[index]

    def means(self, index: int) -> SmoothingMeans:
        """The layer's means table (a row per page, read at sequences' first pages; one zero row without
        smoothing)."""
        return SmoothingMeans(self.q_mean[index], self.k_mean[index])

    @property
    def num_slots(self) -> int:
        return self.caches[0].num_slots

    def k_bytes(self) -> int:
        """Bytes of the K side: NVFP4 codes, their scales and Delta_S (which is derived from K)."""
        return sum(x.numel() * x.element_size() for c in self.caches for x in (c.k_codes, c.k_scales, c.delta_s))

    def v_bytes(self) -> int:
        return sum(c.v.numel() * c.v.element_size() for c in self.caches)

    def means_bytes(self) -> int:
        return (self.q_mean.numel() + self.k_mean.numel()) * self.q_mean.element_size() if self.smoothing else 0


def requests_starting(extend_prefix_lens: torch.Tensor) -> torch.Tensor:
    """Which requests of an extend batch start here (empty prefix) and so get new means: bool [B]."""
    return extend_prefix_lens == 0


def freeze_means(store: MpfaKVStore, layer: int, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor,
                 first_pages: torch.Tensor, starting: torch.Tensor) -> None:
    """Store the means of this chunk's q [T, Hq, d] / k [T, Hkv, d] (BF16) at the first pages [B] of the requests
    that start here and keep those of the others (frozen, or a cached prefix's writer's); ``cu_seqlens`` int32
    [B + 1] on the device. No host synchronisation."""
    from ...kernels.sm90.sequence_means import sequence_means

    rows = first_pages.long()
    keep = (~starting)[:, None, None]
    for table, x in ((store.q_mean[layer], q), (store.k_mean[layer], k)):
        table[rows] = torch.where(keep, table[rows], sequence_means(x, cu_seqlens).to(table.dtype))
