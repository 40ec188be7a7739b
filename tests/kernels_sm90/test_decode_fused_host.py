"""Host side of the ``split-kv-fused`` decode (CPU only): its name in the one place that chooses kernels, the
arrival counters every workspace carries (eager, the profile's and the SGLang plugin's CUDA-graph buffers), its
shared memory, and the order in which its merging warp sums the partitions: the merge kernel's, so its outputs equal
the two-kernel path's bit for bit (the GPU test checks that)."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels.sm90 import dispatch


def test_decode_kernel_default_override_and_bad_names(monkeypatch):
    monkeypatch.delenv(dispatch.DECODE_KERNEL_ENV, raising=False)
    assert dispatch.decode_kernel() == dispatch.DECODE_KERNEL == "split-kv"
    assert list(dispatch.DECODE_KERNELS) == ["split-kv", "split-kv-fused"]
    assert dispatch.decode_kernel(" Split-KV-Fused ") == "split-kv-fused"
    monkeypatch.setenv(dispatch.DECODE_KERNEL_ENV, "split-kv-fused")
    assert dispatch.decode_kernel() == "split-kv-fused"
    assert dispatch.decode_kernel("split-kv") == "split-kv"  # an explicit choice wins over the environment
    monkeypatch.setenv(dispatch.DECODE_KERNEL_ENV, "")
    assert dispatch.decode_kernel() == "split-kv"
    monkeypatch.setenv(dispatch.DECODE_KERNEL_ENV, "fused")
    with pytest.raises(ValueError, match="MPFA_DECODE_KERNEL must be one of split-kv, split-kv-fused, got 'fused'"):
        dispatch.decode_kernel()
    with pytest.raises(ValueError, match="kernel must be one of split-kv, split-kv-fused, got 'merge'"):
        dispatch.decode_kernel("merge")


def test_workspaces_carry_zeroed_counters_per_request_and_kv_head():
    from mpfa.kernels.sm90.decode_launch import DecodeWorkspace, _check_counters

    workspace = DecodeWorkspace.allocate(3, 32, 8, 40_000, "cpu", 1024)
    assert workspace.counters.dtype == torch.int32 and tuple(workspace.counters.shape) == (3, 8)
    assert workspace.counters.is_contiguous() and not workspace.counters.any()
    _check_counters(workspace, 3, 8)
    with pytest.raises(ValueError, match=r"needs the workspace's int32 counters \[3, 4\]"):
        _check_counters(workspace, 3, 4)
    bare = DecodeWorkspace(1024, workspace.m, workspace.l, workspace.o, 1024)  # built without counters
    assert bare.counters is None
    with pytest.raises(ValueError, match="got None"):
        _check_counters(bare, 3, 8)


def test_graph_buffers_share_one_set_of_counters():
    pytest.importorskip("cutlass")
    from mpfa.backends.sglang_plugin.decode_plan import GraphDecodeBuffers

    buffers = GraphDecodeBuffers(max_bs=6, num_q_heads=8, num_kv_heads=2, max_seq_len=20_000, page_size=4,
                                 device="cpu", num_sms=132)
    first = buffers.workspace(1).counters
    for bs in range(1, 7):
        counters = buffers.workspace(bs).counters
        assert tuple(counters.shape) == (bs, 2) and counters.dtype == torch.int32 and counters.is_contiguous()
        assert counters.data_ptr() == first.data_ptr() and not counters.any()


def test_fused_shared_memory_keeps_twelve_warps_per_sm():
    pytest.importorskip("cutlass")
    from mpfa.kernels.sm90.decode import FUSED_SMEM_BYTES, MERGE_WARPS, SMEM_BYTES
    from mpfa.kernels.sm90.decode_launch import WARPS_PER_SM
    from mpfa.kernels.sm90.sass import SMEM_PER_SM

    assert FUSED_SMEM_BYTES == MERGE_WARPS * 128 * 4 == 16384 and SMEM_BYTES == 15360
    assert WARPS_PER_SM * (FUSED_SMEM_BYTES + 1024) <= SMEM_PER_SM  # + the 1 KB each CTA reserves


def _merge_kernel_order(valid: int, warps: int, unroll: int) -> dict[int, list[int]]:
    """Partitions in the order `decode_merge` adds them into each warp's running sums (padding rows: weight 0)."""
    order: dict[int, list[int]] = {w: [] for w in range(warps)}
    for w in range(warps):
        for first in range(w, valid, warps * unroll):
            order[w] += [first + warps * u for u in range(unroll) if first + warps * u < valid]
    return order


def _fused_order(valid: int, warps: int, rows: int) -> dict[int, list[int]]:
    """The same for `SplitKVDecodeSm90._merge_heads`: chunks of 32 partitions, `rows` at a time, partition p into
    shared row p % 32 (lane p % 32 for the weights)."""
    order: dict[int, list[int]] = {w: [] for w in range(warps)}
    for first in range(0, valid, warps):
        for half in range(warps // rows):
            if first + half * rows < valid:
                for u in range(rows):
                    if first + half * rows + u < valid:
                        order[half * rows + u].append(first + half * rows + u)
    return order


@pytest.mark.parametrize("valid", [1, 2, 15, 16, 17, 31, 32, 33, 94, 128, 129, 300, 1000])
def test_fused_merge_adds_partitions_in_the_merge_kernels_order(valid):
    pytest.importorskip("cutlass")
    from mpfa.kernels.sm90.decode import MERGE_ROWS, MERGE_WARPS
    from mpfa.kernels.sm90.decode_merge import UNROLL, WARPS

    assert MERGE_WARPS == WARPS
    assert _fused_order(valid, WARPS, MERGE_ROWS) == _merge_kernel_order(valid, WARPS, UNROLL)
