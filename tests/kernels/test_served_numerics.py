"""The numerics a server can serve (`served_numerics`, ``MPFA_NUMERICS``) and the reference variants they make of
each served kernel's numerics: ``<base>-had128-k46`` rotates the BF16 Q and K inputs in FP32 before centering, as
the SGLang plugin does before its KV write, and writes K's 4/6 block scales."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import fake_quant_nvfp4
from mpfa.kernels.reference import SERVED_BASES, VARIANTS, prepare_one_sequence
from mpfa.kernels.rotation import GemmRotation
from mpfa.kernels.served_numerics import NUMERICS_ENV, PAPER, SERVED_NUMERICS, served_numerics
from mpfa.kernels.sm90.dispatch import DECODE_KERNEL, PREFILL_KERNELS
from mpfa.kernels.smoothing import delta_s

HAD128_K46 = SERVED_NUMERICS["had128-k46"]


def test_paper_is_the_default_and_other_values_are_refused() -> None:
    assert served_numerics({}) is PAPER and served_numerics({NUMERICS_ENV: ""}) is PAPER
    assert served_numerics({NUMERICS_ENV: "had128-k46"}) is HAD128_K46
    with pytest.raises(ValueError, match="^MPFA_NUMERICS='k46': choose one of paper, had128-k46$"):
        served_numerics({NUMERICS_ENV: "k46"})


def test_every_served_kernel_has_a_variant_under_every_option() -> None:
    assert {k.numerics for k in [*PREFILL_KERNELS.values(), DECODE_KERNEL]} <= set(SERVED_BASES)
    for base in SERVED_BASES:
        assert PAPER.variant(base) == base
        spec, served = VARIANTS[base], VARIANTS[HAD128_K46.variant(base)]
        assert (served.rotation, served.rotate_inputs, served.k_scale_choice) == (128, True, "4/6")
        assert (served.q, served.k, served.p, served.v, served.smoothing, served.l_sums_p_operand) == (
            spec.q, spec.k, spec.p, spec.v, spec.smoothing, spec.l_sums_p_operand)


def _centered(x: torch.Tensor) -> torch.Tensor:
    """x [L, H, d] minus its per-head mean over the tokens (the reference's: float64 sums, FP32)."""
    return x - x.double().mean(0).float()


def test_served_variant_rotates_the_bf16_inputs_before_centering(make_batch) -> None:
    """Operands of ``mpfa-had128-k46``: the BF16 Q and K rotated by `GemmRotation` (FP32, not rounded back),
    centered with their own means, NVFP4 (K with 4/6 scales); V as ``mpfa``'s; Delta_S from the rotated means and
    keys, which is ``mpfa``'s up to FP32 rounding (the rotation is orthonormal)."""
    b = make_batch([60], [60], 4, 2, 128, q_offset=2.0, k_offset=6.0)
    rotate = GemmRotation(128)
    q, k = rotate(b.q), rotate(b.k)
    ops = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa-had128-k46")
    mpfa = prepare_one_sequence(b.q, b.k, b.v, variant="mpfa")
    assert torch.equal(ops.q, fake_quant_nvfp4(_centered(q)))
    assert torch.equal(ops.k, fake_quant_nvfp4(_centered(k), scale_choice="4/6"))
    assert torch.equal(ops.v, mpfa.v)
    cu = torch.tensor([0, 60])
    assert torch.equal(ops.delta_s, delta_s(q.double().mean(0, keepdim=True).float(), _centered(k), cu).float())
    torch.testing.assert_close(ops.delta_s, mpfa.delta_s, rtol=2.0**-7, atol=1e-3)
