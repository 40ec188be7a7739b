"""The FlashAttention-3 baselines as SGLang's fa3 backend runs them: names, bytes and the prefill-only variant."""
from __future__ import annotations

import pytest

from mpfa.mpfa_cli.errors import ProfileError
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.kernels_fa3 import Fa3
from mpfa.profiles.registry import adapter_for


def test_registered_names_and_math():
    assert [adapter_for(n).name for n in ("fa3-bf16", "fa3-fp8", "fa3-fp8-contiguous")] == [
        "fa3-bf16", "fa3-fp8", "fa3-fp8-contiguous"]
    assert (adapter_for("fa3-bf16").math_dtype, adapter_for("fa3-fp8").math_dtype) == ("bf16", "fp8")
    assert Fa3(kv_fp8=True, page_size=128).name == "fa3-fp8-page128"


def test_fp8_cache_is_half_the_bf16_bytes_and_pages_round_up():
    w = AttentionWorkload("decode", seq=1000, batch=2, q_heads=32, kv_heads=8, head_dim=128)
    kv_bf16 = Fa3(kv_fp8=False).set_bytes(w) - w.q_elements() * 4
    kv_fp8 = Fa3(kv_fp8=True).set_bytes(w) - w.q_elements() * 3
    assert kv_bf16 == 2 * 2 * 2000 * 8 * 128 and kv_fp8 * 2 == kv_bf16
    paged = Fa3(kv_fp8=True, page_size=128).set_bytes(w) - w.q_elements() * 3
    assert paged == 2 * 2 * 1024 * 8 * 128  # 1000 tokens take 8 whole pages per sequence


def test_contiguous_variant_refuses_decode_before_touching_the_gpu():
    w = AttentionWorkload("decode", seq=4096, batch=1, q_heads=32, kv_heads=8, head_dim=128)
    with pytest.raises(ProfileError, match="prefill baseline"):
        Fa3(kv_fp8=True, contiguous=True).prepare(w, 1, None, 0)
