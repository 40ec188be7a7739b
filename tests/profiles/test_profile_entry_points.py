"""Without a GPU: run_profile's argument errors and no-CUDA error, and the launch_one child's arguments."""
import subprocess
import sys

import pytest
import torch

from mpfa.mpfa_cli.errors import ProfileError
from mpfa.profiles import launch_one, microbench
from mpfa.profiles.attention_workload import AttentionWorkload


def test_run_profile_needs_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfileError, match="no CUDA device"):
        microbench.run_profile("decode", 1024, 2, (32, 8), 128, ["flashinfer-fp8"], False, False, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kind,heads,backends,message", [
    ("train", (32, 8), ["mpfa"], "unknown profile kind"),
    ("decode", (30, 8), ["mpfa"], "multiple of KV heads"),
    ("decode", (32, 8), ["fa3"], "unknown backend 'fa3'"),
    ("decode", (32, 8), [], "no backend"),
])
def test_run_profile_rejects_bad_arguments_before_touching_the_gpu(kind, heads, backends, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        microbench.run_profile(kind, 1024, 1, heads, 128, backends, False, False, tmp_path)


def test_launch_one_prints_one_line_errors(monkeypatch, capsys):
    """The process ncu / nsys profile: no traceback for a bad backend or a machine without CUDA."""
    assert launch_one.main(["prefill", "--seq", "4k", "--backend", "fa3"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown backend 'fa3'")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch_one.main(["prefill", "--seq", "4k", "--backend", "mpfa"]) == 2
    assert capsys.readouterr().err.strip() == "error: no CUDA device: launch_one runs an attention kernel on a GPU"


def test_launch_one_arguments_round_trip():
    workload = AttentionWorkload("decode", 131072, 8, 40, 8, 64)
    arguments = launch_one.launch_arguments(workload, "flashinfer-fp8", warmup=3, launches=1, profiler_range=True)
    assert arguments[:2] == ["-m", "mpfa.profiles.launch_one"]
    parsed = launch_one.parse_arguments(arguments[2:])
    assert launch_one.launched_workload(parsed) == workload
    assert (parsed.backend, parsed.warmup, parsed.launches, parsed.profiler_range) == ("flashinfer-fp8", 3, 1, True)
    assert not launch_one.parse_arguments(launch_one.launch_arguments(
        workload, "mpfa", warmup=0, launches=2, profiler_range=False)[2:]).profiler_range


def test_launch_one_runs_as_a_module_from_any_directory(tmp_path):
    """ncu and nsys start `python -m mpfa.profiles.launch_one` in their own working directory."""
    done = subprocess.run([sys.executable, "-m", "mpfa.profiles.launch_one", "--help"], capture_output=True,
                          text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0 and "--profiler-range" in done.stdout, done.stderr
