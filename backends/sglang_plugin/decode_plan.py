"""Per-step decode inputs of the sm90 kernel: the page table, int32 lengths and the split-KV workspace.

``page_table[b, p] = req_to_token[req_pool_indices[b], p * page_size] // page_size``: SGLang's pages are aligned
runs of ``page_size`` slots, so a page's first slot names it. Building it gathers only every ``page_size``-th
column of ``req_to_token`` and never synchronises with the host.

`GraphDecodeBuffers` holds the fixed buffers CUDA graphs capture: page table, lengths and one scratch workspace
shared by every captured batch size (graphs replay one at a time on one stream), each batch size viewing it with
its own partition count, sized for the longest sequence ``req_to_token`` can hold. A replay's requests spread their
keys over all of those partitions (down to ``MIN_PARTITION`` keys each), so a 32K context in buffers sized for
128K still fills the GPU: with partitions fixed at the 128K size it ran ~6 warps per request and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.sm90.decode_launch import HEAD_DIM, MIN_PARTITION, DecodeWorkspace, choose_partition_size


def page_starts(req_to_token: torch.Tensor, page_size: int) -> torch.Tensor:
    """View [rows, max_pages] of the first slot of every page of every request row."""
    return req_to_token[:, ::page_size]


def build_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int,
                     num_pages: int | None = None) -> torch.Tensor:
    """int32 [B, num_pages] page table of the batch's requests (all pages of a row when num_pages is None)."""
    starts = page_starts(req_to_token, page_size)
    if num_pages is not None:
        starts = starts[:, :num_pages]
    table = torch.index_select(starts, 0, req_pool_indices.long())
    return torch.div(table, page_size, rounding_mode="floor").to(torch.int32).contiguous()


@dataclass(frozen=True)
class DecodeBatch:
    """What one decode step's layers share: the page table, each request's first page (its means row, `kv_store`),
    int32 lengths (the new token included) and the workspace. (The new tokens' slots are read from the forward
    batch: under a CUDA graph those are SGLang's own fixed buffers.)"""

    page_table: torch.Tensor
    first_pages: torch.Tensor
    seq_lens: torch.Tensor
    workspace: DecodeWorkspace


def eager_decode_batch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       max_seq_len: int, page_size: int, num_q_heads: int, num_kv_heads: int,
                       num_sms: int | None = None) -> DecodeBatch:
    """A decode batch outside CUDA graphs: buffers sized for ``max_seq_len`` (the batch's longest sequence)."""
    batch = req_pool_indices.shape[0]
    device = req_to_token.device
    num_pages = -(-max_seq_len // page_size)
    partition = None
    if num_sms is not None:
        partition = choose_partition_size(batch, num_kv_heads, max_seq_len, num_sms)
    workspace = DecodeWorkspace.allocate(batch, num_q_heads, num_kv_heads, max_seq_len, device, partition)
    page_table = build_page_table(req_to_token, req_pool_indices, page_size, num_pages)
    return DecodeBatch(page_table, page_table[:, 0].long(), seq_lens.to(torch.int32), workspace)


class GraphDecodeBuffers:
    """Fixed decode buffers for batch sizes up to ``max_bs`` (CUDA-graph capture and replay)."""

    def __init__(self, max_bs: int, num_q_heads: int, num_kv_heads: int, max_seq_len: int, page_size: int,
                 device: torch.device | str, num_sms: int) -> None:
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.max_seq_len, self.page_size, self.num_sms = max_seq_len, page_size, num_sms
        max_pages = -(-max_seq_len // page_size)
        self.page_table = torch.zeros((max_bs, max_pages), dtype=torch.int32, device=device)
        self.first_pages = torch.zeros((max_bs,), dtype=torch.long, device=device)
        self.seq_lens = torch.ones((max_bs,), dtype=torch.int32, device=device)
        self._partitions = {bs: self.partition_size(bs) for bs in range(1, max_bs + 1)}
        rows = max(bs * num_q_heads * -(-max_seq_len // p) for bs, p in self._partitions.items())
        self._m = torch.zeros(rows, dtype=torch.float32, device=device)
        self._l = torch.zeros(rows, dtype=torch.float32, device=device)
        self._o = torch.zeros(rows * HEAD_DIM, dtype=torch.float32, device=device)
        self._workspaces: dict[int, DecodeWorkspace] = {}

    def partition_size(self, bs: int) -> int:
        return choose_partition_size(bs, self.num_kv_heads, self.max_seq_len, self.num_sms)

    def workspace(self, bs: int) -> DecodeWorkspace:
        """The workspace of batch size ``bs``: views of the shared scratch (same tensors at capture and replay)."""
        if bs not in self._workspaces:
            partition = self._partitions[bs]
            parts = -(-self.max_seq_len // partition)
            n = bs * self.num_q_heads * parts
            self._workspaces[bs] = DecodeWorkspace(
                partition, self._m[:n].view(bs, self.num_q_heads, parts), self._l[:n].view(bs, self.num_q_heads, parts),
                self._o[: n * HEAD_DIM].view(bs, self.num_q_heads, parts, HEAD_DIM), min(MIN_PARTITION, partition))
        return self._workspaces[bs]

    def fill(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
             bs: int) -> DecodeBatch:
        """Copy this step's page table, first pages and lengths into the fixed buffers (outside the graph) and view
        them."""
        table = build_page_table(req_to_token, req_pool_indices[:bs], self.page_size, self.page_table.shape[1])
        self.page_table[:bs, : table.shape[1]].copy_(table)
        self.first_pages[:bs].copy_(table[:, 0])
        self.seq_lens[:bs].copy_(seq_lens[:bs])
        return DecodeBatch(self.page_table[:bs], self.first_pages[:bs], self.seq_lens[:bs], self.workspace(bs))
