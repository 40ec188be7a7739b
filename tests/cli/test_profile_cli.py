"""`mpfa profile` argument errors are one line and exit 2; without a GPU it says so instead of crashing."""
import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["profile", "histogram"], "unknown profile kind 'histogram'; valid: prefill, decode, serving"),
        (["profile", "prefill", "--heads", "3:2"], "must be a multiple of KV heads"),
        (["profile", "decode", "--seq", "lots"], "lots"),
        (["profile", "serving", "--backend", "fa4-bf16,mpfa"], "profile serving takes one backend"),
        (["profile", "serving", "--backend", "fa9"], "unknown backend 'fa9'; valid:"),
    ],
)
def test_bad_profile_arguments(mpfa, args: list[str], message: str) -> None:
    result = mpfa(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_kernel_profile_without_gpu_is_a_clear_error(mpfa) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = mpfa("profile", "decode", "--seq", "1k")
    assert result.returncode == 2 and "no CUDA device" in result.stderr
