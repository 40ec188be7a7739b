"""FLOP and byte counting, and parsing of the workload arguments."""
import itertools

import pytest

from mpfa.backends.specs import kernel_benches
from mpfa.profiles.attention_workload import BF16, BF16_Q_FP8_KV, MPFA, AttentionWorkload, parse_heads, parse_seq
from mpfa.profiles.registry import adapter_for, parse_backends


def _kept_pairs_by_mask(q_len: int, kv_len: int) -> int:
    """Count (query, key) pairs a bottom-right-aligned causal mask keeps, one by one."""
    return sum(key <= query + kv_len - q_len for query, key in itertools.product(range(q_len), range(kv_len)))


@pytest.mark.parametrize("seq", [1, 2, 7, 64, 129])
def test_causal_prefill_pairs_match_the_mask(seq):
    assert AttentionWorkload("prefill", seq, 1, 1, 1, 16).pairs_per_head == _kept_pairs_by_mask(seq, seq)


@pytest.mark.parametrize("seq", [1, 5, 300])
def test_decode_pairs_match_the_mask(seq):
    assert AttentionWorkload("decode", seq, 1, 1, 1, 16).pairs_per_head == _kept_pairs_by_mask(1, seq)


def test_flops_hand_computed():
    # prefill S=4: 4*5/2 = 10 pairs; 4 FLOPs per pair and dim (QK^T and PV multiply-adds) per query head.
    assert AttentionWorkload("prefill", 4, 2, 4, 2, 16).flops() == 4 * 2 * 4 * 16 * 10 == 5120
    assert AttentionWorkload("decode", 100, 3, 8, 2, 64).flops() == 4 * 3 * 8 * 64 * 100 == 614_400
    # 16k causal prefill, 32 heads, d=128: 2 * 32 * 128 * 16384 * 16385 = 2.199 TFLOP.
    assert AttentionWorkload("prefill", 16384, 1, 32, 8, 128).flops() == 2_199_157_473_280


def test_bytes_hand_computed():
    prefill = AttentionWorkload("prefill", 4, 2, 4, 2, 16)
    # Q and O: 2*4*4*16 = 512 elements each; K and V: 2*4*2*16 = 256 elements each.
    assert prefill.bytes_needed(BF16) == 512 * 2 * 2 + 256 * 2 * 2 == 3072
    assert prefill.bytes_needed(BF16_Q_FP8_KV) == 512 * 2 * 2 + 256 * 1 * 2 == 2560
    decode = AttentionWorkload("decode", 1000, 8, 32, 8, 128)
    q_and_o = 8 * 32 * 128 * 2 * 2
    assert decode.bytes_needed(BF16_Q_FP8_KV) == q_and_o + 8 * 1000 * 8 * 128 * 2
    # MpFA per token and KV head, d=128, group 4: NVFP4 K 64 B + 8 scale bytes, FP8 V 128 B, Delta_S 4 x 2 B.
    assert decode.bytes_needed(MPFA) == q_and_o + 8 * 1000 * 8 * (64 + 8 + 128 + 8)
    # Group 5: Delta_S rows of 8 BF16 entries (the cache's padded layout, what decode reads).
    group5 = AttentionWorkload("decode", 1000, 8, 40, 8, 128)
    assert group5.bytes_needed(MPFA) == 8 * 40 * 128 * 2 * 2 + 8 * 1000 * 8 * (64 + 8 + 128 + 16)


def test_every_adapter_set_holds_at_least_what_it_needs():
    for kind in ("prefill", "decode"):
        workload = AttentionWorkload(kind, 1000, 3, 32, 8, 128)  # 1000 is not a multiple of FA4's page 128
        for adapter in map(adapter_for, kernel_benches()):
            assert adapter.set_bytes(workload) >= workload.bytes_needed(adapter.tensor_format)
    fa4 = adapter_for("fa4-bf16")
    decode = AttentionWorkload("decode", 1000, 3, 32, 8, 128)
    # 1000 tokens occupy 8 pages of 128 = 1024 slots per sequence.
    assert fa4.set_bytes(decode) == 2 * (2 * 3 * 32 * 128 + 2 * 3 * 1024 * 8 * 128)


@pytest.mark.parametrize("text,tokens", [("16384", 16384), ("64k", 65536), ("64K", 65536), ("1m", 1 << 20)])
def test_parse_seq(text, tokens):
    assert parse_seq(text) == tokens


@pytest.mark.parametrize("text", ["", "0", "-5", "12g", "1.5k", "k"])
def test_parse_seq_rejects(text):
    with pytest.raises(ValueError, match="sequence length"):
        parse_seq(text)


def test_parse_heads():
    assert parse_heads("32:8") == (32, 8)
    assert parse_heads("16") == (16, 16)
    with pytest.raises(ValueError, match="QUERY:KV"):
        parse_heads("32/8")


@pytest.mark.parametrize("fields,message", [
    (("train", 10, 1, 8, 8, 128), "unknown profile kind"),
    (("prefill", 0, 1, 8, 8, 128), "seq must be positive"),
    (("decode", 10, 0, 8, 8, 128), "batch must be positive"),
    (("decode", 10, 1, 12, 8, 128), "multiple of KV heads"),
    (("decode", 10, 1, 8, 8, 100), "multiple of 16"),
])
def test_workload_rejects_bad_input(fields, message):
    with pytest.raises(ValueError, match=message):
        AttentionWorkload(*fields)


def test_parse_backends():
    assert parse_backends(" fa4-bf16, mpfa,fa4-bf16 ") == ["fa4-bf16", "mpfa"]
    with pytest.raises(ValueError, match="unknown backend 'fa3'"):
        parse_backends("fa4-bf16,fa3")
    with pytest.raises(ValueError, match="no backend"):
        parse_backends(" , ")
