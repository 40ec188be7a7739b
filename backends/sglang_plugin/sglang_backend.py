"""SGLang ``AttentionBackend`` for ``--attention-backend mpfa | mpfa-direct`` (a thin adapter over `attention`).

Decode runs the sm90 kernel and is CUDA-graph capturable: `init_cuda_graph_state` allocates fixed page-table,
length and workspace buffers; `init_forward_metadata_out_graph` refills them before capture and every replay (no
host sync inside the graph). Extend runs eagerly (the prefill CUDA graph is disabled by `setup_checks`): the sm90
prefill kernel `mpfa.kernels.sm90.dispatch` chooses, or the SLOW REFERENCE PATH. Imports SGLang: load it only in
SGLang.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from .attention import ExtendBatch, MpfaAttention
from .decode_plan import GraphDecodeBuffers, eager_decode_batch
from .kernel_choice import log_kernels
from .setup_checks import MpfaSetupError, numerics, prefill_path
from .variants import BackendVariant


class MpfaAttnBackend(AttentionBackend):
    """MpFA attention over the `MpfaTokenToKVPool` SGLang built for this model runner."""

    def __init__(self, model_runner: Any, variant: BackendVariant) -> None:
        super().__init__()
        from .runner_checks import check_layers
        from .sglang_pool import MpfaTokenToKVPool

        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, MpfaTokenToKVPool):
            raise MpfaSetupError(f"MpFA attention backend: the KV pool is {type(pool).__name__}, not the MpFA pool "
                                 f"(is the plugin loaded in the scheduler? check SGLANG_PLUGINS)")
        check_layers(model_runner.model)
        self.variant, self.pool = variant, pool
        self.core = MpfaAttention(pool.store, variant, prefill_path(), numerics())
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        self.device = torch.device(model_runner.device, torch.cuda.current_device())
        g = pool.store.geometry
        self.num_q_heads, self.num_kv_heads, self.head_dim = g.num_q_heads, g.num_kv_heads, g.head_dim
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.forward_metadata: Any = None
        self.graph_buffers: GraphDecodeBuffers | None = None
        log_kernels(variant.backend, self.num_q_heads, self.num_kv_heads, self.page_size, self.core.prefill,
                    self.core.numerics.name)
        self._compile_kernels()

    def _compile_kernels(self) -> None:
        """Compile the kernels at startup (a missing or broken toolchain fails here, not in a forward)."""
        from ...kernels.sm90.decode_launch import compile_decode_kernels
        from ...kernels.sm90.prefill_launch import compile_prefill_kernel

        group = self.num_q_heads // self.num_kv_heads
        try:
            compensate = self.core.variant.smoothing  # mpfa-direct runs the direct builds (no Delta_S read)
            compile_decode_kernels(self.num_kv_heads, group, self.page_size, compensate=compensate)
            if self.core.prefill == "kernel":
                compile_prefill_kernel(self.num_kv_heads, group, self.page_size, True, "BFloat16",
                                       compensate=compensate)
        except Exception as error:  # noqa: BLE001 - re-raised as one clear line
            raise MpfaSetupError(f"MpFA attention backend: compiling the sm90 kernels failed: "
                                 f"{type(error).__name__}: {error}") from error

    # ---- metadata -------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
        elif mode.is_decode():
            seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
            max_len = int(seq_lens_cpu.max()) if seq_lens_cpu is not None else self.req_to_token.shape[1]
            self.forward_metadata = eager_decode_batch(
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, max_len, self.page_size,
                self.num_q_heads, self.num_kv_heads, self.num_sms)
        elif mode.name in ("EXTEND", "MIXED"):
            self.forward_metadata = ExtendBatch.build(
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.out_cache_loc,
                list(forward_batch.extend_prefix_lens_cpu), list(forward_batch.extend_seq_lens_cpu), self.page_size)
        else:
            raise NotImplementedError(f"MpFA attention backend: forward mode {mode.name} is not supported")

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_buffers = GraphDecodeBuffers(max_bs, self.num_q_heads, self.num_kv_heads,
                                                self.req_to_token.shape[1], self.page_size, self.device, self.num_sms)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError("MpFA attention backend: only decode runs in CUDA graphs")
        assert self.graph_buffers is not None, "init_cuda_graph_state must run before graph capture"
        self.forward_metadata = self.graph_buffers.fill(
            self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.batch_size)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---- forward --------------------------------------------------------------------------------------------
    def _check_call(self, k: torch.Tensor | None, save_kv_cache: bool, kwargs: dict) -> None:
        if k is None or not save_kv_cache:
            raise NotImplementedError("MpFA attention backend: the layer must pass k/v and save_kv_cache=True (the "
                                      "backend quantizes them into its own cache)")
        if kwargs:
            raise NotImplementedError(f"MpFA attention backend: unsupported attention arguments {sorted(kwargs)}")

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        self._check_call(k, save_kv_cache, kwargs)
        out = self.core.extend(layer.layer_id - self.pool.start_layer, q, k, v, self.forward_metadata,
                               layer.scaling)
        return out.view(-1, self.num_q_heads * self.head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        self._check_call(k, save_kv_cache, kwargs)
        batch = q.shape[0]
        out = q.new_empty((batch, self.num_q_heads * self.head_dim))
        self.core.decode(layer.layer_id - self.pool.start_layer, q, k, v, forward_batch.out_cache_loc,
                         self.forward_metadata, layer.scaling, out=out.view(batch, self.num_q_heads, self.head_dim))
        return out
