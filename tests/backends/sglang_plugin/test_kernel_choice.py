"""The plugin's kernel choice without SGLang: ``--mpfa-prefill-kernel`` parses into ``MPFA_PREFILL_KERNEL`` for the
server's processes (through the ``ServerArgs.add_cli_args`` hook), a kernel the model does not take stops the
launcher with one line, and the backend logs the kernels `dispatch` chooses once per shape."""

from __future__ import annotations

import argparse
import logging
import os
from types import SimpleNamespace

import pytest

from mpfa.backends.sglang_plugin import hooks, kernel_choice
from mpfa.backends.sglang_plugin.setup_checks import MpfaSetupError
from mpfa.kernels.sm90.dispatch import PREFILL_KERNEL_ENV


def _parser() -> argparse.ArgumentParser:
    """A parser as SGLang builds it, through the plugin's hook on ``ServerArgs.add_cli_args``."""
    parser = argparse.ArgumentParser(prog="sglang serve")
    parser.add_argument("--attention-backend")
    hook, kind = hooks.hook_table()["sglang.srt.server_args.ServerArgs.add_cli_args"]
    assert kind == "AFTER" and hook(None, parser) is None
    return parser


@pytest.mark.parametrize("kernel", ["fp8", "exact", "mma-sync"])
def test_the_argument_sets_the_kernel_for_the_server_processes(monkeypatch, kernel):
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "fp8" if kernel != "fp8" else "exact")  # the argument wins
    args = _parser().parse_args(["--attention-backend", "mpfa", "--mpfa-prefill-kernel", kernel.upper()])
    assert args.mpfa_prefill_kernel == kernel  # checked as `dispatch` checks every spelling: case-insensitive
    assert os.environ[PREFILL_KERNEL_ENV] == kernel


def test_without_the_argument_the_environment_stays(monkeypatch):
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "exact")
    assert _parser().parse_args(["--attention-backend", "mpfa"]).mpfa_prefill_kernel is None
    assert os.environ[PREFILL_KERNEL_ENV] == "exact"


def test_an_unknown_kernel_is_refused_by_the_parser(monkeypatch, capsys):
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mpfa-prefill-kernel", "fast"])
    assert "argument --mpfa-prefill-kernel: kernel must be one of fp8, exact, mma-sync, got 'fast'" in \
        capsys.readouterr().err
    assert PREFILL_KERNEL_ENV not in os.environ


class _Config:
    head_dim = v_head_dim = 128
    dtype = "torch.bfloat16"

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.heads, self.kv_heads = heads, kv_heads

    def get_num_attention_heads(self, tp: int) -> int:
        return self.heads // tp

    def get_num_kv_heads(self, tp: int) -> int:
        return max(1, self.kv_heads // tp)


def _launch(heads: int, kv_heads: int, page_size: int | None) -> None:
    graphs = SimpleNamespace(prefill=SimpleNamespace(backend="disabled"))
    args = SimpleNamespace(attention_backend="mpfa", kv_cache_dtype="auto", page_size=page_size, tp_size=1,
                           disable_radix_cache=True, cuda_graph_config=graphs,
                           get_model_config=lambda: _Config(heads, kv_heads))
    hooks.after_attention_backend_compat(None, args)


def test_the_launcher_refuses_a_kernel_the_model_does_not_take(monkeypatch):
    monkeypatch.setattr(hooks, "check_device", lambda capability: None)
    monkeypatch.setattr(hooks, "check_kernel_packages", lambda: None)
    monkeypatch.delenv("MPFA_PREFILL", raising=False)
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    _launch(48, 8, 128)  # GQA 6: mma-sync by default
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "exact")
    _launch(40, 8, 64)
    _launch(48, 8, 128)  # GQA 6 by name: taken (its GPU tests pending)
    with pytest.raises(MpfaSetupError) as info:
        _launch(40, 8, 32)  # pages of 32 keys
    assert "\n" not in str(info.value) and "the exact prefill kernel needs a GQA group of 1 to 8" in str(info.value)
    with pytest.raises(MpfaSetupError, match="pages of 1: use mma-sync"):
        _launch(32, 8, None)  # SGLang's default page of 1 key
    monkeypatch.setenv("MPFA_PREFILL", "reference")  # the reference path runs no prefill kernel
    _launch(40, 8, 32)


def test_the_launcher_refuses_unknown_numerics_in_one_line(monkeypatch):
    monkeypatch.setattr(hooks, "check_device", lambda capability: None)
    monkeypatch.setattr(hooks, "check_kernel_packages", lambda: None)
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    monkeypatch.setenv("MPFA_NUMERICS", "had128-k46")
    _launch(32, 8, 128)
    monkeypatch.setenv("MPFA_NUMERICS", "had128")
    with pytest.raises(MpfaSetupError) as info:
        _launch(32, 8, 128)
    assert str(info.value) == "MpFA attention backend: MPFA_NUMERICS='had128': choose one of paper, had128-k46"


def test_the_backend_logs_its_kernels_once_per_shape(monkeypatch, caplog):
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    kernel_choice.log_kernels.cache_clear()
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        for _ in range(2):
            kernel_choice.log_kernels("mpfa", 32, 8, 128, "kernel", "paper")
        kernel_choice.log_kernels("mpfa", 48, 8, 128, "kernel", "had128-k46")
        kernel_choice.log_kernels("mpfa-direct", 32, 8, 128, "reference", "paper")
    assert [r.getMessage() for r in caplog.records] == [
        "MpFA backend mpfa, 32:8 heads, pages of 128: decode = sm90 split-kv, prefill = sm90 fp8, numerics = paper",
        "MpFA backend mpfa, 48:8 heads, pages of 128: decode = sm90 split-kv, prefill = sm90 fp8, "
        "numerics = had128-k46",
        "MpFA backend mpfa-direct, 32:8 heads, pages of 128: decode = sm90 split-kv, prefill = SLOW REFERENCE PATH "
        "($MPFA_PREFILL=reference; its timings are not MpFA's), numerics = paper",
    ]
    kernel_choice.log_kernels.cache_clear()
