"""The simulator's latency model: derived quantities match the formulas and the backends' designs."""
from __future__ import annotations

import pytest

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.harness import latency_model as lm
from mpfa.mpfa_cli.bench.runner import verify_server
from mpfa.mpfa_cli.harness.sim_server import load_model_shape, reported_server_args


@pytest.fixture(scope="module")
def llama() -> lm.ModelShape:
    return load_model_shape("llama-3.1-8b")


def test_llama_shape_has_the_published_parameter_count(llama):
    total = llama.matmul_params + llama.vocab * llama.hidden  # + input embedding (untied)
    assert total == pytest.approx(8.03e9, rel=0.003)
    assert llama.weight_bytes == pytest.approx(2 * total)


def _model(backend: str, shape: lm.ModelShape) -> lm.LatencyModel:
    return lm.LatencyModel(BACKENDS[backend].sim, shape)


def test_every_backend_reports_what_its_spec_says():
    for spec in BACKENDS.values():
        reported = reported_server_args(spec)
        verify_server(reported, spec)  # raises on a mismatch
        assert {k: reported[k] for k in spec.expect} == spec.expect
    assert reported_server_args(BACKENDS["flashinfer-fp8"]) == {
        "attention_backend": "flashinfer", "kv_cache_dtype": "fp8_e4m3", "page_size": 1}
    # SGLang's own defaults where the spec sets nothing; the MpFA plugin accepts no --kv-cache-dtype but auto/bf16.
    assert reported_server_args(BACKENDS["mpfa"]) == {
        "attention_backend": "mpfa", "kv_cache_dtype": "auto", "page_size": 128}


def test_kv_bytes_follow_the_cache_formats(llama):
    per_token = {n: _model(n, llama).kv_bytes_per_token for n in BACKENDS}
    elements = 2 * llama.layers * llama.kv_heads * llama.head_dim  # K and V
    assert per_token["fa4-bf16"] == elements * 2
    assert per_token["flashinfer-fp8"] == elements * 1
    assert per_token["mpfa"] / per_token["flashinfer-fp8"] == pytest.approx((0.5 + 1 / 16 + 1) / 2)
    caps = {n: _model(n, llama).kv_capacity_tokens for n in BACKENDS}
    assert caps["mpfa"] > caps["flashinfer-fp8"] > caps["fa4-bf16"] == caps["triton-bf16"]
    assert caps["fa4-bf16"] == int((0.85 * 141e9 - llama.weight_bytes) // per_token["fa4-bf16"])


def test_prefill_matches_the_documented_formula(llama):
    model = _model("fa4-bf16", llama)
    n = 8192
    linear = max(2 * llama.matmul_params * n / (0.6 * 989e12), llama.weight_bytes / (0.8 * 4.8e12))
    attention = 4 * 32 * 32 * 128 * (n * (n + 1) / 2) / (0.55 * 989e12)
    assert model.prefill_seconds([n]) == pytest.approx(0.5e-3 + linear + attention, rel=1e-12)
    # batching prompts shares one step overhead but not the quadratic attention
    both = model.prefill_seconds([n, n])
    assert both == pytest.approx(2 * model.prefill_seconds([n]) - 0.5e-3, rel=1e-12)
    # attention makes prefill grow faster than linearly with context
    assert model.prefill_seconds([4 * n]) > 4 * model.prefill_seconds([n])


def test_decode_grows_with_kv_read_and_favours_smaller_caches(llama):
    model = _model("flashinfer-fp8", llama)
    one, two = model.decode_step_seconds([10_000]), model.decode_step_seconds([20_000])
    four = model.decode_step_seconds([40_000])
    assert four - two == pytest.approx(2 * (two - one), rel=1e-9)  # linear in tokens read
    batch = [32768] * 16
    steps = {n: _model(n, llama).decode_step_seconds(batch) for n in BACKENDS}
    assert steps["mpfa"] < steps["flashinfer-fp8"] < steps["fa4-bf16"] < steps["triton-bf16"]


def test_bad_inputs_raise(llama):
    with pytest.raises(ValueError, match="lacks hidden_size"):
        lm.ModelShape.from_hf_config("x", {"num_attention_heads": 8})
    model = _model("mpfa", llama)
    with pytest.raises(ValueError):
        model.prefill_seconds([])
    with pytest.raises(ValueError):
        model.decode_step_seconds([])
