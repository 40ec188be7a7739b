"""Which kernels each backend's server runs, as runs record them: `kernels/sm90/dispatch.py`'s choice for MpFA's
servers (with the override), the SGLang attention backend for the others, and one line to show."""
from __future__ import annotations

import pytest

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.served_kernels import (check_prefill_kernel, describe_kernels, kernel_server_args,
                                                  launch_page_size, served_kernels)


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPFA_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("MPFA_PREFILL", raising=False)
    monkeypatch.delenv("MPFA_NUMERICS", raising=False)


def test_mpfa_runs_the_dispatched_prefill_kernel_and_the_split_kv_decode():
    for name in ("mpfa", "mpfa-direct"):
        assert served_kernels(BACKENDS[name], 32, 8, 128) == {"prefill": "fp8", "decode": "split-kv",
                                                              "numerics": "paper", "source": "dispatch"}
    assert served_kernels(BACKENDS["mpfa"], 64, 8, 128)["prefill"] == "fp8"  # GQA 8, the wgmma kernels' largest group
    assert served_kernels(BACKENDS["mpfa"], 5, 1, 128)["prefill"] == "mma-sync"  # odd head count: no wgmma kernel
    assert served_kernels(BACKENDS["mpfa"], 40, 8, 16)["prefill"] == "mma-sync"  # pages of 16 keys


def test_the_override_is_recorded_with_the_kernel_it_chose(monkeypatch: pytest.MonkeyPatch):
    mpfa = BACKENDS["mpfa"]
    assert served_kernels(mpfa, 32, 8, 128, "exact", source="simulated") == {
        "prefill": "exact", "decode": "split-kv", "numerics": "paper", "prefill_override": "exact",
        "source": "simulated"}
    monkeypatch.setenv("MPFA_PREFILL_KERNEL", "mma-sync")  # inherited by the servers
    assert served_kernels(mpfa, 32, 8, 128)["prefill"] == "mma-sync"
    assert served_kernels(mpfa, 32, 8, 128, "fp8")["prefill"] == "fp8"  # the server argument wins
    assert served_kernels(mpfa, 64, 8, 128, "exact")["prefill"] == "exact"  # GQA 8 by name
    with pytest.raises(UserError, match="mpfa: the fp8 prefill kernel needs a GQA group of 1 to 8"):
        served_kernels(mpfa, 72, 8, 128, "fp8")


def test_the_reference_prefill_path_runs_no_prefill_kernel(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MPFA_PREFILL", "reference")
    assert served_kernels(BACKENDS["mpfa"], 32, 8, 128)["prefill"] == "pytorch-reference"


def test_the_numerics_the_servers_inherit_are_recorded_and_checked(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MPFA_NUMERICS", "had128-k46")
    for name in ("mpfa", "mpfa-direct"):
        assert served_kernels(BACKENDS[name], 32, 8, 128)["numerics"] == "had128-k46"
    assert "numerics" not in served_kernels(BACKENDS["fa3-fp8"], 32, 8, 128)  # MpFA's option only
    monkeypatch.setenv("MPFA_NUMERICS", "fp4-all-the-way")
    with pytest.raises(UserError, match="^mpfa: MPFA_NUMERICS='fp4-all-the-way': choose one of paper, had128-k46$"):
        served_kernels(BACKENDS["mpfa"], 32, 8, 128)


def test_other_backends_name_their_sglang_attention_backend():
    assert served_kernels(BACKENDS["fa4-bf16"], 32, 8, 128) == {"attention_backend": "fa4", "source": "dispatch"}
    assert served_kernels(BACKENDS["flashinfer-fp8"], 32, 8, 1, "exact")["attention_backend"] == "flashinfer"


def test_only_mpfa_servers_get_the_prefill_kernel_flag():
    assert kernel_server_args(BACKENDS["mpfa"], "exact") == ["--mpfa-prefill-kernel", "exact"]
    assert kernel_server_args(BACKENDS["fa4-bf16"], "exact") == []
    assert kernel_server_args(BACKENDS["mpfa"], None) == []


def test_the_user_s_prefill_kernel_is_checked():
    assert check_prefill_kernel(None) is None
    assert check_prefill_kernel(" Exact ") == "exact"
    with pytest.raises(UserError, match="--prefill-kernel: .*fp8, exact, mma-sync"):
        check_prefill_kernel("fastest")


def test_launch_page_size_is_the_flag_or_sglang_s_default():
    assert launch_page_size(BACKENDS["mpfa"]) == 128
    assert launch_page_size(BACKENDS["flashinfer-fp8"]) == 1


def test_one_line_per_record():
    assert describe_kernels({"prefill": "fp8", "decode": "split-kv", "source": "dispatch"}) == \
        "prefill fp8, decode split-kv"
    overridden = {"prefill": "exact", "decode": "split-kv", "prefill_override": "exact", "source": "simulated"}
    assert describe_kernels(overridden) == "prefill exact (override), decode split-kv (simulated: no kernel ran)"
    assert describe_kernels({"prefill": "fp8", "decode": "split-kv", "numerics": "paper", "source": "dispatch"}) == \
        "prefill fp8, decode split-kv"
    assert describe_kernels({"prefill": "fp8", "decode": "split-kv", "numerics": "had128-k46",
                             "source": "dispatch"}) == "prefill fp8, decode split-kv, numerics had128-k46"
    assert describe_kernels({"attention_backend": "fa4", "source": "dispatch"}) == "SGLang attention backend fa4"
    assert describe_kernels({}) == "not recorded"
