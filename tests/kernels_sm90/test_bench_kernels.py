"""The decode benchmark's byte accounting and table (CPU only; the timed run needs the H200)."""

from __future__ import annotations

from mpfa.profiles.bench_kernels import bytes_read, format_table
from mpfa.profiles.results import ERROR, OK, BackendResult
from mpfa.profiles.timing import summarize
from mpfa.profiles.workload import AttentionWorkload

WORKLOAD = AttentionWorkload("decode", 131072, 1, 32, 8, 128)


def test_bytes_read_counts_cache_indices_and_partials():
    tokens, kv_heads, q_heads = 131072, 8, 32
    qo = 2 * q_heads * 128 * 2  # BF16 Q and O of one request
    partitions = 128  # 1024-key partitions: ~8 warps per SM on 132 SMs
    mpfa = tokens * kv_heads * (64 + 8 + 128 + 2 * 4) + tokens * 4 + qo + 2 * q_heads * partitions * 130 * 4
    assert bytes_read("mpfa", WORKLOAD, num_sms=132) == mpfa
    assert bytes_read("flashinfer-fp8", WORKLOAD, num_sms=132) == tokens * kv_heads * 256 + tokens * 4 + qo
    assert bytes_read("fa4-bf16", WORKLOAD, num_sms=132) == tokens * kv_heads * 512 + tokens // 128 * 4 + qo


def _row(backend: str, median_ms: float | None, error: str | None = None) -> BackendResult:
    row = BackendResult(backend, OK if error is None else ERROR, "bf16", WORKLOAD.flops(), None, error=error)
    if median_ms is not None:
        row.timing = summarize([median_ms])
    return row


def test_table_has_rates_speedups_and_error_rows():
    rows = [_row("mpfa", 0.066), _row("flashinfer-fp8", 0.132), _row("fa4-bf16", None, "ImportError: no flash_attn")]
    table = format_table([(WORKLOAD, rows)], copy_bandwidth=4250.0, num_sms=132)
    lines = table.splitlines()
    assert "4.25 TB/s" in lines[0]
    mpfa_line = next(line for line in lines if " mpfa " in line)
    fields = mpfa_line.split()
    assert fields[3] == "66.0"  # median us
    rate = bytes_read("mpfa", WORKLOAD, 132) / 66e-6
    assert fields[5] == f"{rate / 1e12:.2f}" and fields[6] == f"{100 * rate / 4.25e12:.1f}%"
    assert fields[7] == "2.00"  # 132 us / 66 us against FlashInfer-FP8
    assert "ERROR: ImportError: no flash_attn" in table
