"""What `collect_environment` records: the MpFA kernel switches set in the environment, under the names the kernels
and the plugin read."""

from __future__ import annotations

import pytest

from mpfa.cli.environment import KERNEL_SWITCHES, collect_environment


def test_kernel_switches_are_recorded(monkeypatch: pytest.MonkeyPatch):
    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert collect_environment()["kernel_switches"] == {}
    monkeypatch.setenv("MPFA_PREFILL_KERNEL", "v2")
    monkeypatch.setenv("MPFA_DB", "results.db")  # not a kernel switch
    assert collect_environment()["kernel_switches"] == {"MPFA_PREFILL_KERNEL": "v2"}


def test_switch_names_are_the_ones_read():
    pytest.importorskip("torch")
    from mpfa.backends.sglang_plugin.attention import PREFILL_ENV
    from mpfa.kernels.sm90 import decode_launch, prefill_launch

    assert set(KERNEL_SWITCHES) == {PREFILL_ENV, prefill_launch.KERNEL_ENV, decode_launch.KERNEL_ENV}
