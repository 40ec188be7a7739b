"""KV-cache bytes per token per KV head, checked against the sizes of real quantized tensors."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import (compression_vs_bf16, delta_s, format_capacity_table, kv_bytes_per_token, quantize_fp8,
                          quantize_nvfp4)
from mpfa.kernels.cache_layout import delta_s_row


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 5])
def test_bytes_match_quantized_tensors(gen: torch.Generator, head_dim: int, group: int) -> None:
    """One token of one KV head (+ its group of query heads for Delta_S, in the cache's padded row), stored in each
    format."""
    k = torch.randn(1, 1, head_dim, generator=gen).bfloat16()
    v = torch.randn(1, 1, head_dim, generator=gen).bfloat16()
    q_mean = torch.randn(1, group, head_dim, generator=gen)
    nvfp4_k = quantize_nvfp4(k)
    side_cache = delta_s(q_mean, k.float(), torch.tensor([0, 1]))  # [1, group]
    side_cache = torch.nn.functional.pad(side_cache, (0, delta_s_row(group) - group))  # the cache's row
    assert kv_bytes_per_token("bf16", head_dim) == nbytes(k, v)
    assert kv_bytes_per_token("fp8", head_dim) == nbytes(quantize_fp8(k), quantize_fp8(v))
    mpfa_bytes = nbytes(nvfp4_k.codes, nvfp4_k.scales, quantize_fp8(v), side_cache)
    assert kv_bytes_per_token("mpfa", head_dim, group) == mpfa_bytes
    assert compression_vs_bf16("mpfa", head_dim, group) == nbytes(k, v) / mpfa_bytes


def test_capacity_table_prints(capsys: pytest.CaptureFixture) -> None:
    """Prints the table (see it with -s); the "1/2.56 of BF16" claim is reported, not asserted."""
    text = format_capacity_table()
    print(text)
    assert "mpfa" in text and "without the Delta_S side cache" in capsys.readouterr().out


def test_capacity_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        kv_bytes_per_token("bf16", 40)
    with pytest.raises(ValueError, match="cache format"):
        kv_bytes_per_token("int4", 128)
    with pytest.raises(ValueError, match="group_size"):
        kv_bytes_per_token("mpfa", 128, 0)
