"""SGLang's token-to-KV pool for the MpFA backends: an `MpfaKVStore` behind SGLang's ``KVCache`` interface.

Built by SGLang's own ``_init_pools`` (see `hooks`) with the arguments it gives its BF16 MHA pool, so the
allocator, ``req_to_token`` and page handling stay SGLang's. There are no BF16 K/V buffers: ``get_key_buffer`` /
``set_kv_buffer`` raise (the MpFA backend writes through `quantize_to_cache`), and ``dtype`` is uint8 so model
code never takes SGLang's fused BF16 KV-write shortcut into this pool. Imports SGLang: load it only in SGLang.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import KVCache

from .pool_sizing import PoolGeometry, capacity_log_line
from .kv_store import MpfaKVStore
from ...kernels.cache_layout import MpfaKVCache

logger = logging.getLogger(__name__)


class MpfaTokenToKVPool(KVCache):
    """NVFP4-K / FP8-V / Delta_S cache of every layer plus the frozen means, indexed by SGLang's slots."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        *,
        backend: str,
        num_q_heads: int,
        smoothing: bool,
        **_unused: Any,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        self.dtype = self.store_dtype = torch.uint8
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        self.backend = backend
        geometry = PoolGeometry(num_q_heads, head_num, head_dim, layer_num)
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.store = MpfaKVStore.allocate(size + page_size, page_size, geometry, smoothing, device)
        self._finalize_allocation_log(size)
        logger.info(capacity_log_line(backend, geometry, size, page_size, smoothing))

    def layer_cache(self, layer_id: int) -> MpfaKVCache:
        """The `MpfaKVCache` of model layer ``layer_id``."""
        return self.store.layer(layer_id - self.start_layer)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K codes + K scales + Delta_S, V) bytes over all layers; the means are logged separately."""
        return self.store.k_bytes(), self.store.v_bytes()

    def _no_bf16(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"the {self.backend} KV pool stores NVFP4 K / FP8 V: it has no BF16 K/V buffers and is written only by "
            f"the MpFA attention backend (use layer_cache())")

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_bf16
    move_kv_cache = get_cpu_copy = load_cpu_copy = get_contiguous_buf_infos = _no_bf16
