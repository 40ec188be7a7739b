"""MpFA: attention over an NVFP4-K / FP8-V cache with sequence-centred Q and K (the sm90 kernels, timed).

Both kinds run the sm90 kernels on a cache the Triton KV write fills while the inputs are built; only the
attention kernels are timed. Both use pages of 128 keys, the page size SGLang serves ``mpfa`` with (and FA4;
FlashInfer serves with page 1). Decode: the split-KV decode + merge. Prefill: the prefill kernel (causal, every
token of each sequence a query) that `mpfa.kernels.sm90.dispatch` chooses for the shape, or the one the backend
names (``mpfa-exact``, ``mpfa-mma-sync``), the queries' centered NVFP4 rows as the KV write returns them. The fp8
kernel's time includes its operand pass. Their correctness lives in tests/kernels/sm90. ``mpfa-direct`` runs the
direct builds (``compensate=False``: no Delta_S read, inputs quantized uncentered).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..mpfa_cli.errors import ProfileError
from ..kernels.kv_capacity import kv_bytes_per_token
from ..kernels.sm90.dispatch import requested_prefill_kernel
from .attention_workload import MPFA, AttentionWorkload
from .inputs import random_tensor
from .kernel_adapter import PreparedKernel, sequential_page_table

if TYPE_CHECKING:
    import torch

_FILL_TOKENS = 1 << 16  # tokens quantized into the cache per write-kernel launch (bounds the BF16 staging)
PAGE_SIZE = 128


def paged_layout(w: AttentionWorkload, device: "torch.device") -> tuple["torch.Tensor", Callable, int]:
    """(page table [batch, pages per sequence], token -> cache slot, number of pages): each request's pages in
    order, request after request (token t of the packed batch is request t // seq)."""
    pages_per_seq = -(-w.seq // PAGE_SIZE)
    page_table = sequential_page_table(w.batch, pages_per_seq, device)

    def slots_of_token(token: "torch.Tensor") -> "torch.Tensor":
        return (token // w.seq) * pages_per_seq * PAGE_SIZE + token % w.seq

    return page_table, slots_of_token, w.batch * pages_per_seq


def _prefill_set_bytes(w: AttentionWorkload) -> int:
    """Device bytes of one prefill set: centered NVFP4 Q (codes + scales), the cache in whole pages (Delta_S
    padding included), BF16 O."""
    tokens = w.batch * w.seq
    slots = w.batch * -(-w.seq // PAGE_SIZE) * PAGE_SIZE
    q_bytes = tokens * w.q_heads * (w.head_dim // 2 + w.head_dim // 16)
    cache_bytes = slots * w.kv_heads * int(kv_bytes_per_token("mpfa", w.head_dim, w.q_heads // w.kv_heads))
    return q_bytes + cache_bytes + tokens * w.q_heads * w.head_dim * 2


class MpfaAdapter:
    name = "mpfa"
    tensor_format = MPFA
    math_dtype = "bf16"  # FP16 tensor-core MMAs on exactly dequantized operands (sm_90 has no FP4 MMA)
    # The main kernels. The decode merge is left out of ncu's one-launch profile, but it is not negligible at batch 1
    # (~10 of 30 us at 32K x 1 on the H200): profile it with `--kernel-name regex:'SplitKVDecode|DecodeMerge'`.
    kernel_regex = "SplitKVDecode|PrefillSm90"

    def __init__(self, prefill_kernel: str | None = None, compensate: bool = True):
        """``prefill_kernel``: a `dispatch.PREFILL_KERNELS` name names the prefill kernel (backend
        ``mpfa-<kernel>``), checked by `dispatch.requested_prefill_kernel`; None: `dispatch.prefill_kernel`'s
        choice. ``compensate`` False: the direct builds (backend ``mpfa-direct``)."""
        self.prefill_kernel = None if prefill_kernel is None else requested_prefill_kernel(prefill_kernel)
        self.compensate = compensate
        if self.prefill_kernel is not None:
            self.name = f"mpfa-{self.prefill_kernel}"
        elif not compensate:
            self.name = "mpfa-direct"

    def set_bytes(self, workload: AttentionWorkload) -> int:
        if workload.kind == "prefill":  # never below the roofline bytes, which count Q in BF16 (`MPFA.q`)
            return max(_prefill_set_bytes(workload), int(workload.bytes_needed(self.tensor_format)))
        return int(workload.bytes_needed(self.tensor_format))

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device", seed: int) -> PreparedKernel:
        import torch

        from ..kernels.smoothing import SmoothingMeans

        w = workload
        generator = torch.Generator(device=device).manual_seed(seed)
        means = SmoothingMeans(torch.randn(w.batch, w.q_heads, w.head_dim, device=device, generator=generator),
                               torch.randn(w.batch, w.kv_heads, w.head_dim, device=device, generator=generator))
        if not self.compensate:  # direct: no centering
            means = SmoothingMeans(torch.zeros_like(means.q_mean), torch.zeros_like(means.k_mean))
        if w.kind == "prefill":
            return _prepare_prefill(w, num_sets, device, generator, means, self.prefill_kernel, self.compensate)
        return _prepare_decode(w, num_sets, device, generator, means, self.compensate)


def _fill(w: AttentionWorkload, cache, slots_of_token, means, device, generator, keep_query) -> None:
    """Quantize random BF16 Q/K/V of every token (token t of request t // seq) into ``cache`` at
    ``slots_of_token(tokens)``, in chunks; ``keep_query(first, centered)`` stores the rows of Q it needs."""
    import torch

    from ..kernels.sm90.quantize_cache import quantize_to_cache

    tokens = w.batch * w.seq
    for first in range(0, tokens, _FILL_TOKENS):
        count = min(_FILL_TOKENS, tokens - first)
        token = torch.arange(first, first + count, device=device)
        q, k, v = (random_tensor((count, heads, w.head_dim), torch.bfloat16, device, generator)
                   for heads in (w.q_heads, w.kv_heads, w.kv_heads))
        keep_query(first, quantize_to_cache(q, k, v, slots_of_token(token), (token // w.seq).int(), means, cache))


def _dense_inputs(i: int):
    raise ProfileError("the MpFA benchmark quantizes its inputs in place; tests/kernels/sm90 checks outputs")


def _prepare_decode(w: AttentionWorkload, num_sets: int, device, generator, means,
                    compensate: bool = True) -> PreparedKernel:
    import torch

    from ..kernels.cache_layout import CenteredQuery, MpfaKVCache
    from ..kernels.sm90.decode_launch import DecodeWorkspace, mpfa_decode, partition_warps

    page_table, slots_of_token, num_pages = paged_layout(w, device)

    def make_set() -> tuple[CenteredQuery, MpfaKVCache]:
        cache = MpfaKVCache.allocate(num_pages, PAGE_SIZE, w.q_heads, w.kv_heads, w.head_dim, device)
        query = CenteredQuery.allocate(w.batch, w.q_heads, w.head_dim, device)

        def keep_last(first: int, chunk: CenteredQuery) -> None:
            tokens = torch.arange(first, first + chunk.codes.shape[0], device=device)
            ends = tokens[(tokens + 1) % w.seq == 0]  # each request's last token is its decode query
            query.codes[ends // w.seq] = chunk.codes[ends - first]
            query.scales[ends // w.seq] = chunk.scales[ends - first]

        _fill(w, cache, slots_of_token, means, device, generator, keep_last)
        return query, cache

    sets = [make_set() for _ in range(num_sets)]
    seq_lens = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)
    workspace = DecodeWorkspace.allocate(w.batch, w.q_heads, w.kv_heads, w.seq, device)
    outputs = [torch.empty((w.batch, w.q_heads, w.head_dim), dtype=torch.bfloat16, device=device)
               for _ in range(num_sets)]

    def run(i: int) -> torch.Tensor:
        query, cache = sets[i]
        return mpfa_decode(query, cache, page_table, seq_lens, workspace, out=outputs[i], compensate=compensate)

    build = "" if compensate else ", direct build"
    return PreparedKernel(run, _dense_inputs, num_sets,
                          f"Triton KV write + CuTe split-KV decode{build} ({workspace.num_partitions} partitions of "
                          f"{workspace.partition_size} keys, for {partition_warps()} warps per SM) + merge, "
                          f"page {PAGE_SIZE}")


def _prepare_prefill(w: AttentionWorkload, num_sets: int, device, generator, means, kernel: str | None = None,
                     compensate: bool = True) -> PreparedKernel:
    import torch

    from ..kernels.cache_layout import CenteredQuery, MpfaKVCache
    from ..kernels.sm90.dispatch import PREFILL_KERNELS, prefill_kernel
    from ..kernels.sm90.prefill_launch import mpfa_prefill

    tokens = w.batch * w.seq
    page_table, slots_of_token, num_pages = paged_layout(w, device)

    def make_set() -> tuple[CenteredQuery, MpfaKVCache]:
        cache = MpfaKVCache.allocate(num_pages, PAGE_SIZE, w.q_heads, w.kv_heads, w.head_dim, device)
        query = CenteredQuery.allocate(tokens, w.q_heads, w.head_dim, device)

        def keep_all(first: int, chunk: CenteredQuery) -> None:
            query.codes[first:first + chunk.codes.shape[0]] = chunk.codes
            query.scales[first:first + chunk.codes.shape[0]] = chunk.scales

        _fill(w, cache, slots_of_token, means, device, generator, keep_all)
        return query, cache

    sets = [make_set() for _ in range(num_sets)]
    cu_seqlens_q = torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device)
    seq_lens_k = torch.full((w.batch,), w.seq, dtype=torch.int32, device=device)
    output = torch.empty((tokens, w.q_heads, w.head_dim), dtype=torch.bfloat16, device=device)

    def run(i: int) -> torch.Tensor:
        query, cache = sets[i]
        return mpfa_prefill(query, cache, page_table, cu_seqlens_q, seq_lens_k, max_seqlen_q=w.seq, causal=True,
                            out=output, kernel=kernel, compensate=compensate)

    name = prefill_kernel(w.q_heads, w.kv_heads, PAGE_SIZE, kernel)
    build = "" if compensate else ", direct build"
    computes = PREFILL_KERNELS[name].computes
    return PreparedKernel(run, _dense_inputs, num_sets,
                          f"Triton KV write + CuTe prefill, the {name} kernel{build} ({computes}, causal), "
                          f"page {PAGE_SIZE}")
