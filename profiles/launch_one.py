"""Launch one backend's attention kernel a few times, nothing else: the process ncu and nsys profile.

Internal: run by ncu/nsys (`mpfa profile prefill|decode --ncu/--ncu-full/--nsys`), not a user command. It stays a
`python -m` module because the profilers start it as a child process:

    python -m mpfa.profiles.launch_one decode --seq 131072 --batch 8 --backend flashinfer-fp8 \
        --warmup 3 --launches 1 [--profiler-range]

The first `--warmup` calls compile (JIT) and warm up; then `--launches` calls follow, bracketed by
cudaProfilerStart/Stop when `--profiler-range` is given (for nsys --capture-range=cudaProfilerApi).
"""
from __future__ import annotations

import argparse
import sys

from .attention_workload import KINDS, AttentionWorkload, parse_heads, parse_seq
from .inputs import DEFAULT_SEED
from .registry import adapter_for

MODULE = "mpfa.profiles.launch_one"


def launch_arguments(workload: AttentionWorkload, backend: str, *, warmup: int, launches: int,
                     profiler_range: bool) -> list[str]:
    """Arguments after the Python executable that run this module for `backend` on `workload`."""
    arguments = ["-m", MODULE, workload.kind, "--seq", str(workload.seq), "--batch", str(workload.batch),
                 "--heads", f"{workload.q_heads}:{workload.kv_heads}", "--head-dim", str(workload.head_dim),
                 "--backend", backend, "--warmup", str(warmup), "--launches", str(launches)]
    return arguments + ["--profiler-range"] if profiler_range else arguments


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """`launch_arguments` back into the workload's fields, the backend and the launch counts."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--seq", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="32:8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--profiler-range", action="store_true")
    return parser.parse_args(argv)


def launched_workload(args: argparse.Namespace) -> AttentionWorkload:
    """The workload `parse_arguments` read."""
    return AttentionWorkload(args.kind, parse_seq(args.seq), args.batch, *parse_heads(args.heads), args.head_dim)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    import torch

    try:
        workload = launched_workload(args)
        adapter = adapter_for(args.backend)
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device: launch_one runs an attention kernel on a GPU")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prepared = adapter.prepare(workload, 1, torch.device("cuda"), DEFAULT_SEED)
    for _ in range(args.warmup):
        prepared.run(0)
    torch.cuda.synchronize()
    if args.profiler_range:
        torch.cuda.profiler.start()
    for _ in range(args.launches):
        prepared.run(0)
    torch.cuda.synchronize()
    if args.profiler_range:
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
