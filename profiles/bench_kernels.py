"""`mpfa profile sweep`: the sm90 MpFA kernels against FA3 (SGLang's Hopper default), FlashInfer-FP8 and FA4-BF16
over several shapes, one process, one table.

    mpfa profile sweep decode --seq 8192,32768,131072 --batch 1,8 [--heads 32:8]
    mpfa profile sweep prefill --seq 16k,65536 --batch 1 [--heads 32:8]
    mpfa profile sweep prefill --seq 64k --backend mpfa,mpfa-exact,mpfa-direct,fa4-bf16
    mpfa profile sweep prefill --seq 16k --heads 32:4 --backend mpfa,fa4-bf16   # mma-sync: GQA 8

For every (context, batch): each backend's inputs are built in rotated sets (`profiles.inputs`), called once
(JIT), then timed with CUDA events (`profiles.timing`, median). Decode is memory-bound: the table gives the
bytes read and their rate against the copy bandwidth measured in the same run. "Read" is the bytes the kernel
actually has to move: the KV cache in the backend's format, the page table / indices it walks, Q and O, and for
MpFA the split-KV partials it writes and merges ("parts": MpFA's partitions per request and KV head). Prefill
(causal, every token a query) is compute-bound: the table gives the FLOP rate of the two matmuls over the causal
pairs (`AttentionWorkload.flops`: FlashAttention's convention, 4·H·D per (query, key) pair, 2·S²·H·D for one
causal sequence) and the speedups over FA3-FP8 as SGLang serves it (paged), FA3-FP8 on contiguous K/V (its best
case) and FA4-BF16; decode: over FA3-FP8 and FlashInfer-FP8. A backend that fails prints an error row; the others
still run.
"""
from __future__ import annotations

from collections.abc import Callable

from ..mpfa_cli.errors import ProfileError
from .attention_workload import MPFA, AttentionWorkload
from .microbench import benchmark_backend
from .peaks import copy_gbps
from .registry import adapter_for
from .profile_result import OK, BackendResult

# The speed-up columns: (backend, column label) per kind.
PREFILL_REFERENCES = (("fa3-fp8", "x FA3-FP8"), ("fa3-fp8-contiguous", "x FA3c"), ("fa4-bf16", "x FA4"))
DECODE_REFERENCES = (("fa3-fp8", "x FA3-FP8"), ("flashinfer-fp8", "x FI-FP8"))
_INDEX_BYTES = 4


def mpfa_partitions(backend: str, workload: AttentionWorkload, num_sms: int) -> int | None:
    """The split-KV partitions per request an MpFA decode backend runs (None for the others)."""
    from ..kernels.sm90.decode_launch import choose_partition_size

    w = workload
    if adapter_for(backend).tensor_format is not MPFA:
        return None
    return -(-w.seq // choose_partition_size(w.batch, w.kv_heads, w.seq, num_sms))


def bytes_read(backend: str, workload: AttentionWorkload, num_sms: int) -> float:
    """Bytes the decode kernel(s) move: KV cache in the backend's format + Q + O (`workload.bytes_needed`), the
    page-table entries it walks (one per page of each sequence: FA3 and FlashInfer's fa2 at page size 1, one per
    token; FlashInfer's XQA at 64; FA4 and MpFA at 128), and MpFA's partials (written once, read once by the merge:
    m, l and O in FP32 per partition)."""
    return _bytes_read(backend, workload, mpfa_partitions(backend, workload, num_sms))


def _bytes_read(backend: str, workload: AttentionWorkload, partitions: int | None) -> float:
    """`bytes_read` given MpFA's partitions per request (`mpfa_partitions`; None for the other backends)."""
    w = workload
    tokens = w.batch * w.seq
    if partitions is not None:
        partial_bytes = 2 * w.batch * w.q_heads * partitions * (w.head_dim + 2) * 4
        return w.bytes_needed(MPFA) + tokens // 128 * _INDEX_BYTES + partial_bytes
    adapter = adapter_for(backend)
    page_size = 128 if backend == "fa4-bf16" else getattr(adapter, "page_size", 1)
    return w.bytes_needed(adapter.tensor_format) + w.batch * -(-w.seq // page_size) * _INDEX_BYTES


def _timed_rows(results: list[tuple[AttentionWorkload, list[BackendResult]]], lines: list[str],
                references: tuple[tuple[str, str], ...]):
    """(workload, row, line prefix, speedup columns vs each of ``references``) of every timed row; the others are
    appended to ``lines`` as error lines, in order."""
    for workload, rows in results:
        by_name = {row.backend: row for row in rows}
        for row in rows:
            prefix = f"{workload.seq:>8} {workload.batch:>5}  {row.backend:<18}"
            if row.status != OK or row.timing is None:
                lines.append(f"{prefix} {row.status.upper()}: {row.error}")
                continue
            speedups = []
            for name, _ in references:
                reference = by_name.get(name)
                speedups.append(f"{reference.timing.median_ms / row.timing.median_ms:8.2f}"
                                if reference is not None and reference.timing is not None else "       -")
            yield workload, row, prefix, " ".join(speedups)


def format_table(results: list[tuple[AttentionWorkload, list[BackendResult]]], copy_bandwidth: float | None,
                 num_sms: int) -> str:
    header = (f"{'context':>8} {'batch':>5}  {'backend':<18} {'median us':>10} {'read MB':>9} {'TB/s':>6} "
              f"{'% copy':>7} {_labels(DECODE_REFERENCES)} {'parts':>6}")
    lines = [f"copy bandwidth (read + write, measured in this run): "
             f"{copy_bandwidth / 1e3:.2f} TB/s" if copy_bandwidth else "copy bandwidth: not measured", header]
    for workload, row, prefix, speedup in _timed_rows(results, lines, DECODE_REFERENCES):
        parts = mpfa_partitions(row.backend, workload, num_sms)
        read = _bytes_read(row.backend, workload, parts)
        rate = read / (row.timing.median_ms / 1e3)
        pct = f"{100 * rate / (copy_bandwidth * 1e9):6.1f}%" if copy_bandwidth else "      -"
        lines.append(f"{prefix} {row.timing.median_ms * 1e3:>10.1f} {read / 1e6:>9.1f} {rate / 1e12:>6.2f} "
                     f"{pct} {speedup} {'-' if parts is None else parts:>6}")
    return "\n".join(lines)


def _labels(references: tuple[tuple[str, str], ...]) -> str:
    return " ".join(f"{label:>8}" for _, label in references)


def format_prefill_table(results: list[tuple[AttentionWorkload, list[BackendResult]]]) -> str:
    """Median time, TFLOP/s of the causal matmuls and the speedups over `PREFILL_REFERENCES` per (context, batch)."""
    lines = [f"{'context':>8} {'batch':>5}  {'backend':<18} {'median ms':>10} {'TFLOP/s':>8} "
             f"{_labels(PREFILL_REFERENCES)}"]
    for workload, row, prefix, speedup in _timed_rows(results, lines, PREFILL_REFERENCES):
        rate = workload.flops() / (row.timing.median_ms / 1e3)
        lines.append(f"{prefix} {row.timing.median_ms:>10.3f} {rate / 1e12:>8.1f} {speedup}")
    return "\n".join(lines)


def run_bench(kind: str, seqs: list[int], batches: list[int], heads: tuple[int, int], backends: list[str],
              say: Callable[[str], None]) -> str:
    import torch

    if not torch.cuda.is_available():
        raise ProfileError("no CUDA device: the kernel benchmark runs on a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    bandwidth = None
    if kind == "decode":
        say("measuring copy bandwidth")
        try:
            bandwidth = copy_gbps(device)
        except Exception as exc:  # the table still prints, without the % column
            say(f"copy bandwidth failed: {type(exc).__name__}: {exc}")
    results = []
    for seq in seqs:
        for batch in batches:
            workload = AttentionWorkload(kind, seq, batch, heads[0], heads[1], 128)
            say(f"--- {workload.label()}")
            results.append((workload, [benchmark_backend(adapter_for(name), workload, device, say) for name in backends]))
    props = torch.cuda.get_device_properties(device)
    title = table_title(kind, torch.cuda.get_device_name(device), props.multi_processor_count, heads)
    if kind == "prefill":
        return f"{title}\n{format_prefill_table(results)}"
    return f"{title}\n{format_table(results, bandwidth, props.multi_processor_count)}"


def table_title(kind: str, device_name: str, num_sms: int, heads: tuple[int, int]) -> str:
    """The table's first line: what ran where (timings on different GPUs are not comparable)."""
    rates = (", causal; TFLOP/s in FlashAttention's convention (2·S²·H·D per causal sequence)" if kind == "prefill"
             else "; TB/s of the bytes each kernel must read")
    return (f"{kind} on {device_name} ({num_sms} SMs), GQA {heads[0]}:{heads[1]}, head dim 128{rates}; "
            "medians of repeated timings, all backends in this one run")
