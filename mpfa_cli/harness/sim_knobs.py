"""The simulator's CI-rehearsal knobs: a slowdown and a seeded noise on every modelled step time.

The latency model is deterministic, so repeats on the simulator agree exactly and nothing a user can pass slows
it: a regression gate could never be seen failing. `--sim-slowdown 1.2` multiplies every step time by 1.2 (a
20% slower backend); `--sim-noise 3%` multiplies each load phase's step times (a bench repeat: one `/sim_load`
hint; without hints, the server's whole life) by 1 + 0.03·z, z a standard normal drawn from `--sim-noise-seed`
and the backend's name, so repeats differ (their CIs are not zero) the same way on every invocation with that seed.
The knobs are reported in `/get_server_info` (stored with every run) and in the run's SIMULATED label.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NOISE_CLIP = 3.0  # a draw's |z| is at most this: a step never runs faster than 1 - 3·noise of its model
MAX_NOISE = 0.3  # so that the factor stays positive


def parse_fraction(text: str, flag: str) -> float:
    """`3%` or `0.03` -> 0.03; a ValueError names the flag."""
    body = text.strip()
    try:
        value = float(body[:-1]) / 100 if body.endswith("%") else float(body)
    except ValueError:
        raise ValueError(f"{flag}: expected a fraction such as 3% or 0.03, got '{text}'") from None
    if not 0 <= value <= MAX_NOISE:
        raise ValueError(f"{flag}: expected 0% to {MAX_NOISE:.0%}, got '{text}'")
    return value


@dataclass(frozen=True)
class SimKnobs:
    """A slowdown (>0, 1: as modelled) and the noise's relative standard deviation and seed."""

    slowdown: float = 1.0
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise ValueError(f"--sim-slowdown: expected a number > 0, got {self.slowdown}")
        if not 0 <= self.noise <= MAX_NOISE:
            raise ValueError(f"--sim-noise: expected 0% to {MAX_NOISE:.0%}, got {self.noise}")

    @property
    def active(self) -> bool:
        return self.slowdown != 1.0 or self.noise > 0

    def server_info(self) -> dict[str, Any]:
        """What `/get_server_info` reports of them (every run stores it)."""
        return {"sim_slowdown": self.slowdown, "sim_noise": self.noise, "sim_noise_seed": self.seed}

    def args(self) -> list[str]:
        """The `mpfa serve-sim` flags that set them (none when inactive)."""
        if not self.active:
            return []
        return ["--sim-slowdown", f"{self.slowdown:g}", "--sim-noise", f"{self.noise:g}",
                "--sim-noise-seed", str(self.seed)]

    def phases(self, backend: str) -> "StepFactors":
        return StepFactors(self, backend)


@dataclass
class StepFactors:
    """The factor every modelled step time is multiplied by; `next_phase` draws the next load phase's."""

    knobs: SimKnobs
    backend: str
    factor: float = 1.0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        key = hashlib.sha256(f"mpfa-sim-noise:{self.knobs.seed}:{self.backend}".encode()).digest()
        self._rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
        self.next_phase()

    def next_phase(self) -> None:
        z = float(np.clip(self._rng.standard_normal(), -NOISE_CLIP, NOISE_CLIP)) if self.knobs.noise else 0.0
        self.factor = self.knobs.slowdown * (1.0 + self.knobs.noise * z)


def knobs_label(info: dict[str, Any] | None) -> str:
    """'slowed 1.2x, noise 3% (seed 0)' from a server info's knobs; '' when the simulator ran as modelled."""
    info = info or {}
    slowdown, noise = float(info.get("sim_slowdown", 1.0)), float(info.get("sim_noise", 0.0))
    parts = [f"slowed {slowdown:g}x"] if slowdown != 1.0 else []
    if noise:
        parts.append(f"noise {noise * 100:g}% (seed {info.get('sim_noise_seed', 0)})")
    return ", ".join(parts)
