"""The MpFA KV storage of all layers: one `MpfaKVCache` per layer plus the per-request frozen means (SGLang-free).

Slots are SGLang's KV-pool slots (``out_cache_loc``, the ``req_to_token`` page table); the pool has
``size + page_size`` slots like SGLang's MHA pool (the first page absorbs the writes of CUDA-graph padding tokens).

Frozen means (``mpfa`` only), stored per request pool index (the row of ``req_to_token``; row 0 is SGLang's padding
row): ``q_mean`` BF16 [layers, request_slots, Hq, d] and ``k_mean`` BF16 [layers, request_slots, Hkv, d].
BF16, not FP32: centering is exact with any mean (what Q_bar and K_bar take away, Delta_S and a per-query constant
give back, the same stored values on both sides), so the mean's precision only sets how well centering narrows the
values to quantize (a BF16 mean is within 2^-9 of the FP32 one), and it halves the reserve held for every request
slot (2.7 -> 1.3 GB for Llama-3.1-8B's 4,097 slots).
Policy: a request's means are the per-head means of the Q and K of its *first prefill chunk*, taken when a forward
extends it from an empty prefix (``extend_prefix_len == 0``) and frozen afterwards: later chunks of a chunked
prefill and every decode step center with them. A request slot's means are overwritten only when a new request
starts in it. A cached prefix written by another request would carry that request's centering, so the radix cache
is disabled (`setup_checks`). ``mpfa-direct`` keeps a single zero row (zero means: centering is the identity and
Delta_S is zero) and no per-request storage.
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
    def allocate(cls, num_slots: int, page_size: int, geometry: PoolGeometry, request_slots: int, smoothing: bool,
                 device: torch.device | str) -> MpfaKVStore:
        """Zero-filled storage for ``num_slots`` slots (rounded up to whole pages) and ``request_slots`` requests."""
        if num_slots <= 0 or request_slots <= 0:
            raise ValueError(f"need num_slots > 0 and request_slots > 0, got {num_slots} and {request_slots}")
        num_pages = -(-num_slots // page_size)
        g = geometry
        caches = [
            MpfaKVCache.allocate(num_pages, page_size, g.num_q_heads, g.num_kv_heads, g.head_dim, device).fill_(0)
            for _ in range(g.num_layers)
        ]
        rows = request_slots if smoothing else 1
        q_mean = torch.zeros((g.num_layers, rows, g.num_q_heads, g.head_dim), dtype=MEANS_DTYPE, device=device)
        k_mean = torch.zeros((g.num_layers, rows, g.num_kv_heads, g.head_dim), dtype=MEANS_DTYPE, device=device)
        return cls(caches, q_mean, k_mean, smoothing, g)

    def layer(self, index: int) -> MpfaKVCache:
        return self.caches[index]

    def means(self, index: int) -> SmoothingMeans:
        """The layer's means table (rows = request pool indices, or one zero row without smoothing)."""
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
                 req_pool_indices: torch.Tensor, starting: torch.Tensor) -> None:
    """Store the means of this chunk's q [T, Hq, d] / k [T, Hkv, d] (BF16) for the requests that start here and
    keep the frozen means of the others; ``cu_seqlens`` int32 [B + 1] on the device. No host synchronisation."""
    from ...kernels.sm90.sequence_means import sequence_means

    rows = req_pool_indices.long()
    keep = (~starting)[:, None, None]
    for table, x in ((store.q_mean[layer], q), (store.k_mean[layer], k)):
        table[rows] = torch.where(keep, table[rows], sequence_means(x, cu_seqlens).to(table.dtype))
