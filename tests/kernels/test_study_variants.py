"""The candidate numerics of the variant study (issue 45): FP8 Q, Hadamard-rotated Q/K, 4/6 K scales, FP8 K."""

from __future__ import annotations

import torch

from mpfa.kernels import attention, attention_float64, fake_quant_fp8_pow2, fake_quant_nvfp4
from mpfa.kernels.reference import prepare_one_sequence
from mpfa.kernels.rotation import block_hadamard


def _centered(x: torch.Tensor) -> torch.Tensor:
    x = x.bfloat16().float()
    return x - x.double().mean(0).float()


def _error(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    ref = attention_float64(q, k, v, causal=True)
    return float((attention(q, k, v, variant=variant, causal=True).double() - ref).norm() / ref.norm())


def test_fp8_q_and_fp8_k_come_straight_from_the_centered_bf16_values(make_batch) -> None:
    b = make_batch([70], [70], 4, 2, 64, q_offset=2.0, k_offset=5.0)
    mpfa = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa")
    q8 = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa-q8")
    k8 = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa-k8")
    assert torch.equal(q8.q, fake_quant_fp8_pow2(_centered(b.q))) and torch.equal(q8.k, mpfa.k)
    assert torch.equal(k8.k, fake_quant_fp8_pow2(_centered(b.k))) and torch.equal(k8.q, mpfa.q)
    for ops in (q8, k8):
        assert torch.equal(ops.v, mpfa.v) and torch.equal(ops.delta_s, mpfa.delta_s)


def test_rotated_variants_rotate_centered_q_and_k_and_keep_delta_s(make_batch) -> None:
    b = make_batch([50], [50], 4, 2, 64, q_offset=2.0, k_offset=5.0)
    mpfa = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa")
    for variant, block in (("mpfa-had16", 16), ("mpfa-had128", 64)):  # 128 on head_dim 64: the whole head
        ops = prepare_one_sequence(b.q, b.k, b.v, variant=variant)
        assert torch.equal(ops.q, fake_quant_nvfp4(block_hadamard(_centered(b.q), block))), variant
        assert torch.equal(ops.k, fake_quant_nvfp4(block_hadamard(_centered(b.k), block))), variant
        assert torch.equal(ops.delta_s, mpfa.delta_s) and torch.equal(ops.v, mpfa.v), variant
    k46 = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa-k46")
    assert torch.equal(k46.k, fake_quant_nvfp4(_centered(b.k), scale_choice="4/6")) and torch.equal(k46.q, mpfa.q)


def test_fp8_q_errs_less_than_nvfp4_q(make_batch) -> None:
    b = make_batch([200], [200], 8, 2, 128, q_offset=2.0, k_offset=5.0)
    errors = {name: _error(name, b.q, b.k, b.v) for name in ("mpfa", "mpfa-q8", "mpfa-q8-k8", "bf16")}
    assert errors["bf16"] < errors["mpfa-q8-k8"] < errors["mpfa-q8"] < errors["mpfa"], errors
