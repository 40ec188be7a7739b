"""Locate and run the external profilers (ncu, nsys), and read the numbers they print."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..mpfa_cli.errors import ToolError

_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?([eE][-+]?\d+)?")


def find_tool(name: str) -> str:
    """Path of `name` on PATH or in $CUDA_HOME/bin; ToolError naming what to install when absent."""
    found = shutil.which(name)
    cuda_home = os.environ.get("CUDA_HOME")
    if found is None and cuda_home and (Path(cuda_home) / "bin" / name).is_file():
        found = str(Path(cuda_home) / "bin" / name)
    if found is None:
        raise ToolError(f"{name} not found on PATH or in $CUDA_HOME/bin (install Nsight "
                        f"{'Compute' if name == 'ncu' else 'Systems'} or add it to PATH)")
    return found


def run_tool(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a profiler command; stdout and stderr are kept apart, never raises on a non-zero exit."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise ToolError(f"cannot run {command[0]}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ToolError(f"{Path(command[0]).name} did not finish within {timeout_s:.0f} s") from exc


def parse_number(text: str) -> float | None:
    """'1,234.5' -> 1234.5; '', 'n/a' and other non-numbers -> None."""
    cleaned = text.strip()
    if not _NUMBER.fullmatch(cleaned):
        return None
    return float(cleaned.replace(",", ""))


def output_tail(process: subprocess.CompletedProcess[str], lines: int = 6) -> str:
    """The last lines a tool printed, joined with ' | ' for a one-line error."""
    text = "\n".join(part for part in (process.stdout, process.stderr) if part)
    tail = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(tail) or f"exit status {process.returncode}, no output"
