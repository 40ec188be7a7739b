"""Tiled reference attention against the dense float64 reference: varlen, GQA, causal alignment, paging, order."""

from __future__ import annotations

import pytest
import torch

import math

from mpfa.kernels import (VARIANTS, SmoothingMeans, attention, attention_float64, center, delta_s, fake_quant_fp8,
                          fake_quant_fp8_pow2, fake_quant_nvfp4, fake_quant_p_fp8, sequence_means)
from mpfa.kernels.rotation import hadamard_matrix

# The bf16 variant's only rounding beyond FP32 is P -> BF16 before the PV GEMM (inputs are BF16 already): a relative
# error of at most 2**-8 per P element, so |O - O_ref| <= 2**-8 * sum_j P_j |V_j| / l elementwise. 2**-12 more
# covers the FP32 rounding of S, exp2 and the accumulations (orders of magnitude below the BF16 term).
BF16_P_BOUND = 2.0**-8 + 2.0**-12


def bf16_bound(b, causal: bool) -> torch.Tensor:
    """Elementwise bound for the bf16 variant: sum_j P_j |V_j| / l is attention with |V|."""
    return BF16_P_BOUND * attention_float64(b.q, b.k, b.v.abs(), causal=causal, **b.varlen)


def no_key_rows(q_lens: list[int], k_lens: list[int], causal: bool) -> torch.Tensor:
    """Rows that see no key: every row when kv_len = 0; the first q_len - kv_len rows under causal."""
    rows = []
    for q_len, k_len in zip(q_lens, k_lens):
        blind = q_len if k_len == 0 else (max(0, q_len - k_len) if causal else 0)
        rows += [True] * blind + [False] * (q_len - blind)
    return torch.tensor(rows, dtype=torch.bool)


CASES = [
    # q_lens, k_lens, Hq, Hkv, d, causal, block_m, block_n
    pytest.param([1, 17, 130, 0, 5], [1, 17, 130, 3, 0], 8, 2, 64, True, 128, 128, id="varlen-causal-8:2"),
    pytest.param([1, 17, 130, 0, 5], [1, 17, 130, 3, 0], 8, 2, 64, False, 128, 128, id="varlen-noncausal-8:2"),
    pytest.param([33, 150], [100, 150], 10, 2, 128, True, 32, 48, id="chunked-prefill-10:2-small-tiles"),
    pytest.param([50], [20], 10, 2, 64, True, 16, 16, id="q-longer-than-kv-causal"),
    pytest.param([70], [70], 32, 8, 128, True, 64, 64, id="gqa-32:8"),
]


@pytest.mark.parametrize("q_lens, k_lens, hq, hkv, d, causal, block_m, block_n", CASES)
def test_bf16_tiles_match_float64(make_batch, q_lens, k_lens, hq, hkv, d, causal, block_m, block_n) -> None:
    b = make_batch(q_lens, k_lens, hq, hkv, d)
    out = attention(b.q, b.k, b.v, variant="bf16", causal=causal, block_m=block_m, block_n=block_n, **b.varlen)
    ref = attention_float64(b.q, b.k, b.v, causal=causal, **b.varlen)
    assert out.dtype == torch.float32 and out.shape == b.q.shape
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(ref).all())
    assert bool(((out.double() - ref).abs() <= bf16_bound(b, causal)).all())
    blind = no_key_rows(q_lens, k_lens, causal)
    assert not bool(out[blind].any()) and not bool(ref[blind].any())
    assert bool((ref[~blind].abs().sum(-1) > 0).all())


def test_float64_variant_is_the_dense_reference(make_batch) -> None:
    b = make_batch([12, 30], [40, 30], 4, 2, 64)
    ref = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)
    assert torch.equal(attention(b.q, b.k, b.v, variant="float64", causal=True, **b.varlen), ref)
    # an independent dense softmax for the second sequence (q_len = kv_len, so plain lower-triangular causal)
    q, k, v = (x[12:].double() if x is b.q else x[40:].double() for x in (b.q, b.k, b.v))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) / 8.0
    s = s.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(ref[12:], torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", ["bf16", "fp8", "mpfa", "qk4-pv4"])
@pytest.mark.parametrize("page_size", [16, 7])
def test_paged_input_equals_contiguous(make_batch, to_paged, variant: str, page_size: int) -> None:
    b = make_batch([20, 1, 45], [60, 9, 45], 4, 2, 64)
    k_cache, v_cache, table = to_paged(b.k, b.v, b.cu_k, page_size)
    paged = attention(
        b.q, k_cache, v_cache, variant=variant, causal=True, page_table=table, page_size=page_size, block_n=32,
        **b.varlen,
    )
    packed = attention(b.q, b.k, b.v, variant=variant, causal=True, block_n=32, **b.varlen)
    assert bool(torch.isfinite(paged).all()) and torch.equal(paged, packed)


def test_reverse_traversal_changes_only_rounding(make_batch) -> None:
    b = make_batch([200], [300], 4, 1, 64)
    args = dict(variant="bf16", causal=True, block_m=64, block_n=32, **b.varlen)
    reverse, forward = attention(b.q, b.k, b.v, **args), attention(b.q, b.k, b.v, reverse_kv=False, **args)
    ref, bound = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen), bf16_bound(b, True)
    for out in (reverse, forward):
        assert bool(torch.isfinite(out).all()) and bool(((out.double() - ref).abs() <= bound).all())
    assert not torch.equal(reverse, forward)  # P is rounded against a different running max
    assert bool(((reverse - forward).double().abs() <= 2 * bound).all())


def test_variant_error_ordering_with_channel_outliers(make_batch) -> None:
    """bf16 < fp8 < mpfa < qk4-pv8-direct in relative L2 vs float64. Plain Gaussians lack the channel outliers of
    real Q/K, so 8 channels carry offsets (K std 6, Q std 1): only centering keeps them out of NVFP4 block scales."""
    b = make_batch([192, 64], [192, 128], 8, 2, 128, q_offset=1.0, k_offset=6.0)
    ref = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)
    errors = {}
    for variant in ("bf16", "fp8", "mpfa", "qk4-pv8-direct"):
        out = attention(b.q, b.k, b.v, variant=variant, causal=True, **b.varlen)
        assert bool(torch.isfinite(out).all())
        errors[variant] = float((out.double() - ref).norm() / ref.norm())
    assert 2.0**-14 < errors["bf16"] < 2.0**-8  # P is rounded to BF16 (FA2/FA3), not kept in FP32
    assert errors["bf16"] < errors["fp8"] < errors["mpfa"] < errors["qk4-pv8-direct"], errors


def test_registry_matches_the_spec() -> None:
    formats = {name: (s.q, s.k, s.p, s.v, s.smoothing) for name, s in VARIANTS.items()}
    assert formats == {
        "float64": ("exact", "exact", "exact", "exact", False),
        "bf16": ("bf16", "bf16", "bf16", "bf16", False),
        "fp8": ("bf16", "fp8", "bf16", "fp8", False),
        "fp8-qkpv": ("fp8", "fp8", "fp8", "fp8", False),
        "qk4-pv16": ("nvfp4", "nvfp4", "bf16", "bf16", True),
        "qk4-pv8-direct": ("nvfp4", "nvfp4", "fp8", "fp8", False),
        "mpfa": ("nvfp4", "nvfp4", "fp8", "fp8", True),
        "qk4-pv4": ("nvfp4", "nvfp4", "nvfp4", "nvfp4", True),
        "mpfa-qk8row": ("nvfp4>e4m3-row", "nvfp4>e4m3-row", "fp8", "fp8", True),
        "mpfa-qk8tile": ("nvfp4>e4m3-row", "nvfp4>e4m3-tile", "fp8", "fp8", True),
        "mpfa-qk8tile-psum": ("nvfp4>e4m3-row", "nvfp4>e4m3-tile", "fp8", "fp8", True),
        "qk8tile-psum-direct": ("nvfp4>e4m3-row", "nvfp4>e4m3-tile", "fp8", "fp8", False),
        "mpfa-q8": ("e4m3-row", "nvfp4", "fp8", "fp8", True),
        "mpfa-had16": ("nvfp4", "nvfp4", "fp8", "fp8", True),
        "mpfa-had128": ("nvfp4", "nvfp4", "fp8", "fp8", True),
        "mpfa-k46": ("nvfp4", "nvfp4", "fp8", "fp8", True),
        "mpfa-q8-had16": ("e4m3-row", "nvfp4", "fp8", "fp8", True),
        "mpfa-q8-had128": ("e4m3-row", "nvfp4", "fp8", "fp8", True),
        "mpfa-q8-k46": ("e4m3-row", "nvfp4", "fp8", "fp8", True),
        "mpfa-had16-k46": ("nvfp4", "nvfp4", "fp8", "fp8", True),
        "mpfa-q8-had128-k46": ("e4m3-row", "nvfp4", "fp8", "fp8", True),
        "mpfa-k8": ("nvfp4", "e4m3-row", "fp8", "fp8", True),
        "mpfa-q8-k8": ("e4m3-row", "e4m3-row", "fp8", "fp8", True),
        # MPFA_NUMERICS=had128-k46 on each served kernel's numerics: the base's formats
        "mpfa-had128-k46": ("nvfp4", "nvfp4", "fp8", "fp8", True),
        "mpfa-qk8tile-psum-had128-k46": ("nvfp4>e4m3-row", "nvfp4>e4m3-tile", "fp8", "fp8", True),
        "qk4-pv8-direct-had128-k46": ("nvfp4", "nvfp4", "fp8", "fp8", False),
        "qk8tile-psum-direct-had128-k46": ("nvfp4>e4m3-row", "nvfp4>e4m3-tile", "fp8", "fp8", False),
    }
    assert [name for name, s in VARIANTS.items() if s.l_sums_p_operand] == [
        "mpfa-qk8tile-psum", "qk8tile-psum-direct", "mpfa-qk8tile-psum-had128-k46", "qk8tile-psum-direct-had128-k46"]
    served = ["mpfa-had128-k46", "mpfa-qk8tile-psum-had128-k46", "qk4-pv8-direct-had128-k46",
              "qk8tile-psum-direct-had128-k46"]
    assert {name: s.rotation for name, s in VARIANTS.items() if s.rotation} == {
        "mpfa-had16": 16, "mpfa-had128": 128, "mpfa-q8-had16": 16, "mpfa-q8-had128": 128, "mpfa-had16-k46": 16,
        "mpfa-q8-had128-k46": 128, **{name: 128 for name in served}}
    assert [name for name, s in VARIANTS.items() if s.rotate_inputs] == served
    assert [name for name, s in VARIANTS.items() if s.k_scale_choice != "6"] == [
        "mpfa-k46", "mpfa-q8-k46", "mpfa-had16-k46", "mpfa-q8-had128-k46", *served]


def test_fp8_variant_quantizes_only_k_and_v(make_batch) -> None:
    """On K/V already representable in FP8 the fp8 variant is bit-identical to bf16 (same Q and P handling)."""
    b = make_batch([30, 64], [80, 64], 4, 2, 64)
    k, v = fake_quant_fp8(b.k).bfloat16(), fake_quant_fp8(b.v).bfloat16()
    fp8 = attention(b.q, k, v, variant="fp8", causal=True, **b.varlen)
    assert bool(torch.isfinite(fp8).all())
    assert torch.equal(fp8, attention(b.q, k, v, variant="bf16", causal=True, **b.varlen))
    assert torch.equal(fp8, attention(b.q, b.k, b.v, variant="fp8", causal=True, **b.varlen))  # K/V quantized
    assert not torch.equal(fp8, attention(b.q, b.k, b.v, variant="bf16", causal=True, **b.varlen))


def _nvfp4_padded(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 along the last dim, zero-padded to a multiple of 16 and trimmed back."""
    pad = -x.shape[-1] % 16
    return fake_quant_nvfp4(torch.nn.functional.pad(x, (0, pad)))[..., : x.shape[-1]]


def emulate_one_tile(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Dense FP32 emulation of a variant for one sequence whose keys fit in one KV tile (the running max is then the
    row max): written from the variant table with the public format/smoothing functions, not the tiled code."""
    spec = VARIANTS[variant]
    group, head_dim = q.shape[1] // k.shape[1], q.shape[2]
    q, k, v = q.float(), k.float(), v.float()
    block = min(spec.rotation, head_dim) or 1  # 1: no rotation (the identity)
    rotation = torch.block_diag(*[hadamard_matrix(block)] * (head_dim // block))
    if spec.rotate_inputs:  # the BF16 inputs rotated (float64 here, the variant's GEMM in FP32), before centering
        q, k = (q.double() @ rotation).float(), (k.double() @ rotation).float()
    cu_q, cu_k = torch.tensor([0, q.shape[0]]), torch.tensor([0, k.shape[0]])
    shift = torch.zeros(q.shape[1], 1, k.shape[0])
    if spec.smoothing:
        q_mean, k_mean = sequence_means(q, cu_q), sequence_means(k, cu_k)
        q, k = center(q, q_mean, cu_q), center(k, k_mean, cu_k)
        shift = delta_s(q_mean, k, cu_k).float().T[:, None, :]
    if spec.rotation and not spec.rotate_inputs:  # block-diagonal Hadamard of the centered Q and K (Delta_S above
        q, k = q @ rotation.float(), k @ rotation.float()  # is unrotated)
    def formats(nvfp4):  # K's NVFP4 takes its block-scale choice (4/6), Q's the standard one
        return {
            "bf16": lambda x: x,
            "fp8": fake_quant_fp8,
            "nvfp4": nvfp4,
            "e4m3-row": fake_quant_fp8_pow2,  # per token and head
            "nvfp4>e4m3-row": lambda x: fake_quant_fp8_pow2(nvfp4(x)),  # per token and head
            "nvfp4>e4m3-tile": lambda x: fake_quant_fp8_pow2(nvfp4(x), (0, 2)),  # the one tile, per KV head
        }

    q_op = formats(fake_quant_nvfp4)[spec.q](q)
    k_op = formats(lambda x: fake_quant_nvfp4(x, scale_choice=spec.k_scale_choice))[spec.k](k)
    if spec.v == "nvfp4":  # 16-token blocks per channel
        v_op = _nvfp4_padded(v.permute(1, 2, 0)).permute(2, 0, 1)
    else:
        v_op = formats(fake_quant_nvfp4)[spec.v](v)
    s = torch.einsum("ihd,jhd->hij", q_op, k_op.repeat_interleave(group, 1)) + shift
    if causal:
        offset = k.shape[0] - q.shape[0]
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1 + offset), -math.inf)
    lam = math.log2(math.e) / math.sqrt(head_dim)
    p = torch.exp2(s * lam - s.amax(-1, keepdim=True) * lam)
    p_formats = {"bf16": lambda x: x.bfloat16().float(), "fp8": fake_quant_p_fp8, "nvfp4": _nvfp4_padded}
    p_op = p_formats[spec.p](p)
    out = torch.einsum("hij,jhd->ihd", p_op, v_op.repeat_interleave(group, 1))
    return out / (p_op if spec.l_sums_p_operand else p).sum(-1).T[..., None]  # l sums the FP32 P (psum: P_op)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [name for name in VARIANTS if name != "float64"])
def test_variant_matches_dense_emulation_on_one_tile(make_batch, variant: str, causal: bool) -> None:
    """Pins each variant's operand formats, centering, Delta_S, P format and l. Tolerance 1e-4 relative L2: FP32
    summation-order differences can flip the rounding of a rare P element (~1e-6 of the output each), while any
    format or wiring change moves the output by 1e-3 or more."""
    b = make_batch([40], [100], 8, 2, 64, q_offset=1.0, k_offset=4.0)
    out = attention(b.q, b.k, b.v, variant=variant, causal=causal, block_n=128)
    expected = emulate_one_tile(variant, b.q, b.k, b.v, causal)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(expected).all())
    assert float((out - expected).norm() / expected.norm()) < 1e-4


def test_every_variant_runs_finite_with_explicit_means(make_batch) -> None:
    b = make_batch([40, 3], [40, 50], 4, 2, 64)
    means = SmoothingMeans(torch.randn(2, 4, 64), torch.randn(2, 2, 64))
    ref = attention_float64(b.q, b.k, b.v, causal=True, **b.varlen)
    for name, spec in VARIANTS.items():
        out = attention(b.q, b.k, b.v, variant=name, causal=True, means=means if spec.smoothing else None, **b.varlen)
        assert bool(torch.isfinite(out).all()), name
        assert float((out.double() - ref).norm() / ref.norm()) < 0.5, name


def test_sm_scale_and_v_scale(make_batch) -> None:
    b = make_batch([30], [50], 4, 2, 64)
    out = attention(b.q, b.k, b.v, variant="bf16", causal=False, sm_scale=0.3, **b.varlen)
    ref = attention_float64(b.q, b.k, b.v, causal=False, sm_scale=0.3, **b.varlen)
    bound = BF16_P_BOUND * attention_float64(b.q, b.k, b.v.abs(), causal=False, sm_scale=0.3, **b.varlen)
    assert bool(((out.double() - ref).abs() <= bound).all())
    # A power-of-two V scale commutes with FP8 rounding: scaled V with a matching v_scale scales O exactly.
    head_scale = torch.tensor([1.0, 16.0])
    scaled_v = b.v * head_scale.view(1, 2, 1).bfloat16()
    base = attention(b.q, b.k, b.v, variant="fp8", causal=True, **b.varlen)
    scaled = attention(b.q, b.k, scaled_v, variant="fp8", causal=True, v_scale=head_scale, **b.varlen)
    assert torch.equal(scaled, base * head_scale.repeat_interleave(2).view(1, 4, 1))
    # The same for K: K scaled by 16 with k_scale 16 stores the same e4m3 codes; dequantized they are 16x, which an
    # sm_scale 16x smaller undoes exactly (powers of two), so both heads' outputs match the unscaled run bit for bit.
    k_scale = torch.tensor([16.0, 16.0])
    base = attention(b.q, b.k, b.v, variant="fp8", causal=True, sm_scale=0.25, **b.varlen)
    out = attention(b.q, b.k * 16, b.v, variant="fp8", causal=True, k_scale=k_scale, sm_scale=0.25 / 16, **b.varlen)
    assert torch.equal(out, base)
    unscaled = attention(b.q, b.k * 16, b.v, variant="fp8", causal=True, sm_scale=0.25 / 16, **b.varlen)
    assert not torch.equal(unscaled, base)  # unscaled, the keys e4m3 held as subnormals now round as normals


def _bad_inputs(make_batch, to_paged):
    b = make_batch([5], [6], 4, 2, 64)
    k_cache, v_cache, table = to_paged(b.k, b.v, b.cu_k, 4)
    nan_q = b.q.clone()
    nan_q[2, 1, 3] = float("nan")
    return b, [
        (dict(q=b.q[:, :3]), {}, "multiple of Hkv"),
        (dict(q=b.q[..., :40], k=b.k[..., :40], v=b.v[..., :40]), {}, "head_dim"),
        (dict(k=b.k[..., :32], v=b.v[..., :32]), {}, "head_dim"),
        (dict(v=b.v[:5]), {}, "k and v"),
        ({}, dict(variant="fp16"), "unknown attention variant"),
        ({}, dict(block_n=100), "block_n"),
        ({}, dict(cu_seqlens_k=None), "both cu_seqlens_q and cu_seqlens_k"),
        ({}, dict(cu_seqlens_k=torch.tensor([0, 5])), "end at 6"),
        (dict(k=k_cache, v=v_cache), dict(page_table=table, page_size=4, cu_seqlens_q=None), "paged"),
        (dict(k=k_cache, v=v_cache), dict(page_table=table + 100, page_size=4), "outside the cache"),
        (dict(k=k_cache, v=v_cache), dict(page_table=table, page_size=8), "page_size"),
        (dict(q=nan_q), {}, "finite"),
        ({}, dict(variant="mpfa", means="wrong"), "means"),
        ({}, dict(v_scale=2.0), "v_scale"),
        ({}, dict(means=SmoothingMeans(torch.zeros(1, 4, 64), torch.zeros(1, 2, 64))), "smoothing variants"),
        ({}, dict(variant="fp8", v_scale=torch.ones(3)), "v_scale"),
        ({}, dict(k_scale=2.0), "k_scale applies to FP8 K"),
        ({}, dict(variant="fp8", k_scale=torch.ones(3)), "k_scale must be"),
        ({}, dict(sm_scale=-1.0), "sm_scale"),
    ]


def test_bad_inputs_raise_clear_value_errors(make_batch, to_paged) -> None:
    b, cases = _bad_inputs(make_batch, to_paged)
    for tensors, options, message in cases:
        args = {"q": b.q, "k": b.k, "v": b.v, **tensors}
        kwargs = {"variant": "bf16", "causal": True, **b.varlen, **options}
        if kwargs.get("means") == "wrong":
            kwargs["means"] = SmoothingMeans(torch.zeros(1, 4, 64), torch.zeros(1, 4, 64))
        with pytest.raises(ValueError, match=message):
            attention(args["q"], args["k"], args["v"], **kwargs)
