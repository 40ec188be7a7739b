"""The simulator's CI-rehearsal knobs: a slowdown scales every step, the noise varies each load phase, reproducibly
for a seed, and the SIMULATED label names them."""
from __future__ import annotations

import pytest

from mpfa.mpfa_cli.harness.sim_knobs import SimKnobs, knobs_label, parse_fraction


def _factors(knobs: SimKnobs, backend: str = "fa4-bf16", phases: int = 6) -> list[float]:
    steps = knobs.phases(backend)
    out = []
    for _ in range(phases):
        steps.next_phase()
        out.append(steps.factor)
    return out


def test_noise_varies_each_phase_the_same_way_for_a_seed() -> None:
    noisy = _factors(SimKnobs(noise=0.03, seed=7))
    assert len(set(noisy)) == len(noisy) and all(0.9 < f < 1.1 for f in noisy)
    assert noisy == _factors(SimKnobs(noise=0.03, seed=7))
    assert noisy != _factors(SimKnobs(noise=0.03, seed=8))
    assert noisy != _factors(SimKnobs(noise=0.03, seed=7), backend="mpfa")


def test_slowdown_scales_every_phase_and_no_knob_changes_nothing() -> None:
    assert _factors(SimKnobs(slowdown=1.2)) == [1.2] * 6
    assert _factors(SimKnobs()) == [1.0] * 6 and not SimKnobs().active and SimKnobs().args() == []


def test_label_and_parsing() -> None:
    knobs = SimKnobs(slowdown=1.2, noise=0.03, seed=4)
    assert knobs_label(knobs.server_info()) == "slowed 1.2x, noise 3% (seed 4)"
    assert knobs_label({}) == "" and knobs_label(None) == ""
    assert parse_fraction("3%", "--sim-noise") == pytest.approx(0.03) == parse_fraction("0.03", "--sim-noise")
    for bad in ("x", "-1%", "50%"):
        with pytest.raises(ValueError, match="--sim-noise"):
            parse_fraction(bad, "--sim-noise")
    with pytest.raises(ValueError, match="--sim-slowdown"):
        SimKnobs(slowdown=0)
