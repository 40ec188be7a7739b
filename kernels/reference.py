"""Reference attention: the oracle the CuTe kernels are tested against.

One tiled implementation of FlashAttention-2's forward pass (MpFA's Algorithm 1), run with the operand formats of a
named variant, plus a dense float64 reference and the split-KV decode form. `VARIANTS` is the registry of numerics:
a variant's name is what the rest of the project calls a ``numerics`` (`BackendSpec.numerics`,
`BackendVariant.numerics`, a kernel's in `mpfa.kernels.sm90.dispatch`).

Layouts (flash-attn varlen): q [total_q, Hq, d]; k, v [total_k, Hkv, d] packed, or a paged cache
[num_pages, page_size, Hkv, d] with page_table [batch, max_pages] (token t of sequence b lives in page
``page_table[b, t // page_size]``, slot ``t % page_size``). ``cu_seqlens_q`` / ``cu_seqlens_k`` [batch + 1] give the
sequence boundaries (both omitted: one sequence; a paged cache needs both). Hq must be a multiple of Hkv (GQA:
query head h reads KV head ``h // (Hq / Hkv)``); d a multiple of 16 (the kernels build d = 64 and 128).

Algorithm per (sequence, Q tile of ``block_m`` rows): KV tiles of ``block_n`` keys, aligned to the sequence start, are
visited in REVERSE order (last tile first; ``reverse_kv=False`` gives the forward order, which changes rounding
only). Per tile, in FP32:
    S = Q_op K_op^T (+ Delta_S[j] for smoothing variants), masked entries -inf      (before the running max)
    m_new = max(m, rowmax S);  P = exp2(S * lam - m_new * lam),  lam = log2(e) * sm_scale
    alpha = exp2(m * lam - m_new * lam);  l = alpha * l + rowsum(P)    (rowsum of the FP32 P)
    acc = alpha * acc + P_op V_op                                       (P_op: P in the variant's P format)
and finally O = acc / l; rows that see no key (empty sequence, or q_len > kv_len under causal) give 0.
Causal masking is bottom-right aligned as in FlashAttention: query i of a sequence sees keys
``j <= i + kv_len - q_len``. Key tiles a whole Q tile cannot see are skipped (bit-identical to masking them).

Operands: every variant except ``float64`` first rounds q, k, v to BF16 (the serving dtype). NVFP4 Q/K are blocked
along head_dim; NVFP4 V (``qk4-pv4``) is blocked along tokens (the PV GEMM's reduction dimension, 16-token blocks
from the sequence start) and NVFP4 P along the keys of its tile. ``mpfa-qk8row`` / ``mpfa-qk8tile`` requantize the
NVFP4 Q/K to e4m3 with power-of-two scales for an FP8 QK^T MMA, per row (Q; K of ``qk8row``) or per KV tile (K of
``qk8tile``, at tile time; see `VariantSpec`). The variant study's candidates (``mpfa-q8``, ``-had16`` / ``-had128``,
``-k46``, ``-k8`` and their combinations) put e4m3 Q or K, a block Hadamard rotation of Q and K or K's 4/6 NVFP4
block scales into `mpfa` (`VariantSpec`). The served options of `served_numerics` (``MPFA_NUMERICS``) are registered
for every variant a served kernel computes (`SERVED_BASES`): ``<base>-had128-k46`` rotates the BF16 inputs in FP32
as the server does, before centering (``rotate_inputs``). FP8 K/V use scale 1.0 (FlashInfer's default; V takes
an optional per-KV-head ``v_scale``), FP8 P the analytic scale 448. The ``fp8`` variant mirrors FlashInfer with an FP8
KV cache: Q stays BF16, K/V are upcast exactly to BF16, P is BF16 for the PV GEMM. l sums the FP32 P, except in
``mpfa-qk8tile-psum`` (the sums of the FP8 P the PV GEMM consumes: a kernel that adds a row of ones to V^T).
Smoothing variants center Q and K with per-request means (computed from the inputs during prefill, passed in
explicitly for decode) and add Delta_S in BF16. Outputs are FP32 (float64 for ``float64``). On CUDA keep TF32 off for
FP32 matmuls (PyTorch's default): the FP8 P_hat / 448 is not TF32-exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .formats import NVFP4_BLOCK, fake_quant_fp8, fake_quant_fp8_pow2, fake_quant_nvfp4, fake_quant_p_fp8
from .rotation import GemmRotation, block_hadamard
from .served_numerics import PAPER, SERVED_NUMERICS
from .smoothing import SmoothingMeans, center, check_cu_seqlens, delta_s, delta_s_padded, masked_means, sequence_means

NVFP4_E4M3_ROW = "nvfp4>e4m3-row"
NVFP4_E4M3_TILE = "nvfp4>e4m3-tile"
E4M3_ROW = "e4m3-row"


@dataclass(frozen=True)
class VariantSpec:
    """Operand formats of one attention variant. ``exact`` keeps float64 values (the ``float64`` reference only).

    ``nvfp4>e4m3-row`` (Q, K) and ``nvfp4>e4m3-tile`` (K): NVFP4 requantized to e4m3 with one power-of-two scale
    (`formats.fake_quant_fp8_pow2`) per row (a token's head_dim in one head) or per KV tile (the ``block_n`` keys of
    one KV head, tiles aligned to the sequence start, the last one partial), for an FP8 QK^T MMA that applies the
    scales outside. Prepared tile-format keys are the NVFP4 values (the cache); the KV tile loop requantizes them.
    ``e4m3-row`` (Q, K): e4m3 straight from the (centered) BF16 value, one power-of-two scale per row.

    ``rotation``: a Hadamard block (`rotation.block_hadamard`, blocks of ``min(rotation, head_dim)`` channels; 0: none)
    applied in FP32 to the (centered) Q and K before their formats; Delta_S is formed from the unrotated centered K
    (the rotation is orthonormal: Q K^T is unchanged in exact arithmetic). ``rotate_inputs``: the rotation is applied
    instead to the BF16 Q and K inputs, in FP32 (`rotation.GemmRotation`), before centering, as a server rotates its
    activations before its KV write; the means, centering and Delta_S are then the rotated inputs' (means passed in
    must be too). ``k_scale_choice``: the NVFP4 block-scale rule of K at cache write (`formats.quantize_nvfp4`:
    "6", or "4/6" per block)."""

    name: str
    q: str
    k: str
    p: str
    v: str
    smoothing: bool
    description: str
    l_sums_p_operand: bool = False  # l sums P in its operand format (as the PV GEMM sees it), not the FP32 P
    rotation: int = 0
    rotate_inputs: bool = False
    k_scale_choice: str = "6"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.q == "exact" else torch.float32


def _mpfa_candidate(name: str, description: str, *, q: str = "nvfp4", k: str = "nvfp4", rotation: int = 0,
                    k_scale_choice: str = "6") -> VariantSpec:
    """A candidate numerics of the variant study (docs/accuracy.md): `mpfa` (centering, FP8 P and V) with other Q/K
    formats, a rotation or K's block-scale choice."""
    return VariantSpec(name, q, k, "fp8", "fp8", True, description, rotation=rotation, k_scale_choice=k_scale_choice)


# Variants that are another one with calibrated FP8 scales, one K and one V scale per KV head (amax / 448 of what a
# calibration saw): name -> the variant they run. Calibration is the caller's (`accuracy`, `tasks.attention_swap`).
CALIBRATED = {"fp8-calibrated": "fp8"}

VARIANTS: dict[str, VariantSpec] = {  # the numerics registry: numerics name -> its operand formats
    spec.name: spec
    for spec in (
        VariantSpec("float64", "exact", "exact", "exact", "exact", False, "float64 throughout, no quantization"),
        VariantSpec("bf16", "bf16", "bf16", "bf16", "bf16", False, "BF16 operands, FP32 accumulation (FA2/FA3)"),
        VariantSpec("fp8", "bf16", "fp8", "bf16", "fp8", False, "FlashInfer-FP8 analogue: FP8 K/V cache, BF16 Q and P"),
        VariantSpec("fp8-qkpv", "fp8", "fp8", "fp8", "fp8", False,
                    "FA3-FP8 analogue: Q cast to e4m3 beside the FP8 K/V cache, P in e4m3 (here scaled by 448)"),
        VariantSpec("qk4-pv16", "nvfp4", "nvfp4", "bf16", "bf16", True, "centered NVFP4 Q/K + Delta_S, BF16 P/V"),
        VariantSpec("qk4-pv8-direct", "nvfp4", "nvfp4", "fp8", "fp8", False, "NVFP4 Q/K without smoothing, FP8 P/V"),
        VariantSpec("mpfa", "nvfp4", "nvfp4", "fp8", "fp8", True, "MpFA: centered NVFP4 Q/K + Delta_S, FP8 P and V"),
        VariantSpec("qk4-pv4", "nvfp4", "nvfp4", "nvfp4", "nvfp4", True, "centered NVFP4 Q/K + Delta_S, NVFP4 P and V"),
        VariantSpec("mpfa-qk8row", NVFP4_E4M3_ROW, NVFP4_E4M3_ROW, "fp8", "fp8", True,
                    "mpfa with Q/K requantized to e4m3 per row (power-of-two scales) for an FP8 QK^T MMA"),
        VariantSpec("mpfa-qk8tile", NVFP4_E4M3_ROW, NVFP4_E4M3_TILE, "fp8", "fp8", True,
                    "mpfa-qk8row with K requantized per KV tile (block_n keys of a KV head) instead of per key"),
        VariantSpec("mpfa-qk8tile-psum", NVFP4_E4M3_ROW, NVFP4_E4M3_TILE, "fp8", "fp8", True,
                    "mpfa-qk8tile with l summing the FP8 P (row sums on the PV MMA)", l_sums_p_operand=True),
        VariantSpec("qk8tile-psum-direct", NVFP4_E4M3_ROW, NVFP4_E4M3_TILE, "fp8", "fp8", False,
                    "mpfa-qk8tile-psum without smoothing (the fp8 prefill kernel's direct build)", l_sums_p_operand=True),
        _mpfa_candidate("mpfa-q8", "mpfa with Q in e4m3 (per-row power-of-two scale) instead of NVFP4", q=E4M3_ROW),
        _mpfa_candidate("mpfa-had16", "mpfa with Q and K Hadamard-rotated in 16-channel blocks", rotation=16),
        _mpfa_candidate("mpfa-had128", "mpfa with Q and K Hadamard-rotated in 128-channel blocks", rotation=128),
        _mpfa_candidate("mpfa-k46", "mpfa with K's NVFP4 block scales chosen 4/6", k_scale_choice="4/6"),
        _mpfa_candidate("mpfa-q8-had16", "mpfa-q8 with Q and K rotated in 16-channel blocks", q=E4M3_ROW, rotation=16),
        _mpfa_candidate("mpfa-q8-had128", "mpfa-q8 with Q and K rotated in 128-channel blocks", q=E4M3_ROW,
                        rotation=128),
        _mpfa_candidate("mpfa-q8-k46", "mpfa-q8 with K's block scales chosen 4/6", q=E4M3_ROW, k_scale_choice="4/6"),
        _mpfa_candidate("mpfa-had16-k46", "mpfa-had16 with K's block scales chosen 4/6", rotation=16,
                        k_scale_choice="4/6"),
        _mpfa_candidate("mpfa-q8-had128-k46", "mpfa-q8-had128 with K's block scales chosen 4/6", q=E4M3_ROW,
                        rotation=128, k_scale_choice="4/6"),
        _mpfa_candidate("mpfa-k8", "mpfa with the centered K in e4m3 (per-row power-of-two scale)", k=E4M3_ROW),
        _mpfa_candidate("mpfa-q8-k8", "mpfa with the centered Q and K in e4m3 (per-row power-of-two scales)",
                        q=E4M3_ROW, k=E4M3_ROW),
    )
}
# The numerics the served kernels compute (`mpfa.kernels.sm90.dispatch`: compensated, and their direct builds) and,
# for each served option other than the paper's, the variant each computes under it (`ServedNumerics.variant`).
SERVED_BASES = ("mpfa", "mpfa-qk8tile-psum", "qk4-pv8-direct", "qk8tile-psum-direct")
VARIANTS.update({
    option.variant(base): replace(VARIANTS[base], name=option.variant(base), rotation=option.rotation,
                                  rotate_inputs=bool(option.rotation), k_scale_choice=option.k_scale_choice,
                                  description=f"{base} served with MPFA_NUMERICS={option.name}: {option.description}")
    for option in SERVED_NUMERICS.values() if option != PAPER
    for base in SERVED_BASES
})


@dataclass(frozen=True)
class DecodePartials:
    """Split-KV decode state per (request, query head, partition): ``m`` the max raw score (-inf when the partition
    is empty), ``l`` the sum of ``exp2(lam * (S - m))`` (0 when empty), ``o`` the partition's normalized output
    (0 when empty); m, l [batch, Hq, partitions], o [batch, Hq, partitions, d]. ``lam = log2(e) * sm_scale``."""

    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor
    lam: float


@dataclass(frozen=True)
class _Sequences:
    """Packed operands after layout resolution: k, v [total_k, Hkv, d] and int64 CPU cu_seqlens."""

    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def _variant(name: str) -> VariantSpec:
    if name not in VARIANTS:
        raise ValueError(f"unknown attention variant {name!r}; choose one of {', '.join(VARIANTS)}")
    return VARIANTS[name]


def _lam(sm_scale: float | None, head_dim: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale!r}")
    return math.log2(math.e) * scale


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_dims: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, Hq, d], got shape {tuple(q.shape)}")
    if k.dim() != kv_dims or k.shape != v.shape:
        layout = "[num_pages, page_size, Hkv, d]" if kv_dims == 4 else "[total_k, Hkv, d]"
        raise ValueError(f"k and v must both be {layout}, got {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim, num_q_heads, num_kv_heads = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {head_dim} differs from k/v head_dim {k.shape[-1]}")
    if head_dim == 0 or head_dim % NVFP4_BLOCK:
        raise ValueError(f"head_dim must be a positive multiple of {NVFP4_BLOCK} (kernels: 64 or 128), got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq ({num_q_heads}) must be a multiple of Hkv ({num_kv_heads})")


def _gather_pages(cache: torch.Tensor, page_table: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    page_size = cache.shape[1]
    lengths = cu_k[1:] - cu_k[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(int(cu_k[-1])) - cu_k[:-1][seq]
    slots = page_table[seq, pos // page_size].long() * page_size + pos % page_size
    return cache.flatten(0, 1)[slots.to(cache.device)]


def _resolve(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    page_table: torch.Tensor | None,
    page_size: int | None,
) -> _Sequences:
    """Validate shapes and bring a packed or paged KV input to packed sequences."""
    paged = page_table is not None
    _check_heads(q, k, v, 4 if paged else 3)
    if paged:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("a paged KV cache needs cu_seqlens_q and cu_seqlens_k (the KV length of each sequence)")
        if page_size is None or k.shape[1] != page_size:
            raise ValueError(f"page_size {page_size} does not match the cache's page dimension {k.shape[1]}")
        table = torch.as_tensor(page_table).detach().to("cpu", torch.int64)
        lengths = torch.diff(torch.as_tensor(cu_seqlens_k).detach().to("cpu", torch.int64))
        if table.dim() != 2 or table.shape[0] != lengths.numel():
            raise ValueError(f"page_table must be [batch={lengths.numel()}, max_pages], got {tuple(table.shape)}")
        pages_needed = (lengths + page_size - 1) // page_size
        if bool((pages_needed > table.shape[1]).any()):
            raise ValueError(f"a sequence needs more than the page_table's {table.shape[1]} pages")
        used = torch.arange(table.shape[1]) < pages_needed[:, None]
        if bool(((table < 0) | (table >= k.shape[0]))[used].any()):
            raise ValueError(f"page_table refers to pages outside the cache's {k.shape[0]} pages")
        cu_k = check_cu_seqlens(cu_seqlens_k, int(lengths.sum()), "cu_seqlens_k")
        k, v = _gather_pages(k, table, cu_k), _gather_pages(v, table, cu_k)
    elif (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither (one sequence)")
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.tensor([0, q.shape[0]])
        cu_seqlens_k = torch.tensor([0, k.shape[0]])
    cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}")
    if not all(bool(torch.isfinite(x).all()) for x in (q, k, v)):
        raise ValueError("q, k and v must be finite: the inputs (the used cache slots, if paged) hold NaN or Inf")
    return _Sequences(k, v, cu_q, cu_k)


def _fake_quant_along_tokens(v: torch.Tensor) -> torch.Tensor:
    """NVFP4 for V [..., L, Hkv, d] (one sequence, or a batch of right-padded rows whose padding is zeros) in 16-token
    blocks from its first token (zero-padded at the end)."""
    length = v.shape[-3]
    pad = -length % NVFP4_BLOCK
    by_channel = torch.nn.functional.pad(v.movedim(-3, -1), (0, pad))  # [..., Hkv, d, L + pad]
    return fake_quant_nvfp4(by_channel)[..., :length].movedim(-1, -3)


def _operand(x: torch.Tensor, fmt: str, scale_choice: str = "6") -> torch.Tensor:
    if fmt == "bf16":
        return x.float()
    if fmt == "fp8":
        return fake_quant_fp8(x)
    if fmt == E4M3_ROW:
        return fake_quant_fp8_pow2(x)
    values = fake_quant_nvfp4(x, scale_choice=scale_choice)
    return fake_quant_fp8_pow2(values) if fmt == NVFP4_E4M3_ROW else values


def _qk_operands(spec: VariantSpec, q: torch.Tensor, k: torch.Tensor,
                 k_scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K (BF16-rounded, centered for smoothing variants) through the variant's rotation and formats;
    ``k_scale`` is FP8 K's scale, broadcastable over k."""
    if spec.rotation and not spec.rotate_inputs:
        block = min(spec.rotation, q.shape[-1])
        q, k = block_hadamard(q, block), block_hadamard(k, block)
    if spec.k == "fp8":
        return _operand(q, spec.q), fake_quant_fp8(k, k_scale)
    return _operand(q, spec.q), _operand(k, spec.k, spec.k_scale_choice)


def _rotated_inputs(spec: VariantSpec, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K (BF16 values) as a ``rotate_inputs`` variant's server hands them to its KV write: rotated in FP32;
    others unchanged."""
    if not spec.rotate_inputs:
        return q, k
    rotate = GemmRotation(min(spec.rotation, q.shape[-1]), q.device)
    return rotate(q), rotate(k)


@dataclass(frozen=True)
class Operands:
    """A variant's operands of packed sequences, in its compute dtype: q [total_q, Hq, d], k, v [total_k, Hkv, d]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    delta_s: torch.Tensor | None  # [total_k, Hq] in the compute dtype


def _check_means(means: SmoothingMeans, batch: int, q: torch.Tensor, k: torch.Tensor) -> None:
    expected_q, expected_k = (batch, *q.shape[1:]), (batch, *k.shape[1:])
    if tuple(means.q_mean.shape) != expected_q or tuple(means.k_mean.shape) != expected_k:
        raise ValueError(
            f"means must be q_mean {expected_q} and k_mean {expected_k}, "
            f"got {tuple(means.q_mean.shape)} and {tuple(means.k_mean.shape)}"
        )


def _check_options(spec: VariantSpec, means: SmoothingMeans | None, v_scale: float | torch.Tensor | None,
                   k_scale: float | torch.Tensor | None = None) -> None:
    """Options a variant does not use are an error rather than silently ignored."""
    if means is not None and not spec.smoothing:
        raise ValueError(f"means apply to smoothing variants; {spec.name!r} does not center Q/K")
    if v_scale is not None and spec.v != "fp8":
        raise ValueError(f"v_scale applies to FP8 V; variant {spec.name!r} stores V as {spec.v}")
    if k_scale is not None and spec.k != "fp8":
        raise ValueError(f"k_scale applies to FP8 K; variant {spec.name!r} stores K as {spec.k}")


def _kv_scale(scale: float | torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor:
    """An FP8 K or V scale broadcastable over x [total_k, Hkv, d]: a scalar or one value per KV head."""
    value = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32, device=x.device)
    if value.dim() == 0:
        return value
    if tuple(value.shape) != (x.shape[1],):
        raise ValueError(f"{name} must be a scalar or one value per KV head [{x.shape[1]}], got {tuple(value.shape)}")
    return value.view(1, -1, 1)


def _prepare(
    spec: VariantSpec,
    q: torch.Tensor,
    seqs: _Sequences,
    means: SmoothingMeans | None,
    v_scale: float | torch.Tensor | None,
    k_scale: float | torch.Tensor | None = None,
) -> Operands:
    """Round inputs to BF16, center (smoothing variants) and pass Q/K/V through the variant's formats."""
    if spec.q == "exact":
        return Operands(q.double(), seqs.k.double(), seqs.v.double(), None)
    q, k, v = (x.to(torch.bfloat16).float() for x in (q, seqs.k, seqs.v))
    q, k = _rotated_inputs(spec, q, k)
    ds = None
    if spec.smoothing:
        if means is None:
            means = SmoothingMeans(sequence_means(q, seqs.cu_q), sequence_means(k, seqs.cu_k))
        _check_means(means, seqs.cu_q.numel() - 1, q, k)
        q, k = center(q, means.q_mean, seqs.cu_q), center(k, means.k_mean, seqs.cu_k)
        ds = delta_s(means.q_mean, k, seqs.cu_k).float()
    if spec.v == "nvfp4":
        bounds = seqs.cu_k.tolist()
        v_op = torch.cat([_fake_quant_along_tokens(v[a:b]) for a, b in zip(bounds, bounds[1:])])
    elif spec.v == "fp8":
        v_op = fake_quant_fp8(v, _kv_scale(v_scale, v, "v_scale"))
    else:
        v_op = _operand(v, spec.v)
    q_op, k_op = _qk_operands(spec, q, k, _kv_scale(k_scale, k, "k_scale"))
    return Operands(q_op, k_op, v_op, ds)


def _p_operand(p: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "exact":
        return p
    if fmt == "bf16":
        return p.to(torch.bfloat16).float()
    if fmt == "fp8":
        return fake_quant_p_fp8(p)
    pad = -p.shape[-1] % NVFP4_BLOCK  # masked keys past the tile's end are zeros in the kernel's full tile
    return fake_quant_nvfp4(torch.nn.functional.pad(p, (0, pad)))[..., : p.shape[-1]]


def _kv_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ds: torch.Tensor | None,
    q_pos: torch.Tensor | None,
    kv_range: tuple[int, int],
    *,
    spec: VariantSpec,
    lam: float,
    block_n: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax of one Q tile over the KV tiles of ``kv_range`` (tiles aligned to the sequence start).

    q [Hq, rows, d]; k, v [Hkv, L, d]; ds [Hq, L] or None; q_pos [rows]: last visible key per row (None: all).
    Returns m, l [Hq, rows] and the unnormalized acc [Hq, rows, d]."""
    num_q_heads, rows, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    q_grouped = q.view(num_kv_heads, group * rows, head_dim)
    m = torch.full((num_q_heads, rows), -math.inf, dtype=q.dtype, device=q.device)
    l = torch.zeros((num_q_heads, rows), dtype=q.dtype, device=q.device)
    acc = torch.zeros((num_q_heads, rows, head_dim), dtype=q.dtype, device=q.device)
    start, end = kv_range
    last_visible = end - 1 if q_pos is None else min(end - 1, int(q_pos.max()))
    tiles = list(range(start, last_visible + 1, block_n))
    for t in reversed(tiles) if reverse else tiles:
        keys = torch.arange(t, min(t + block_n, end), device=q.device)
        k_tile = k[:, keys]
        if spec.k == NVFP4_E4M3_TILE:  # one power-of-two scale per KV head over the tile
            k_tile = fake_quant_fp8_pow2(k_tile, (-2, -1))
        s = (q_grouped @ k_tile.transpose(-1, -2)).view(num_q_heads, rows, keys.numel())
        if ds is not None:
            s = s + ds[:, None, keys]
        if q_pos is not None:
            s = s.masked_fill(keys[None, None, :] > q_pos[None, :, None], -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all-masked row: exp2(-inf) = 0
        p = torch.exp2(s * lam - (m_ref * lam)[..., None])
        alpha = torch.exp2(m * lam - m_ref * lam)
        p_op = _p_operand(p, spec.p)
        l = alpha * l + (p_op if spec.l_sums_p_operand else p).sum(-1)
        pv = p_op.reshape(num_kv_heads, group * rows, keys.numel()) @ v[:, keys]
        acc = alpha[..., None] * acc + pv.view(num_q_heads, rows, head_dim)
        m = m_new
    return m, l, acc


def _normalize(acc: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    safe = torch.where(l > 0, l, torch.ones_like(l))
    return torch.where((l > 0)[..., None], acc / safe[..., None], torch.zeros_like(acc))


def _check_block(name: str, value: int) -> None:
    if value <= 0 or value % NVFP4_BLOCK:
        raise ValueError(f"{name} must be a positive multiple of {NVFP4_BLOCK}, got {value}")


def attention_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Dense float64 softmax attention with the layouts and masking of ``attention``; no quantization."""
    seqs = _resolve(q, k, v, cu_seqlens_q, cu_seqlens_k, page_table, page_size)
    scale = _lam(sm_scale, q.shape[-1]) / math.log2(math.e)
    num_q_heads, num_kv_heads = q.shape[1], seqs.k.shape[1]
    out = torch.full(q.shape, math.nan, dtype=torch.float64, device=q.device)
    bounds_q, bounds_k = seqs.cu_q.tolist(), seqs.cu_k.tolist()
    for (qa, qb), (ka, kb) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        q_s = q[qa:qb].double().transpose(0, 1)  # [Hq, Lq, d]
        k_s = seqs.k[ka:kb].double().transpose(0, 1).repeat_interleave(num_q_heads // num_kv_heads, 0)
        v_s = seqs.v[ka:kb].double().transpose(0, 1).repeat_interleave(num_q_heads // num_kv_heads, 0)
        s = (q_s @ k_s.transpose(-1, -2)) * scale
        if causal:
            rows, keys = torch.arange(qb - qa, device=q.device), torch.arange(kb - ka, device=q.device)
            s = s.masked_fill(keys[None, :] > (rows + (kb - ka) - (qb - qa))[:, None], -math.inf)
        row_max = s.amax(-1, keepdim=True) if kb > ka else torch.zeros_like(s[..., :1])
        p = torch.exp(s - torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max))
        out[qa:qb] = _normalize(p @ v_s, p.sum(-1)).transpose(0, 1)
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    variant: str,
    causal: bool,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    block_m: int = 128,
    block_n: int = 128,
    sm_scale: float | None = None,
    means: SmoothingMeans | None = None,
    v_scale: float | torch.Tensor | None = None,
    reverse_kv: bool = True,
    k_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Tiled attention (see the module docstring) of a named variant -> [total_q, Hq, d].

    ``means``: smoothing means to use instead of the per-request means of q and k (smoothing variants only).
    ``v_scale`` / ``k_scale``: FP8 V / K dequantization scale, a float or one FP32 value per KV head (default 1.0;
    FP8-V / FP8-K variants).
    ``variant='float64'`` is the dense float64 reference (tile sizes and order do not apply)."""
    spec = _variant(variant)
    _check_options(spec, means, v_scale, k_scale)
    if spec.q == "exact":
        return attention_float64(
            q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            page_table=page_table, page_size=page_size, sm_scale=sm_scale,
        )
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    seqs = _resolve(q, k, v, cu_seqlens_q, cu_seqlens_k, page_table, page_size)
    lam = _lam(sm_scale, q.shape[-1])
    ops = _prepare(spec, q, seqs, means, v_scale, k_scale)
    out = torch.full(q.shape, math.nan, dtype=spec.compute_dtype, device=q.device)
    bounds_q, bounds_k = seqs.cu_q.tolist(), seqs.cu_k.tolist()
    for (qa, qb), (ka, kb) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        k_s, v_s = ops.k[ka:kb].transpose(0, 1), ops.v[ka:kb].transpose(0, 1)
        ds = None if ops.delta_s is None else ops.delta_s[ka:kb].transpose(0, 1)
        for row in range(qa, qb, block_m):
            rows = torch.arange(row - qa, min(row + block_m, qb) - qa, device=q.device)
            q_pos = rows + (kb - ka) - (qb - qa) if causal else None
            q_tile = ops.q[qa + rows].transpose(0, 1).contiguous()
            m, l, acc = _kv_tiles(
                q_tile, k_s, v_s, ds, q_pos, (0, kb - ka), spec=spec, lam=lam, block_n=block_n, reverse=reverse_kv
            )
            out[qa + rows] = _normalize(acc, l).transpose(0, 1)
    return out


def attention_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    variant: str,
    sm_scale: float | None = None,
    means: SmoothingMeans | None = None,
    block_n: int = 128,
    exact_sums: bool = False,
) -> torch.Tensor:
    """``attention(..., causal=True)`` of one unpadded sequence with every KV tile computed at once (for callers that
    run it thousands of times, e.g. a model's layers in `mpfa accuracy task`: a few dozen tensor ops per call
    instead of a few dozen per tile).

    The same operands (BF16 rounding, formats, centering, Delta_S) and, per row and KV tile, the same running max
    the reverse-order online softmax has when it reaches that tile, so P is quantized exactly as there; the
    rescaled sums are formed as ``sum_j exp2(lam * (m_j - m)) * X_j`` instead of by repeated ``alpha`` updates,
    which differs from ``attention`` by FP32 rounding only. Tile rows (``block_m``) do not change the result.
    ``exact_sums``: S, l and P V summed in float64 (see `attend_prepared_batch`; P roundings may then differ from
    ``attention``'s, whose S is an FP32 GEMM)."""
    if _variant(variant).q == "exact":
        _check_options(_variant(variant), means, None)
        return attention_float64(q, k, v, causal=True, sm_scale=sm_scale)
    ops = prepare_one_sequence(q, k, v, variant=variant, means=means)
    return attend_prepared(ops.q, ops.k, ops.v, ops.delta_s, variant=variant, sm_scale=sm_scale, block_n=block_n,
                           exact_sums=exact_sums)


def prepare_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, variant: str, means: SmoothingMeans | None = None
) -> Operands:
    """The operands `attention_one_sequence` computes with: q [Lq, Hq, d] and k, v [Lk, Hkv, d] through the variant's
    formats (centered with ``means`` for smoothing variants) and Delta_S [Lk, Hq]. Every variant but ``float64``
    (dense) and those with NVFP4 V (blocked along tokens) prepares each token on its own, so a sequence's key
    operands may be prepared in pieces and concatenated (`piecewise_keys`). The batch-of-one case of `prepare_batch`."""
    if _variant(variant).q == "exact":
        raise ValueError("the float64 variant has no prepared operands (it is the dense reference)")
    _check_heads(q, k, v, 3)
    ops = prepare_batch(q[None], k[None], v[None], variant=variant, means=means)
    return Operands(ops.q[0], ops.k[0], ops.v[0], None if ops.delta_s is None else ops.delta_s[0])


def piecewise_keys(variant: str) -> bool:
    """Whether ``prepare_one_sequence`` of a sequence's keys equals the concatenation of its pieces'."""
    spec = _variant(variant)
    return spec.q != "exact" and spec.v != "nvfp4"


def _prefix_mask(lengths: torch.Tensor, size: int, batch: int, device: torch.device, name: str) -> torch.Tensor:
    """[B, size] bool: True for the first lengths[b] entries of row b."""
    lengths = torch.as_tensor(lengths, device=device).long()
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must be [batch={batch}], got shape {tuple(lengths.shape)}")
    return torch.arange(size, device=device) < lengths[:, None]


def prepare_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    variant: str,
    means: SmoothingMeans | None = None,
    query_lengths: torch.Tensor | None = None,
    key_lengths: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> Operands:
    """`prepare_one_sequence` of B right-padded rows at once: q [B, Sq, Hq, d], k, v [B, Lk, Hkv, d] -> operands in the
    same layouts, Delta_S [B, Lk, Hq]. Row b's valid queries / keys are its first ``query_lengths[b]`` /
    ``key_lengths[b]`` (None: all); every key operand is per token except NVFP4 V (blocked along tokens from the
    row's first key), so keys past a row's length are set to zero first: its blocks then see the zeros the
    one-sequence form pads with, and the valid operands equal that row's `prepare_one_sequence`. Padding operands
    are finite and must be masked (`attend_prepared_batch`). Smoothing variants without ``means`` [B, ...] use each
    row's means over its valid queries and keys (`masked_means`). ``float64`` returns the inputs in float64.
    ``k_scale`` / ``v_scale``: FP8 K / V scales, one FP32 value per KV head [Hkv] (calibrated; default 1.0)."""
    spec = _variant(variant)
    _check_options(spec, means, v_scale, k_scale)
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"q must be [B, Sq, Hq, d] and k, v [B, Lk, Hkv, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    _check_heads(q[0], k[0], v[0], 3)
    if not bool(torch.isfinite(q).all() & torch.isfinite(k).all() & torch.isfinite(v).all()):
        raise ValueError("q, k and v must be finite: the inputs hold NaN or Inf")
    batch = q.shape[0]
    key_valid = None
    if key_lengths is not None:
        key_valid = _prefix_mask(key_lengths, k.shape[1], batch, k.device, "key_lengths")
        k, v = (x.masked_fill(~key_valid[..., None, None], 0) for x in (k, v))
    if spec.q == "exact":
        return Operands(q.double(), k.double(), v.double(), None)
    q, k, v = (x.to(torch.bfloat16).float() for x in (q, k, v))
    q, k = _rotated_inputs(spec, q, k)
    ds = None
    if spec.smoothing:
        if means is None:
            q_valid = None if query_lengths is None else _prefix_mask(
                query_lengths, q.shape[1], batch, q.device, "query_lengths")
            means = SmoothingMeans(masked_means(q, q_valid), masked_means(k, key_valid))
        _check_means(means, batch, q[0], k[0])
        q = q - means.q_mean.to(q.device, torch.float32)[:, None]  # `center`, per row
        k = k - means.k_mean.to(k.device, torch.float32)[:, None]
        ds = delta_s_padded(means.q_mean, k).float()
    if spec.v == "nvfp4":
        v_op = _fake_quant_along_tokens(v)
    elif spec.v == "fp8":
        v_op = fake_quant_fp8(v, _head_scale(v_scale, v, "v_scale"))
    else:
        v_op = _operand(v, spec.v)
    q_op, k_op = _qk_operands(spec, q, k, _head_scale(k_scale, k, "k_scale"))
    return Operands(q_op, k_op, v_op, ds)


def _head_scale(scale: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor | float:
    """A per-KV-head scale [Hkv] broadcast over x [B, L, Hkv, d]; 1.0 when None."""
    if scale is None:
        return 1.0
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if tuple(scale.shape) != (x.shape[2],) or not bool((scale > 0).all() & torch.isfinite(scale).all()):
        raise ValueError(f"{name} must hold one positive finite value per KV head [{x.shape[2]}], "
                         f"got {tuple(scale.shape)}")
    return scale.view(1, 1, -1, 1)


def _requantize_key_tiles(k_op: torch.Tensor, block_n: int, key_lengths: torch.Tensor | None) -> torch.Tensor:
    """``nvfp4>e4m3-tile`` keys [B, Lk, Hkv, d] as the QK^T MMA reads them: ``block_n``-key tiles from key 0, each
    requantized with one power-of-two scale per KV head. Keys past row b's ``key_lengths[b]`` (None: all Lk are
    valid) are not in its tiles: they are zeroed, which leaves the tile scales as in the one-sequence form."""
    if key_lengths is not None:
        valid = _prefix_mask(key_lengths, k_op.shape[1], k_op.shape[0], k_op.device, "key_lengths")
        k_op = k_op.masked_fill(~valid[..., None, None], 0)
    pad = -k_op.shape[1] % block_n
    tiles = torch.nn.functional.pad(k_op, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, block_n))  # [B, T, n, Hkv, d]
    return fake_quant_fp8_pow2(tiles, (2, 4)).flatten(1, 2)[:, : k_op.shape[1]]


def attend_prepared(
    q_op: torch.Tensor,
    k_op: torch.Tensor,
    v_op: torch.Tensor,
    delta_s: torch.Tensor | None,
    *,
    variant: str,
    sm_scale: float | None = None,
    block_n: int = 128,
    exact_sums: bool = False,
) -> torch.Tensor:
    """The all-tiles-at-once causal attention of `attention_one_sequence` on prepared operands: q_op [Lq, Hq, d] are
    the sequence's last Lq tokens, k_op / v_op [Lk, Hkv, d], delta_s [Lk, Hq] or None -> [Lq, Hq, d] FP32. The
    batch-of-one case of `attend_prepared_batch` (``exact_sums`` as there)."""
    ds = None if delta_s is None else delta_s[None]
    return attend_prepared_batch(q_op[None], k_op[None], v_op[None], ds, variant=variant, sm_scale=sm_scale,
                                 block_n=block_n, exact_sums=exact_sums)[0]


def attend_prepared_batch(
    q_op: torch.Tensor,
    k_op: torch.Tensor,
    v_op: torch.Tensor,
    delta_s: torch.Tensor | None,
    *,
    variant: str,
    sm_scale: float | None = None,
    block_n: int = 128,
    key_lengths: torch.Tensor | None = None,
    query_lengths: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    exact_sums: bool = False,
) -> torch.Tensor:
    """`attend_prepared` of B right-padded rows at once (one set of tensor ops for the whole batch):
    q_op [B, Sq, Hq, d], k_op / v_op [B, Lk, Hkv, d], delta_s [B, Lk, Hq] or None -> [B, Sq, Hq, d] (FP32; float64
    for ``float64``).

    Row b's keys are its first ``key_lengths[b]`` (None: all Lk), KV tiles aligned to key 0 as in the one-sequence
    form, and its valid queries its first ``query_lengths[b]`` (None: all Sq), the last keys of the row (causal,
    bottom-right aligned per row: query i sees keys j <= i + key_lengths[b] - query_lengths[b]). ``query_positions``
    [B, Sq] gives instead the last key each query row sees (-1: none). Padding keys score -inf before the running
    max, so P there is exactly 0 and a tile with no visible key leaves the state unchanged; padding query rows and
    rows that see no key give 0. Each valid row equals `attend_prepared` of that row alone up to the order of FP32
    sums (the trailing all-masked tiles add exact zeros). ``nvfp4>e4m3-tile`` keys are requantized per tile here;
    rows with padding keys need ``key_lengths`` (also with ``query_positions``) to keep them out of the tile scales.

    ``exact_sums``: form S = Q_op K_op^T, l and P V in float64 and round S (before P) and O once to FP32, and
    evaluate exp2 in float64 too (rounded to FP32: P is still exp2 of the FP32 argument). The operands have few
    significant bits, so the products and (but for vanishing cases) their sums are exact and nothing depends on
    the summation order or on which exp2 code path an element takes, both of which vary with the batch and
    matrix shapes: a row's S, P roundings (BF16 / FP8 / NVFP4) and O are then the same batched and alone, bit for bit
    but for vanishing cases. Without it (the default, as the tiled `attention`) S, l and P V are FP32 sums: O moves
    by FP32 roundings with the batch, and an S one ulp apart can flip a P rounding (one P element moves by up to
    2**-9 (BF16) or 2**-4 (FP8) of itself); through a model's layers such differences grow into different
    outputs."""
    spec = _variant(variant)
    _check_block("block_n", block_n)
    lam = _lam(sm_scale, q_op.shape[-1])
    (batch, len_q, num_q_heads, head_dim), (len_k, num_kv_heads) = q_op.shape, k_op.shape[1:3]
    group, device = num_q_heads // num_kv_heads, q_op.device
    tiles, pad = -(-len_k // block_n), -len_k % block_n
    rows = torch.arange(len_q, device=device)
    if query_positions is None:
        last = len_k if key_lengths is None else torch.as_tensor(key_lengths, device=device).long()[:, None]
        count = len_q if query_lengths is None else torch.as_tensor(query_lengths, device=device).long()[:, None]
        query_positions = rows + (last - count)
        if query_lengths is not None:
            query_positions = torch.where(rows < count, query_positions, -1)
    else:
        query_positions = torch.as_tensor(query_positions, device=device).long()
        if key_lengths is not None:
            query_positions = torch.minimum(query_positions,
                                            torch.as_tensor(key_lengths, device=device).long()[:, None] - 1)
    if spec.k == NVFP4_E4M3_TILE:
        k_op = _requantize_key_tiles(k_op, block_n, key_lengths)
    wide = torch.float64 if exact_sums else q_op.dtype  # what S, l and P V are summed in
    q_h = q_op.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group * len_q, head_dim)
    s = (q_h.to(wide) @ k_op.permute(0, 2, 3, 1).to(wide)).to(q_op.dtype).view(batch, num_q_heads, len_q, len_k)
    if delta_s is not None:
        s = s + delta_s.transpose(1, 2)[:, :, None, :]
    keys = torch.arange(len_k, device=device)
    s = s.masked_fill(keys > query_positions.reshape(-1, 1, len_q, 1), -math.inf)
    s = torch.nn.functional.pad(s, (0, pad), value=-math.inf).view(batch, num_q_heads, len_q, tiles, block_n)
    # running max when tile j is reached, tiles visited last to first: max over tiles j..end
    m = s.amax(-1).flip(-1).cummax(-1).values.flip(-1)
    seen = torch.isfinite(m)
    m_ref = torch.where(seen, m, torch.zeros_like(m))
    # exp2 of the FP32 argument, evaluated in `wide`: vectorized and scalar FP32 exp2 differ in the last ulp and
    # which elements take which path depends on the tensor's size
    exp2 = lambda x: torch.exp2(x.to(wide)).to(x.dtype)  # noqa: E731
    p = exp2(s * lam - (m_ref * lam)[..., None])
    weight = torch.where(seen, exp2(m_ref * lam - (m_ref[..., :1] * lam)), torch.zeros_like(m))
    v_tiles = torch.nn.functional.pad(v_op.permute(0, 2, 1, 3).to(wide), (0, 0, 0, pad))
    v_tiles = v_tiles.view(batch, num_kv_heads, tiles, block_n, head_dim)
    p_op = _p_operand(p, spec.p).to(wide).view(batch, num_kv_heads, group, len_q, tiles, block_n)
    summed = p_op.view(p.shape) if spec.l_sums_p_operand else p.to(wide)
    l = (summed.sum(-1) * weight.to(wide)).sum(-1)
    pv = torch.einsum("bhgqtk,bhtkd->bhgqtd", p_op, v_tiles).reshape(batch, num_q_heads, len_q, tiles, head_dim)
    acc = (pv * weight.to(wide)[..., None]).sum(-2)
    return _normalize(acc, l).to(q_op.dtype).transpose(1, 2)


def decode_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    variant: str,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    partition_size: int = 1024,
    block_n: int = 128,
    sm_scale: float | None = None,
    means: SmoothingMeans | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> DecodePartials:
    """Split-KV decode: one query token per request, q [batch, Hq, d], against its cache (packed or paged, as in
    ``attention``); the cache holds the current token. Partition p covers tokens
    ``[p * partition_size, (p + 1) * partition_size)``; the number of partitions is set by the longest sequence and
    shorter ones get empty partitions (m = -inf, l = 0, o = 0, no exponentials). Smoothing variants need the
    request's frozen prefill ``means``; ``float64`` runs the same tiles in float64."""
    spec = _variant(variant)
    _check_options(spec, means, v_scale)
    _check_block("block_n", block_n)
    if partition_size <= 0 or partition_size % block_n:
        raise ValueError(f"partition_size must be a positive multiple of block_n={block_n}, got {partition_size}")
    if spec.smoothing and means is None:
        raise ValueError(f"variant {variant!r} centers Q/K: pass the request's frozen prefill means")
    cu_q = torch.arange(q.shape[0] + 1)
    seqs = _resolve(q, k, v, cu_q, cu_seqlens_k, page_table, page_size)
    lam = _lam(sm_scale, q.shape[-1])
    ops = _prepare(spec, q, seqs, means, v_scale)
    batch, num_q_heads, head_dim = q.shape
    lengths = (seqs.cu_k[1:] - seqs.cu_k[:-1]).tolist()
    parts = max(1, -(-max(lengths, default=0) // partition_size))
    dtype, device = spec.compute_dtype, q.device
    m = torch.full((batch, num_q_heads, parts), math.nan, dtype=dtype, device=device)
    l = torch.full_like(m, math.nan)
    o = torch.full((batch, num_q_heads, parts, head_dim), math.nan, dtype=dtype, device=device)
    for b, (ka, length) in enumerate(zip(seqs.cu_k.tolist(), lengths)):
        k_s, v_s = ops.k[ka : ka + length].transpose(0, 1), ops.v[ka : ka + length].transpose(0, 1)
        ds = None if ops.delta_s is None else ops.delta_s[ka : ka + length].transpose(0, 1)
        for p in range(parts):
            start, end = p * partition_size, min((p + 1) * partition_size, length)
            if start >= end:
                m[b, :, p], l[b, :, p], o[b, :, p] = -math.inf, 0.0, 0.0
                continue
            mp, lp, acc = _kv_tiles(
                ops.q[b][:, None], k_s, v_s, ds, None, (start, end), spec=spec, lam=lam, block_n=block_n, reverse=True
            )
            m[b, :, p], l[b, :, p], o[b, :, p] = mp[:, 0], lp[:, 0], _normalize(acc, lp)[:, 0]
    return DecodePartials(m, l, o, lam)


def merge_partials(partials: DecodePartials) -> torch.Tensor:
    """Log-sum-exp merge of split-KV partials -> [batch, Hq, d]; a request with no keys gives 0."""
    m_max = partials.m.amax(-1, keepdim=True)
    m_ref = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    weights = partials.l * torch.exp2(partials.m * partials.lam - m_ref * partials.lam)
    return _normalize((weights[..., None] * partials.o).sum(-2), weights.sum(-1))


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    variant: str,
    cu_seqlens_k: torch.Tensor,
    page_table: torch.Tensor | None = None,
    page_size: int | None = None,
    partition_size: int = 1024,
    block_n: int = 128,
    sm_scale: float | None = None,
    means: SmoothingMeans | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``merge_partials(decode_partials(...))`` -> [batch, Hq, d]."""
    return merge_partials(
        decode_partials(
            q, k, v, variant=variant, cu_seqlens_k=cu_seqlens_k, page_table=page_table, page_size=page_size,
            partition_size=partition_size, block_n=block_n, sm_scale=sm_scale, means=means, v_scale=v_scale,
        )
    )
