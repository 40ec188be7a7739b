"""The attention backends this plugin adds to SGLang and the numerics each one computes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendVariant:
    """One SGLang ``--attention-backend`` name: its numerics (a `mpfa.kernels.reference.VARIANTS` name) and whether
    it centers Q/K with frozen per-request means (and so stores means and a meaningful Delta_S)."""

    backend: str
    numerics: str
    smoothing: bool


VARIANTS: dict[str, BackendVariant] = {
    v.backend: v
    for v in (
        BackendVariant("mpfa", "mpfa", smoothing=True),
        BackendVariant("mpfa-direct", "qk4-pv8-direct", smoothing=False),
    )
}
BACKEND_NAMES: tuple[str, ...] = tuple(VARIANTS)


def is_mpfa_backend(name: str | None) -> bool:
    return name in VARIANTS


def variant_of(name: str) -> BackendVariant:
    if name not in VARIANTS:
        raise ValueError(f"{name!r} is not an MpFA attention backend ({', '.join(BACKEND_NAMES)})")
    return VARIANTS[name]
