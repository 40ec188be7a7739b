"""The numerics an MpFA server can serve, chosen by ``MPFA_NUMERICS`` and read here only (`served_numerics`).

* ``paper`` (the default): the paper's numerics, what the kernels' ``numerics`` in `mpfa.kernels.sm90.dispatch` name.
* ``had128-k46``: Q and K rotated per head by the 128-channel block Hadamard before the KV write
  (`rotation.GemmRotation`: the BF16 activations in FP32, kept in FP32 for the write), and K's NVFP4 block scales
  chosen "4/6" at cache write (`formats.quantize_nvfp4`). The rotation is orthonormal and commutes with centering, so
  Q K^T and Delta_S are unchanged in exact arithmetic; V and the output are untouched, and no attention kernel
  changes: they read the rotated, centered codes the write kernel stores. The variant study's `mpfa-had128` and
  `mpfa-k46` combined, at the same bytes (docs/accuracy.md). Not yet measured on a GPU, so not the default.

Under an option a kernel whose numerics are the reference variant ``base`` computes `ServedNumerics.variant` of it
(``mpfa`` -> ``mpfa-had128-k46``), which `mpfa.kernels.reference` registers for every ``base`` a served kernel
computes. Host-side only: importing this module imports no PyTorch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

NUMERICS_ENV = "MPFA_NUMERICS"


@dataclass(frozen=True)
class ServedNumerics:
    """One ``MPFA_NUMERICS`` value: the Hadamard block Q and K are rotated by before the KV write (0: none) and K's
    NVFP4 block-scale choice (`formats.NVFP4_SCALE_CHOICES`)."""

    name: str
    description: str
    rotation: int = 0
    k_scale_choice: str = "6"

    def variant(self, base: str) -> str:
        """The reference variant a kernel computing ``base`` computes under these numerics."""
        return base if self.name == PAPER.name else f"{base}-{self.name}"


PAPER = ServedNumerics("paper", "the paper's numerics")
SERVED_NUMERICS: dict[str, ServedNumerics] = {
    n.name: n
    for n in (
        PAPER,
        ServedNumerics("had128-k46", "Q and K rotated by the 128-channel block Hadamard, K block scales 4/6",
                       rotation=128, k_scale_choice="4/6"),
    )
}


def served_numerics(environ: Mapping[str, str] | None = None) -> ServedNumerics:
    """The numerics ``MPFA_NUMERICS`` names in ``environ`` (the process's environment when None); unset or empty:
    ``paper``. Any other value is a ValueError naming the choices."""
    value = (os.environ if environ is None else environ).get(NUMERICS_ENV) or PAPER.name
    if value not in SERVED_NUMERICS:
        raise ValueError(f"{NUMERICS_ENV}={value!r}: choose one of {', '.join(SERVED_NUMERICS)}")
    return SERVED_NUMERICS[value]
