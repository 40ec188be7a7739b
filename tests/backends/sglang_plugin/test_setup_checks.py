"""Startup validation: one-line errors for unsupported setups, and the two settings the backend changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpfa.backends.sglang_plugin.setup_checks import (MpfaSetupError, check_device, check_kernel_packages, check_model,
                                                      check_server_args, missing_kernel_modules)


def _args(**overrides):
    graphs = SimpleNamespace(prefill=SimpleNamespace(backend="breakable"), decode=SimpleNamespace(backend="full"))
    base = dict(attention_backend="mpfa", prefill_attention_backend=None, decode_attention_backend=None,
                kv_cache_dtype="auto", page_size=128, speculative_algorithm=None, enable_hierarchical_cache=False,
                disaggregation_mode="null", enable_dp_attention=False, disable_radix_cache=False,
                cuda_graph_config=graphs)
    return SimpleNamespace(**{**base, **overrides})


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message and message.startswith("MpFA attention backend: ")
    return message


def test_server_args_changes_for_mpfa():
    args = _args()
    changes = check_server_args(args)
    assert args.disable_radix_cache is False  # a cached prefix carries its writer's means (kv_store)
    assert args.cuda_graph_config.prefill.backend == "disabled"
    assert args.cuda_graph_config.decode.backend == "full"  # decode stays captured
    assert len(changes) == 1 and "runs eagerly" in changes[0]
    assert check_server_args(args) == []  # idempotent


def test_other_backends_are_untouched():
    args = _args(attention_backend="fa4", kv_cache_dtype="fp8_e4m3")
    assert check_server_args(args) == []
    assert args.disable_radix_cache is False and args.cuda_graph_config.prefill.backend == "breakable"


@pytest.mark.parametrize("overrides,pattern", [
    (dict(kv_cache_dtype="fp8_e4m3"), "--kv-cache-dtype fp8_e4m3"),
    (dict(page_size=96), "power of two"),
    (dict(speculative_algorithm="EAGLE"), "speculative decoding"),
    (dict(decode_attention_backend="fa4"), "--decode-attention-backend fa4"),
    (dict(attention_backend="mpfa-direct", prefill_attention_backend="triton"), "--prefill-attention-backend"),
    (dict(enable_dp_attention=True), "DP attention"),
    (dict(disaggregation_mode="prefill"), "disaggregation"),
])
def test_unsupported_server_args_fail_with_one_line(overrides, pattern):
    with pytest.raises(MpfaSetupError) as info:
        check_server_args(_args(**overrides))
    assert pattern in _one_line(info)


def test_model_checks():
    check_model(128, 128, 32, 8, "torch.bfloat16")
    for args, pattern in [((64, 64, 32, 8, "torch.bfloat16"), "head_dim must be 128"),
                          ((128, 128, 30, 8, "torch.bfloat16"), "multiple of KV heads"),
                          ((128, 128, 64, 4, "torch.bfloat16"), "at most 8 query heads"),
                          ((128, 128, 32, 8, "torch.float16"), "bfloat16")]:
        with pytest.raises(MpfaSetupError) as info:
            check_model(*args)
        assert pattern in _one_line(info)


def test_device_checks():
    check_device((9, 0))
    for capability, pattern in [(None, "needs a CUDA GPU"), ((10, 0), "sm_100"), ((8, 0), "sm_80")]:
        with pytest.raises(MpfaSetupError) as info:
            check_device(capability)
        assert pattern in _one_line(info)


def test_kernel_package_check():
    assert missing_kernel_modules(lambda name: object()) == []
    assert missing_kernel_modules(lambda name: None if name == "cutlass" else object()) == ["nvidia-cutlass-dsl"]
    with pytest.raises(MpfaSetupError) as info:
        check_kernel_packages(lambda name: None)
    assert "pip install -e '.[kernels]'" in _one_line(info)
