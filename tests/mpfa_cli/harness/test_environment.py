"""What `collect_environment` records, and the revision it names: "-dirty" for changed content, not for file modes
(a tree copied to a GPU host shows every file's mode changed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mpfa.mpfa_cli.harness.environment import collect_environment, git_revision, machine_id


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    _git(tmp_path, "init", "-q")
    (tmp_path / "tool.py").write_text("print('hi')\n")
    _git(tmp_path, "add", "tool.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    _git(tmp_path, "config", "core.fileMode", "true")  # as on a checkout that tracks modes
    return tmp_path


def test_a_clean_checkout_names_its_commit(checkout: Path):
    assert git_revision(checkout) == _git(checkout, "rev-parse", "--short=12", "HEAD")


def test_a_mode_change_is_not_dirty(checkout: Path):
    (checkout / "tool.py").chmod(0o755)
    assert "tool.py" in _git(checkout, "status", "--porcelain")  # git itself sees the mode change
    assert not git_revision(checkout).endswith("-dirty")


def test_changed_content_is_dirty_and_untracked_files_are_not(checkout: Path):
    (checkout / "notes.txt").write_text("untracked\n")
    assert not git_revision(checkout).endswith("-dirty")
    (checkout / "tool.py").write_text("print('changed')\n")
    assert git_revision(checkout).endswith("-dirty")


def test_outside_a_checkout_there_is_no_revision(tmp_path: Path):
    assert git_revision(tmp_path) is None


def test_environment_names_what_a_result_was_measured_on():
    environment = collect_environment()
    assert set(environment) == {"gpus", "driver", "cuda", "packages", "mpfa_revision", "gpu_uuids", "machine"}
    assert "mpfa" in environment["packages"]


def test_the_machine_id_is_stable_within_a_start_and_recorded():
    environment = collect_environment()
    assert environment["machine"] == machine_id()
    if Path("/proc/sys/kernel/random/boot_id").exists():
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert environment["machine"].startswith(boot_id + "/")


def test_a_named_revision_overrides_a_copied_checkout(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MPFA_REVISION", "0123456789ab")
    assert collect_environment()["mpfa_revision"] == "0123456789ab"


def test_driver_and_gpu_uuids_come_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stand-in nvidia-smi with two GPUs, answering the queries as the real one does."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in\n'
                   '  --query-gpu=driver_version,uuid) printf "580.82.07, GPU-aaa\\n580.82.07, GPU-bbb\\n";;\n'
                   '  --query-gpu=name) printf "NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n";;\n'
                   '  *) echo "| NVIDIA-SMI 580.82.07   Driver Version: 580.82.07   CUDA Version: 13.0 |";;\nesac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    environment = collect_environment()
    assert environment["driver"] == "580.82.07" and environment["gpu_uuids"] == ["GPU-aaa", "GPU-bbb"]
    assert environment["cuda"] == "13.0" and environment["gpus"] == ["NVIDIA H100 80GB HBM3"] * 2
