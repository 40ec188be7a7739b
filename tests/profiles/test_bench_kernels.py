"""The kernel benchmark's byte accounting and tables, its MpFA backends, and the MpFA adapter's prefill set size
(CPU only; the timed runs need a GPU)."""

from __future__ import annotations

import pytest

from mpfa.backends.specs import kernel_benches
from mpfa.profiles.attention_workload import MPFA, AttentionWorkload
from mpfa.profiles.bench_kernels import bytes_read, format_prefill_table, format_table, table_title
from mpfa.profiles.kernels_mpfa import MpfaAdapter
from mpfa.profiles.registry import adapter_for
from mpfa.profiles.profile_result import ERROR, OK, BackendResult
from mpfa.profiles.timing import summarize

WORKLOAD = AttentionWorkload("decode", 131072, 1, 32, 8, 128)


def test_bytes_read_counts_cache_indices_and_partials():
    tokens, kv_heads, q_heads = 131072, 8, 32
    qo = 2 * q_heads * 128 * 2  # BF16 Q and O of one request
    partitions = 98  # 1344-key partitions: ~6 warps per SM on 132 SMs (choose_partition_size, the default)
    mpfa = tokens * kv_heads * (64 + 8 + 128 + 2 * 4) + tokens // 128 * 4 + qo + 2 * q_heads * partitions * 130 * 4
    assert bytes_read("mpfa", WORKLOAD, num_sms=132) == mpfa
    assert bytes_read("flashinfer-fp8", WORKLOAD, num_sms=132) == tokens * kv_heads * 256 + tokens * 4 + qo
    assert bytes_read("fa4-bf16", WORKLOAD, num_sms=132) == tokens * kv_heads * 512 + tokens // 128 * 4 + qo


def test_mpfa_backends_name_the_prefill_kernel_and_share_the_decode():
    """``mpfa`` runs the dispatched prefill kernel, ``mpfa-exact`` / ``mpfa-mma-sync`` name theirs, ``mpfa-direct``
    the direct builds; every one runs the same split-KV decode, so each reads the same bytes there."""
    mpfa_backends = [name for name in kernel_benches() if name.startswith("mpfa")]
    assert mpfa_backends == ["mpfa", "mpfa-direct", "mpfa-exact", "mpfa-mma-sync"]
    assert [adapter_for(name).prefill_kernel for name in mpfa_backends] == [None, None, "exact", "mma-sync"]
    assert [adapter_for(name).compensate for name in mpfa_backends] == [True, False, True, True]
    assert len({bytes_read(name, WORKLOAD, num_sms=132) for name in mpfa_backends}) == 1
    with pytest.raises(ValueError, match="unknown backend 'mpfa-fastest' \\(choose from fa4-bf16, fa3-bf16"):
        bytes_read("mpfa-fastest", WORKLOAD, num_sms=132)


def _row(backend: str, median_ms: float | None, error: str | None = None,
         workload: AttentionWorkload = WORKLOAD) -> BackendResult:
    row = BackendResult(backend, OK if error is None else ERROR, "bf16", workload.flops(), None, error=error)
    if median_ms is not None:
        row.timing = summarize([median_ms])
    return row


def test_table_has_rates_speedups_and_error_rows():
    rows = [_row("mpfa", 0.066), _row("fa3-fp8", 0.099), _row("flashinfer-fp8", 0.132),
            _row("fa4-bf16", None, "ImportError: no flash_attn")]
    table = format_table([(WORKLOAD, rows)], copy_bandwidth=4250.0, num_sms=132)
    lines = table.splitlines()
    assert "4.25 TB/s" in lines[0]
    mpfa_line = next(line for line in lines if " mpfa " in line)
    fields = mpfa_line.split()
    assert fields[3] == "66.0"  # median us
    rate = bytes_read("mpfa", WORKLOAD, 132) / 66e-6
    assert fields[5] == f"{rate / 1e12:.2f}" and fields[6] == f"{100 * rate / 4.25e12:.1f}%"
    assert fields[7:9] == ["1.50", "2.00"]  # 99 us / 66 us against FA3-FP8, 132 us / 66 us against FlashInfer-FP8
    assert fields[9] == "98"  # 128K x 1: 1,344-key partitions at the default 6 warps per SM
    assert lines[1].split()[-5:] == ["x", "FA3-FP8", "x", "FI-FP8", "parts"]
    assert next(line for line in lines if "flashinfer-fp8" in line).split()[-1] == "-"
    assert "ERROR: ImportError: no flash_attn" in table


PREFILL = AttentionWorkload("prefill", 65536, 1, 32, 8, 128)


def test_prefill_table_has_flop_rates_and_speedups():
    rows = [_row("mpfa", 100.0, workload=PREFILL), _row("fa3-fp8", 125.0, workload=PREFILL),
            _row("fa4-bf16", None, "ImportError: no flash_attn", workload=PREFILL)]
    lines = format_prefill_table([(PREFILL, rows)]).splitlines()
    fields = next(line for line in lines if " mpfa " in line).split()
    assert fields[3] == "100.000"  # median ms
    assert fields[4] == f"{PREFILL.flops() / 0.1 / 1e12:.1f}"  # 4 * 32 * 128 * 65536 * 65537 / 2 FLOPs in 100 ms
    assert fields[5:] == ["1.25", "-", "-"]  # x FA3-FP8, x FA3-FP8 contiguous (not run), x FA4 (not timed)
    assert any("ERROR: ImportError: no flash_attn" in line for line in lines)
    rows[2] = _row("fa4-bf16", 120.0, workload=PREFILL)
    lines = format_prefill_table([(PREFILL, rows)]).splitlines()
    assert lines[0].split()[-6:] == ["x", "FA3-FP8", "x", "FA3c", "x", "FA4"]
    assert next(line for line in lines if " mpfa " in line).split()[5:] == ["1.25", "-", "1.20"]


def test_table_title_names_the_gpu_and_the_shape():
    assert table_title("prefill", "NVIDIA H100 80GB HBM3", 132, (40, 8)) == (
        "prefill on NVIDIA H100 80GB HBM3 (132 SMs), GQA 40:8, head dim 128, causal; TFLOP/s in FlashAttention's "
        "convention (2·S²·H·D per causal sequence); medians of repeated timings, all backends in this one run")
    assert table_title("decode", "NVIDIA H200", 132, (32, 8)).startswith("decode on NVIDIA H200 (132 SMs), GQA 32:8,")


def test_mpfa_prefill_set_counts_query_cache_pages_and_output():
    workload = AttentionWorkload("prefill", 300, 2, 32, 8, 128)
    slots = 2 * 384  # 300 tokens -> 3 pages of 128 per sequence
    held = 600 * 32 * 72 + slots * 8 * (200 + 2 * 4) + 600 * 32 * 128 * 2
    assert MpfaAdapter().set_bytes(workload) == max(held, workload.bytes_needed(MPFA))
    group5 = AttentionWorkload("prefill", 300, 2, 40, 8, 128)  # Delta_S rows padded to 8 BF16 entries
    held = 600 * 40 * 72 + slots * 8 * (200 + 2 * 8) + 600 * 40 * 128 * 2
    assert MpfaAdapter().set_bytes(group5) == max(held, group5.bytes_needed(MPFA))
    assert MpfaAdapter().set_bytes(AttentionWorkload("prefill", 65536, 1, 32, 8, 128)) >= 65536 * 32 * (72 + 256)
