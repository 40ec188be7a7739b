"""Decode inputs: the page table gathered from SGLang's req_to_token, and the fixed CUDA-graph buffers (one shared
scratch workspace viewed per batch size). CPU tensors; the kernel itself is tested in test_gpu_decode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")  # decode_launch compiles through cutlass lazily; its module imports it indirectly

from mpfa.backends.sglang_plugin.decode_plan import GraphDecodeBuffers, build_page_table, eager_decode_batch
from mpfa.kernels.sm90.decode_launch import MIN_PARTITION, choose_partition_size  # noqa: E402


def _req_to_token(gen, page_size=4, rows=5, width=32):
    table = torch.zeros((rows, width), dtype=torch.int32)
    pages = (torch.randperm(40, generator=gen) + 1).tolist()
    for r in range(1, rows):
        for p in range(width // page_size):
            table[r, p * page_size:(p + 1) * page_size] = pages.pop() * page_size + torch.arange(page_size)
            if not pages:
                return table
    return table


def test_page_table_names_each_page_by_its_first_slot(gen):
    req_to_token = _req_to_token(gen)
    rows = torch.tensor([3, 1])
    table = build_page_table(req_to_token, rows, 4)
    assert table.dtype == torch.int32 and table.is_contiguous() and tuple(table.shape) == (2, 8)
    for b, r in enumerate(rows.tolist()):
        for t in range(32):
            assert int(req_to_token[r, t]) == int(table[b, t // 4]) * 4 + t % 4
    assert tuple(build_page_table(req_to_token, rows, 4, num_pages=3).shape) == (2, 3)


def test_eager_batch_sizes_partitions_for_the_longest_sequence(gen):
    req_to_token = _req_to_token(gen)
    batch = eager_decode_batch(req_to_token, torch.tensor([1, 2]), torch.tensor([9, 20]), 20, 4, 8, 2, num_sms=132)
    assert tuple(batch.page_table.shape) == (2, 5) and batch.seq_lens.dtype == torch.int32
    assert batch.workspace.partition_size == choose_partition_size(2, 2, 20, 132)
    assert tuple(batch.workspace.m.shape) == (2, 8, 1)


def test_graph_buffers_share_one_scratch_and_refill_in_place(gen):
    req_to_token = _req_to_token(gen)
    buffers = GraphDecodeBuffers(max_bs=6, num_q_heads=8, num_kv_heads=2, max_seq_len=20_000, page_size=4,
                                 device="cpu", num_sms=132)
    for bs in range(1, 7):
        ws = buffers.workspace(bs)
        assert ws is buffers.workspace(bs)  # the same views at capture and at every replay
        assert ws.partition_size == choose_partition_size(bs, 2, 20_000, 132)
        assert ws.partition_size * ws.num_partitions >= 20_000
        assert ws.min_partition == min(MIN_PARTITION, ws.partition_size)  # replays size partitions by their length
        assert ws.m.data_ptr() == buffers.workspace(1).m.data_ptr()
        assert ws.m.is_contiguous() and ws.o.is_contiguous() and tuple(ws.o.shape[:2]) == (bs, 8)
    page_table_ptr = buffers.page_table.data_ptr()
    batch = buffers.fill(req_to_token, torch.tensor([2, 4, 0]), torch.tensor([7, 30, 1]), bs=3)
    assert batch.page_table.data_ptr() == page_table_ptr and batch.seq_lens.tolist() == [7, 30, 1]
    assert torch.equal(batch.page_table[:, :8], build_page_table(req_to_token, torch.tensor([2, 4, 0]), 4))
