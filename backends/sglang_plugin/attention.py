"""One attention layer of the MpFA backend on plain tensors (SGLang-free, so it is testable without SGLang).

KV write (extend and decode): `mpfa.kernels.sm90.quantize_cache.quantize_to_cache` writes the new tokens' centered
NVFP4 K, FP8 V and Delta_S into their slots and returns this step's centered NVFP4 Q, centered with the means stored
at each request's first page; for ``mpfa`` an extend first freezes the means of the requests it starts
(`kv_store.freeze_means`: a request that reuses a cached prefix finds its writer's means there).
Decode: `mpfa.kernels.sm90.decode_launch.mpfa_decode` (the sm90 split-KV kernel, no host sync, CUDA-graph
capturable).
Extend (eager only), chosen by ``$MPFA_PREFILL`` (`setup_checks.prefill_path`): ``kernel`` (default) the sm90
prefill kernel `mpfa.kernels.sm90.dispatch` chooses for the shape (`mpfa.kernels.sm90.prefill_launch.mpfa_prefill`;
``--mpfa-prefill-kernel`` / ``$MPFA_PREFILL_KERNEL`` override it, `kernel_choice`), or ``reference`` the SLOW
REFERENCE PATH (`reference_extend`), whose runs `mpfa bench` marks with a caveat.
``mpfa-direct`` runs the kernels' direct builds (``compensate=False``: no Delta_S read; its side cache holds zeros).
Numerics (`mpfa.kernels.served_numerics`, ``$MPFA_NUMERICS``): ``paper`` as above; ``had128-k46`` rotates every
step's Q and the new tokens' K per head (`rotation.GemmRotation`, FP32) before the means, the KV write and the
attention, so keys are rotated once, at their write, and every query (extend with or without a cached prefix,
decode) is rotated before it reads them; the write kernel picks K's block scales 4/6. V, the attention kernels and
the output are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from .decode_plan import DecodeBatch, build_page_table
from .kv_store import MpfaKVStore, freeze_means, requests_starting
from .reference_extend import reference_extend
from ..specs import PREFILL_PATHS
from .variants import BackendVariant
from ...kernels.cache_layout import CenteredQuery
from ...kernels.rotation import GemmRotation
from ...kernels.served_numerics import PAPER, ServedNumerics
from ...kernels.smoothing import SmoothingMeans


@dataclass(frozen=True)
class ExtendBatch:
    """An extend step: ``slots`` [T] of the new tokens, ``first_pages`` [B] (each request's first page: its means
    row), ``token_means_row`` [T] (each token's), ``cu_seqlens_q`` int32 [B + 1] on the device, ``starting`` bool
    [B] (empty prefix: new means) and on the host ``any_starting`` (False for a batch of later chunks only: no means
    to take), ``kv_slots`` the slots of every request's whole sequence in order, host ``cu_q`` / ``cu_k``, the page
    table int32 [B, pages] and ``seq_lens_k`` int32 [B]."""

    slots: torch.Tensor
    first_pages: torch.Tensor
    token_means_row: torch.Tensor
    cu_seqlens_q: torch.Tensor
    starting: torch.Tensor
    any_starting: bool
    kv_slots: torch.Tensor
    cu_q: list[int]
    cu_k: list[int]
    page_table: torch.Tensor
    seq_lens_k: torch.Tensor

    @classmethod
    def build(cls, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, slots: torch.Tensor,
              prefix_lens: list[int], extend_lens: list[int], page_size: int) -> ExtendBatch:
        """From SGLang's batch fields: ``req_to_token`` [rows, max_context] (already holding the new tokens'
        slots), host prefix / extend lengths per request, the pool's page size."""
        device = req_to_token.device
        total_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        cu_q, cu_k = [0, *accumulate(extend_lens)], [0, *accumulate(total_lens)]
        extend = torch.tensor(extend_lens, dtype=torch.long, device=device)
        lengths = torch.tensor(total_lens, dtype=torch.long, device=device)
        seq = torch.repeat_interleave(torch.arange(len(total_lens), device=device), lengths, output_size=cu_k[-1])
        starts = torch.tensor(cu_k[:-1], dtype=torch.long, device=device)
        position = torch.arange(cu_k[-1], device=device) - starts[seq]
        rows = req_pool_indices.to(device, torch.long)
        pages = max(-(-max(total_lens, default=0) // page_size), 1)
        page_table = build_page_table(req_to_token, rows, page_size, pages)
        first_pages = page_table[:, 0].long()
        return cls(
            slots=slots,
            first_pages=first_pages,
            token_means_row=torch.repeat_interleave(first_pages, extend, output_size=cu_q[-1]),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            starting=requests_starting(torch.tensor(prefix_lens, device=device)),
            any_starting=any(p == 0 for p in prefix_lens),
            kv_slots=req_to_token[rows[seq], position],
            cu_q=cu_q,
            cu_k=cu_k,
            page_table=page_table,
            seq_lens_k=lengths.to(torch.int32),
        )


class MpfaAttention:
    """The KV write, decode and slow prefill of every layer of one `MpfaKVStore`, in the given served numerics."""

    def __init__(self, store: MpfaKVStore, variant: BackendVariant, prefill: str = "reference",
                 numerics: ServedNumerics = PAPER) -> None:
        if variant.smoothing != store.smoothing:
            raise ValueError(f"backend {variant.backend} needs a store with smoothing={variant.smoothing}")
        if prefill not in PREFILL_PATHS:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_PATHS)}, got {prefill!r}")
        self.store, self.variant, self.prefill, self.numerics = store, variant, prefill, numerics
        self.num_q_heads, self.head_dim = store.geometry.num_q_heads, store.geometry.head_dim
        device = store.q_mean.device
        self.rotate = GemmRotation(numerics.rotation, device) if numerics.rotation else None

    def _rotated(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, d] and k [T, Hkv, d] as the numerics write and attend them: rotated (FP32) or as given."""
        return (q, k) if self.rotate is None else (self.rotate(q), self.rotate(k))

    def _means(self, layer: int, rows: torch.Tensor) -> tuple[SmoothingMeans, torch.Tensor]:
        """The layer's means table and each token's row in it (its request's first page; row 0, the zero row,
        without smoothing)."""
        return self.store.means(layer), rows if self.variant.smoothing else torch.zeros_like(rows)

    def write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor) -> CenteredQuery:
        """Quantize the new tokens (Q and K as `_rotated` gives them) into their slots; return their centered NVFP4
        Q. q [T, Hq, d]."""
        from ...kernels.sm90.quantize_cache import quantize_to_cache

        means, rows = self._means(layer, rows)
        return quantize_to_cache(q, k, v, slots, rows, means, self.store.layer(layer),
                                 k_scale_choice=self.numerics.k_scale_choice)

    def extend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ExtendBatch,
               sm_scale: float) -> torch.Tensor:
        """Prefill / chunked-prefill step -> [T, Hq, d] in q's dtype (the prefill kernel, or the SLOW REFERENCE
        PATH; see the module docstring)."""
        q3, k = self._rotated(q.view(-1, self.num_q_heads, self.head_dim), k)
        if self.variant.smoothing and batch.any_starting:
            freeze_means(self.store, layer, q3, k, batch.cu_seqlens_q, batch.first_pages, batch.starting)
        query = self.write(layer, q3, k, v, batch.slots, batch.token_means_row)
        cache = self.store.layer(layer)
        if self.prefill == "kernel":
            from ...kernels.sm90.prefill_launch import mpfa_prefill

            max_q = max((b - a for a, b in zip(batch.cu_q, batch.cu_q[1:])), default=0)
            out = mpfa_prefill(query, cache, batch.page_table, batch.cu_seqlens_q, batch.seq_lens_k,
                               max_seqlen_q=max_q, sm_scale=sm_scale, compensate=self.variant.smoothing,
                               seq_lens_k_host=[b - a for a, b in zip(batch.cu_k, batch.cu_k[1:])])
        else:
            out = reference_extend(query, cache, batch.kv_slots, batch.cu_q, batch.cu_k,
                                   variant=self.numerics.variant(self.variant.numerics), sm_scale=sm_scale)
        return out.to(q.dtype)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               batch: DecodeBatch, sm_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token per request -> [B, Hq, d] (``out`` if given: contiguous BF16 [B, Hq, d])."""
        from ...kernels.sm90.decode_launch import mpfa_decode

        q, k = self._rotated(q.view(-1, self.num_q_heads, self.head_dim), k)
        query = self.write(layer, q, k, v, slots, batch.first_pages)
        return mpfa_decode(query, self.store.layer(layer), batch.page_table, batch.seq_lens, batch.workspace,
                           sm_scale=sm_scale, out=out, compensate=self.variant.smoothing)
