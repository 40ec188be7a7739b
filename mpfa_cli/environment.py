"""What a result was measured on: GPU, driver, CUDA, package versions, the mpfa revision, and the MpFA kernel
switches set in the environment (the SGLang servers `mpfa bench` starts inherit them)."""
from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from mpfa.cli.engines import gpu_names

PACKAGES = ("torch", "sglang", "flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl", "mpfa")
# $MPFA_PREFILL (backends/sglang_plugin/attention.py), prefill_launch.KERNEL_ENV, decode_launch.KERNEL_ENV
KERNEL_SWITCHES = ("MPFA_PREFILL", "MPFA_PREFILL_KERNEL", "MPFA_DECODE_KERNEL")


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


def git_revision() -> str | None:
    here = Path(__file__).resolve().parent
    revision = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here)
    if revision and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here):
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
        "kernel_switches": {name: os.environ[name] for name in KERNEL_SWITCHES if name in os.environ},
    }
