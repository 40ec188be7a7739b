"""What a result was measured on: GPU, driver, CUDA, package versions and the mpfa revision. (The kernels a server
ran are the run's own record: `RunRecord.kernels`.)"""
from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from mpfa.harness.engines import gpu_names

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


def collect_environment() -> dict[str, Any]:
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    smi = _run(["nvidia-smi"]) or ""
    cuda = next((line.split("CUDA Version:")[1].split()[0] for line in smi.splitlines() if "CUDA Version:" in line), None)
    return {
        "gpus": gpu_names(),
        "driver": driver.splitlines()[0] if driver else None,
        "cuda": cuda,
        "packages": {name: _version(name) for name in PACKAGES},
        "mpfa_revision": git_revision(),
    }
