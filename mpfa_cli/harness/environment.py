"""What a result was measured on: GPU, driver, CUDA, package versions, the mpfa revision and the machine start.
(The kernels a server ran are the run's own record: `RunRecord.kernels`.)"""
from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from .engines import gpu_names

PACKAGES = ("torch", "sglang", "flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl", "mpfa")
_HERE = Path(__file__).resolve().parent


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, cwd=cwd, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout.strip() or None


def git_revision(checkout: Path = _HERE) -> str | None:
    """The checkout's commit, "-dirty" when a tracked file's content differs from it. File modes are not compared:
    a tree copied to a GPU host shows every file's mode changed."""
    revision = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=checkout)
    status = ["git", "-c", "core.fileMode=false", "status", "--porcelain", "--untracked-files=no"]
    if revision and _run(status, cwd=checkout):
        revision += "-dirty"
    return revision


def machine_id() -> str | None:
    """Names one start of this machine: the kernel's boot id and the start time of process 1. Two runs with the same
    id ran on the same machine without a restart between them, i.e. side by side (a fresh machine, or a fresh
    container on a host that was not rebooted, gets a new one)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        # /proc/1/stat: field 22 is the start time in clock ticks since boot; the name in field 2 may hold spaces.
        started = Path("/proc/1/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot_id}/{started}"


def collect_environment() -> dict[str, Any]:
    # One query for every GPU's driver and UUID: "driver, uuid" per line.
    per_gpu = [line.split(", ") for line in (_run(["nvidia-smi", "--query-gpu=driver_version,uuid",
                                                   "--format=csv,noheader"]) or "").splitlines()]
    smi = _run(["nvidia-smi"]) or ""
    cuda = next((line.split("CUDA Version:")[1].split()[0] for line in smi.splitlines() if "CUDA Version:" in line), None)
    return {
        "gpus": gpu_names(),
        "driver": per_gpu[0][0] if per_gpu else None,
        "cuda": cuda,
        "packages": {name: _version(name) for name in PACKAGES},
        # A tree copied to a GPU host may carry a stale .git: whoever copies it can name the revision instead.
        "mpfa_revision": os.environ.get("MPFA_REVISION") or git_revision(),
        "gpu_uuids": [fields[-1] for fields in per_gpu],
        "machine": machine_id(),
    }
