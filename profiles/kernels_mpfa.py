"""MpFA: attention over an NVFP4-K / FP8-V cache with sequence-centred Q and K (the sm90 kernels, timed).

Both kinds run the sm90 kernels on a cache the Triton KV write fills while the inputs are built; only the
attention kernels are timed. Both use pages of 128 keys, the page size SGLang serves ``mpfa`` with (and FA4;
FlashInfer serves with page 1; the decode benchmark used page 1 for MpFA too before session 13). Decode: the CuTe
split-KV decode + merge. Prefill: the CuTe prefill (causal, every token of each sequence a query), the queries'
centered NVFP4 rows as the KV write returns them. Their correctness lives in tests/kernels_sm90.

Backend ``mpfa`` runs the default prefill kernel (`prefill_launch.prefill_kernel`: v7i for 32:8 and 40:8); ``mpfa-v1``,
``mpfa-v2``, ``mpfa-v2w8``, ``mpfa-v3`` and ``mpfa-v3w8`` pin v1, v2 (`prefill_staged`), v2 with 8-warp CTAs, v3
(`prefill_wgmma`) or v3 with 2-warpgroup CTAs, so one run can time them side by side (decode is the same kernel
in all of them); ``mpfa-v3c`` / ``mpfa-v3w8c`` v3 / v3w8 with Delta_S as an extra K column (`prefill_wgmma_dscol`);
``mpfa-v4`` / ``mpfa-v4w8`` pin v3 / v3w8 with QK^T on FP8 (`prefill_wgmma_fp8qk`: Q and K
requantized to e4m3, the reference's ``mpfa-qk8tile`` numerics), ``mpfa-v5`` / ``mpfa-v5w8`` v4 / v4w8 with PV on
FP8 too (`prefill_wgmma_fp8pv`, the same numerics), ``mpfa-v6`` v5w8 warp-specialized (`prefill_wgmma_ws`: a
producer warpgroup, two consumers; v5w8's output), ``mpfa-v6a`` .. ``mpfa-v6n`` v6's variants
(`prefill_launch.WS_KERNELS`), ``mpfa-v7`` v6n on operand images expanded once per prefill (`prefill_wgmma_pre`,
timed with that pass), ``mpfa-v7b`` v7 with each step's PV fold under the next step's QK, ``mpfa-v7c`` v7b with
each operand image one bulk copy, ``mpfa-v7d`` v7c with each step's PV under the next step's softmax, ``mpfa-v7e``
v7d with every 4th exponential on the FMA pipe, ``mpfa-v7f`` v7d with the consumers taking turns at their wgmmas
(FA3's ping-pong), ``mpfa-v7g`` v7e with v7f's turns, ``mpfa-v7h`` v7c with turns around each step's QKs, ``mpfa-v7i``
v7c with each step's Delta_S loaded ahead of its QK waits. ``mpfa-dv1`` / ``mpfa-dv3`` / ``mpfa-dv4`` /
``mpfa-dv4w14`` pin decode v1 (no ring), v3 (3-stage ring), v4 (v2 with fewer instructions per tile, `decode_lean`) or
v4 partitioned for 14 warps per SM the same way (``mpfa`` runs ``MPFA_DECODE_KERNEL``'s, v4 by default, its
partitions aimed at 6 warps per SM: `decode_launch.PARTITION_WARPS_PER_SM`, which caps the pinned kernels' but v4w14's;
``mpfa-dv2w12`` is the default before session 24, v2 on every slot); ``mpfa-dw<n>`` / ``mpfa-dv4w<n>`` run that kernel /
v4 with its partitions aimed at n warps per SM (`decode_launch.partition_warps`: fewer, longer partitions; the same
compiled kernels). ``mpfa-direct`` runs the direct builds (``compensate=False``: no Delta_S read, inputs quantized
uncentered): mpfa vs mpfa-direct is the compensation's cost.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mpfa.kernels.capacity import kv_bytes_per_token
from mpfa.profiles.errors import ProfileError
from mpfa.profiles.inputs import random_tensor
from mpfa.profiles.kernel_adapter import PreparedKernel
from mpfa.profiles.workload import MPFA, AttentionWorkload

if TYPE_CHECKING:
    import torch

_FILL_TOKENS = 1 << 16  # tokens quantized into the cache per write-kernel launch (bounds the BF16 staging)
PAGE_SIZE = 128


def paged_layout(w: AttentionWorkload, device: "torch.device") -> tuple["torch.Tensor", Callable, int]:
    """(page table [batch, pages per sequence], token -> cache slot, number of pages): each request's pages in
    order, request after request (token t of the packed batch is request t // seq)."""
    import torch

    pages_per_seq = -(-w.seq // PAGE_SIZE)
    page_table = torch.arange(w.batch * pages_per_seq, dtype=torch.int32, device=device).view(w.batch, -1)

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
    # (~10 of 30 us at 32K x 1, session 18): profile it with `--kernel-name regex:'SplitKVDecode|DecodeMerge'`.
    kernel_regex = "SplitKVDecode|PrefillSm90"

    def __init__(self, prefill_kernel: str | None = None, decode_kernel: str | None = None,
                 compensate: bool = True, decode_warps: int | None = None):
        """``prefill_kernel``: "v1", "v2", "v2w8", "v3", "v3w8", "v3c", "v3w8c", "v4", "v4w8", "v5", "v5w8", "v6" or
        "v6a" .. "v6n", "v7" .. "v7i" pins the prefill kernel (backend ``mpfa-<kernel>``: ``mpfa-v1`` ..
        ``mpfa-v7i``);
        ``decode_kernel``: "v1", "v2", "v3", "v4" or "v4w14" the decode version (``mpfa-dv1`` ...); None follows
        ``MPFA_PREFILL_KERNEL`` / ``MPFA_DECODE_KERNEL``. ``compensate`` False: the direct builds (backend
        ``mpfa-direct``). ``decode_warps``: the warps per SM the decode partitions aim at (backend
        ``mpfa-d<kernel>w<n>``, ``mpfa-dw<n>`` with the default kernel); None: `decode_launch.partition_warps`'s."""
        self.prefill_kernel = prefill_kernel
        self.decode_kernel = decode_kernel
        self.decode_warps = decode_warps
        self.compensate = compensate
        if prefill_kernel is not None:
            self.name = f"mpfa-{prefill_kernel}"
        elif decode_kernel is not None or decode_warps is not None:
            self.name = f"mpfa-d{decode_kernel or ''}" + ("" if decode_warps is None else f"w{decode_warps}")
        elif not compensate:
            self.name = "mpfa-direct"

    def set_bytes(self, workload: AttentionWorkload) -> int:
        if workload.kind == "prefill":  # never below the roofline bytes, which count Q in BF16 (`MPFA.q`)
            return max(_prefill_set_bytes(workload), int(workload.bytes_needed(self.tensor_format)))
        return int(workload.bytes_needed(self.tensor_format))

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device", seed: int) -> PreparedKernel:
        import torch

        from mpfa.kernels.smoothing import SmoothingMeans

        w = workload
        generator = torch.Generator(device=device).manual_seed(seed)
        means = SmoothingMeans(torch.randn(w.batch, w.q_heads, w.head_dim, device=device, generator=generator),
                               torch.randn(w.batch, w.kv_heads, w.head_dim, device=device, generator=generator))
        if not self.compensate:  # direct: no centering
            means = SmoothingMeans(torch.zeros_like(means.q_mean), torch.zeros_like(means.k_mean))
        if w.kind == "prefill":
            return _prepare_prefill(w, num_sets, device, generator, means, self.prefill_kernel, self.compensate)
        return _prepare_decode(w, num_sets, device, generator, means, self.decode_kernel, self.compensate,
                               self.decode_warps)


def _fill(w: AttentionWorkload, cache, slots_of_token, means, device, generator, keep_query) -> None:
    """Quantize random BF16 Q/K/V of every token (token t of request t // seq) into ``cache`` at
    ``slots_of_token(tokens)``, in chunks; ``keep_query(first, centered)`` stores the rows of Q it needs."""
    import torch

    from mpfa.kernels.sm90.quantize_cache import quantize_to_cache

    tokens = w.batch * w.seq
    for first in range(0, tokens, _FILL_TOKENS):
        count = min(_FILL_TOKENS, tokens - first)
        token = torch.arange(first, first + count, device=device)
        q, k, v = (random_tensor((count, heads, w.head_dim), torch.bfloat16, device, generator)
                   for heads in (w.q_heads, w.kv_heads, w.kv_heads))
        keep_query(first, quantize_to_cache(q, k, v, slots_of_token(token), (token // w.seq).int(), means, cache))


def _dense_inputs(i: int):
    raise ProfileError("the MpFA benchmark quantizes its inputs in place; tests/kernels_sm90 checks outputs")


def _prepare_decode(w: AttentionWorkload, num_sets: int, device, generator, means, kernel: str | None = None,
                    compensate: bool = True, warps_per_sm: int | None = None) -> PreparedKernel:
    import torch

    from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache
    from mpfa.kernels.sm90.decode_launch import DecodeWorkspace, decode_kernel, mpfa_decode, partition_warps

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
    kernel = decode_kernel(kernel)
    warps = partition_warps(kernel, warps_per_sm)
    workspace = DecodeWorkspace.allocate(w.batch, w.q_heads, w.kv_heads, w.seq, device, kernel=kernel,
                                         warps_per_sm=warps)
    outputs = [torch.empty((w.batch, w.q_heads, w.head_dim), dtype=torch.bfloat16, device=device)
               for _ in range(num_sets)]

    def run(i: int) -> torch.Tensor:
        query, cache = sets[i]
        return mpfa_decode(query, cache, page_table, seq_lens, workspace, out=outputs[i], kernel=kernel,
                           compensate=compensate)

    build = "" if compensate else ", direct build"
    return PreparedKernel(run, _dense_inputs, num_sets,
                          f"Triton KV write + CuTe split-KV decode {kernel}{build} ({workspace.num_partitions} "
                          f"partitions of {workspace.partition_size} keys, for {warps} warps per SM) + merge, "
                          f"page {PAGE_SIZE}")


def _prepare_prefill(w: AttentionWorkload, num_sets: int, device, generator, means, kernel: str | None = None,
                     compensate: bool = True) -> PreparedKernel:
    import torch

    from mpfa.kernels.cache_layout import CenteredQuery, MpfaKVCache
    from mpfa.kernels.sm90.prefill_launch import (DS_COLUMN_KERNELS, STAGED_WARPS, WGMMA_WARPGROUPS, mpfa_prefill,
                                                  prefill_kernel, prefill_numerics)

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
    version = f"{name}, staged cp.async ring, {STAGED_WARPS[name]}-warp CTAs" if name in STAGED_WARPS else name
    if WGMMA_WARPGROUPS.get(name, 1) > 1:
        version += f", {WGMMA_WARPGROUPS[name]}-warpgroup CTAs"
    mma = "wgmma" if name in WGMMA_WARPGROUPS else "mma.sync"
    mma += ", FP8 QK^T from e4m3-requantized Q / K" if prefill_numerics(name) != "mpfa" else ""
    mma += ", row sums on the PV wgmma" if prefill_numerics(name) == "mpfa-qk8tile-psum" else ""
    mma += ", Delta_S as an extra K column" if name in DS_COLUMN_KERNELS and compensate else ""
    version += "" if compensate else ", direct build"

    return PreparedKernel(run, _dense_inputs, num_sets,
                          f"Triton KV write + CuTe prefill {version} ({mma}, causal), page {PAGE_SIZE}")
