"""FlashInfer 0.6.12's FP8 tensor-core baselines on sm_90a (XQA decode, the fa3 template's FP8 prefill, FMHAv2 FP8
prefill): names, bytes, the page-table bytes the decode table counts, and the calls they make, checked on the CPU
against a stand-in `flashinfer` module that records each call (the kernels themselves need a Hopper GPU)."""
from __future__ import annotations

import logging
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from mpfa.mpfa_cli.errors import ProfileError
from mpfa.profiles.attention_workload import BF16_Q_FP8_KV, FP8_Q_FP8_KV, AttentionWorkload
from mpfa.profiles.bench_kernels import bytes_read
from mpfa.profiles.kernels_flashinfer import FMHA_V2_STALE_WARNING
from mpfa.profiles.registry import adapter_for

CPU = torch.device("cpu")
NEW = ("flashinfer-fp8-xqa", "flashinfer-fp8-fa3", "flashinfer-fp8-fmha-v2")


def test_registered_with_fp8_math_and_their_page_sizes():
    adapters = [adapter_for(name) for name in NEW]
    assert [a.name for a in adapters] == list(NEW)
    assert {a.math_dtype for a in adapters} == {"fp8"}
    assert [a.tensor_format for a in adapters] == [BF16_Q_FP8_KV, FP8_Q_FP8_KV, FP8_Q_FP8_KV]
    assert [a.page_size for a in adapters] == [64, 1, 64]
    assert adapter_for("flashinfer-fp8").page_size == 1


def test_set_bytes_count_whole_fp8_pages_and_the_query_width():
    w = AttentionWorkload("decode", seq=1000, batch=2, q_heads=32, kv_heads=8, head_dim=128)
    xqa = adapter_for("flashinfer-fp8-xqa").set_bytes(w)
    assert xqa == w.q_elements() * 4 + 2 * 2 * 1024 * 8 * 128  # 1000 tokens take 16 pages of 64 per sequence
    p = AttentionWorkload("prefill", seq=1000, batch=2, q_heads=32, kv_heads=8, head_dim=128)
    assert adapter_for("flashinfer-fp8-fa3").set_bytes(p) == p.q_elements() * 3 + 2 * 2000 * 8 * 128
    assert adapter_for("flashinfer-fp8-fmha-v2").set_bytes(p) == p.q_elements() * 3 + 2 * 2 * 1024 * 8 * 128


def test_decode_bytes_count_one_page_table_entry_per_page():
    w = AttentionWorkload("decode", 131072, 8, 32, 8, 128)
    tokens, qo = 8 * 131072, 8 * 2 * 32 * 128 * 2
    assert bytes_read("flashinfer-fp8-xqa", w, num_sms=132) == tokens * 8 * 256 + tokens // 64 * 4 + qo
    assert bytes_read("flashinfer-fp8", w, num_sms=132) == tokens * 8 * 256 + tokens * 4 + qo
    odd = AttentionWorkload("decode", 1000, 3, 32, 8, 128)  # a partial last page still takes a table entry
    assert bytes_read("flashinfer-fp8-xqa", odd, 132) - odd.bytes_needed(BF16_Q_FP8_KV) == 3 * 16 * 4
    assert bytes_read("fa4-bf16", odd, 132) - odd.bytes_needed(adapter_for("fa4-bf16").tensor_format) == 3 * 8 * 4


@pytest.mark.parametrize("name,kind", [("flashinfer-fp8-xqa", "prefill"), ("flashinfer-fp8-fa3", "decode"),
                                       ("flashinfer-fp8-fmha-v2", "decode")])
def test_each_refuses_the_phase_it_has_no_kernel_for_before_touching_the_gpu(name, kind):
    w = AttentionWorkload(kind, 4096, 1, 32, 8, 128)
    with pytest.raises(ProfileError, match="baseline"):
        adapter_for(name).prepare(w, 1, None, 0)


class FakeFlashInfer:
    """Records every call; each kernel returns its `out` untouched."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        fake = self

        class Wrapper:
            def __init__(self, *args, **kwargs) -> None:
                fake.calls.append(("wrapper", args, kwargs))

            def plan(self, *args, **kwargs) -> None:
                fake.calls.append(("plan", args, kwargs))

            def run(self, *args, **kwargs):
                fake.calls.append(("run", args, kwargs))
                return kwargs["out"]

        def record(name):
            def call(*args, **kwargs):
                fake.calls.append((name, args, kwargs))
                return kwargs["out"]
            return call

        self.module = SimpleNamespace(
            BatchPrefillWithPagedKVCacheWrapper=Wrapper,
            decode=SimpleNamespace(trtllm_batch_decode_with_kv_cache=record("xqa")),
            prefill=SimpleNamespace(trtllm_fmha_v2_prefill=record("fmha_v2")))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    return fake


def test_xqa_is_called_as_sglang_trtllm_mha_decode_on_hopper(fake_flashinfer):
    w = AttentionWorkload("decode", 100, 2, 8, 2, 64)  # 100 tokens: 2 pages of 64 per sequence
    prepared = adapter_for("flashinfer-fp8-xqa").prepare(w, 2, CPU, seed=3)
    out = prepared.run(1)
    (name, args, kw), = fake_flashinfer.calls
    assert name == "xqa" and not args and out.shape == (2, 8, 64) and out.dtype == torch.bfloat16
    q, k, v = kw["query"], *kw["kv_cache"]
    assert q.dtype == torch.bfloat16 and q.shape == (2, 8, 64)
    # HND-shaped views of NHD pages, as SGLang passes them (kv_layout left at its default "HND")
    assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == (4, 2, 64, 64) and not k.is_contiguous()
    assert "kv_layout" not in kw and kw["block_tables"].tolist() == [[0, 1], [2, 3]]
    assert kw["block_tables"].dtype == kw["seq_lens"].dtype == torch.int32 and kw["seq_lens"].tolist() == [100, 100]
    assert kw["bmm1_scale"] == pytest.approx(1 / math.sqrt(64)) and kw["bmm2_scale"] == 1.0
    assert kw["window_left"] == -1 and kw["out_dtype"] == torch.bfloat16
    assert kw["workspace_buffer"].dtype == torch.uint8 and not kw["workspace_buffer"].any()
    dq, dk, dv = prepared.dense_inputs(1)
    # the reference's Q is what XQA computes with: e4m3(Q), each value the nearest e4m3 to the BF16 one
    assert dq.dtype == torch.bfloat16 and torch.equal(dq, q.to(torch.float8_e4m3fn).to(torch.bfloat16))
    assert not torch.equal(dq, q) and torch.allclose(dq.float(), q.float(), rtol=2 ** -4, atol=2 ** -9)
    assert dk.shape == dv.shape == (200, 2, 64)
    # Token t of sequence b sits in page table[b][t // 64], slot t % 64
    assert torch.equal(dk[100 + 70].float(), k.permute(0, 2, 1, 3)[3, 6].float())
    assert not torch.equal(prepared.dense_inputs(0)[0], dq)


def test_fa3_fp8_prefill_plans_fp8_query_and_cache_with_bf16_output(fake_flashinfer):
    w = AttentionWorkload("prefill", 40, 2, 8, 2, 64)
    prepared = adapter_for("flashinfer-fp8-fa3").prepare(w, 2, CPU, seed=3)
    out = prepared.run(0)
    (_, wargs, wkw), (_, pargs, pkw), (_, (q, (k, v)), rkw) = fake_flashinfer.calls
    assert wargs[1] == "NHD" and wkw == {"backend": "fa3"}
    indptr, kv_indptr, indices, last = pargs[:4]
    assert indptr.tolist() == kv_indptr.tolist() == [0, 40, 80] and indices.tolist() == list(range(80))
    assert last.tolist() == [1, 1] and pargs[4:] == (8, 2, 64, 1)
    assert pkw == {"causal": True, "q_data_type": torch.float8_e4m3fn, "kv_data_type": torch.float8_e4m3fn,
                   "o_data_type": torch.bfloat16}
    assert q.dtype == k.dtype == torch.float8_e4m3fn and q.shape == (80, 8, 64) and k.shape == (80, 1, 2, 64)
    assert out is rkw["out"] and out.dtype == torch.bfloat16 and out.shape == (80, 8, 64)
    dq, dk, dv = prepared.dense_inputs(0)
    assert dq is q and torch.equal(dk.float(), k[:, 0].float()) and dv.shape == (80, 2, 64)


def test_fmha_v2_reads_interleaved_hnd_pages_through_the_page_table(fake_flashinfer):
    w = AttentionWorkload("prefill", 100, 2, 8, 2, 64)
    prepared = adapter_for("flashinfer-fp8-fmha-v2").prepare(w, 1, CPU, seed=3)
    out = prepared.run(0)
    (name, (qkv, layout, workspace), kw), = fake_flashinfer.calls
    q, kv = qkv
    assert name == "fmha_v2" and layout == "Q_PAGED_KV_HND" and not workspace.any()
    assert q.dtype == kv.dtype == torch.float8_e4m3fn and q.shape == (200, 8, 64)
    assert kv.shape == (4, 2, 2, 64, 64) and kv.is_contiguous()  # [page, K|V, kv head, token in page, dim]
    assert kw["block_tables"].tolist() == [[0, 1], [2, 3]] and kw["seq_lens"].tolist() == [100, 100]
    assert kw["cum_seq_lens_q"].tolist() == kw["cum_seq_lens_kv"].tolist() == [0, 100, 200]
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"], kw["mask_mode"]) == (100, 100, 2, "causal")
    assert kw["bmm1_scale"] == pytest.approx(1 / math.sqrt(64)) and kw["bmm2_scale"] == 1.0
    assert out is kw["out"] and out.dtype == torch.bfloat16 and out.shape == (200, 8, 64)
    _, dk, dv = prepared.dense_inputs(0)
    # Token 70 of sequence 1: page 3, slot 6; head 1
    assert torch.equal(dk[170, 1].float(), kv[3, 0, 1, 6].float())
    assert torch.equal(dv[170, 1].float(), kv[3, 1, 1, 6].float())


def test_fmha_v2_drops_only_flashinfers_stale_sm90_hang_warning(fake_flashinfer, caplog):
    adapter_for("flashinfer-fp8-fmha-v2").prepare(AttentionWorkload("prefill", 64, 1, 4, 1, 64), 1, CPU, 0)
    with caplog.at_level(logging.WARNING):
        logging.warning(FMHA_V2_STALE_WARNING)
        logging.warning("something else")
    assert [record.getMessage() for record in caplog.records] == ["something else"]
