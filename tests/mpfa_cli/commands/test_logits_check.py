"""`mpfa logits --predicted`: measured |Δ logprob| against the CPU prediction, both ways, and bad prediction files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.accuracy.logits import LogitsResult, Row
from mpfa.mpfa_cli.accuracy.logits_check import check_against_prediction, served_numerics

NUMERICS = {name: spec.numerics for name, spec in BACKENDS.items()}
FAST = ["--time-scale", "0.02"]


def _result(measured: dict[str, float], seed: int = 0) -> LogitsResult:
    rows = [Row(backend="fa4-bf16", input_len=512, prompts=2, prefill_mean_abs=0.0)]
    rows += [Row(backend=b, input_len=512, prompts=2, prefill_mean_abs=v) for b, v in measured.items()]
    return LogitsResult(ref="fa4-bf16", model="m", simulated=False, output_len=4, seed=seed, rows=rows, reference={})


def _prediction(values: dict[str, float], ref: str = "bf16", seed: int = 0) -> dict:
    rows = [{"backend": ref, "input_len": 512, "error": None, "prefill_mean_abs": 0.0}]
    rows += [{"backend": v, "input_len": 512, "error": None, "prefill_mean_abs": x} for v, x in values.items()]
    return {"ref": ref, "seed": seed, "rows": rows}


def test_each_backend_is_checked_against_its_own_variant():
    checks = check_against_prediction(_result({"mpfa": 0.5, "mpfa-direct": 2.0}),
                                      _prediction({"mpfa": 0.45, "qk4-pv8-direct": 0.6, "fp8": 0.12}), NUMERICS)
    by_backend = {c.backend: c for c in checks}
    assert set(by_backend) == {"mpfa", "mpfa-direct"}
    assert by_backend["mpfa"].variant == "mpfa" and by_backend["mpfa"].within(1.5)
    assert by_backend["mpfa-direct"].variant == "qk4-pv8-direct" and not by_backend["mpfa-direct"].within(1.5)


def test_mpfa_prompts_are_checked_against_the_prefill_kernel_s_numerics(monkeypatch):
    specs = [BACKENDS[name] for name in ("fa4-bf16", "mpfa", "mpfa-direct")]
    monkeypatch.delenv("MPFA_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("MPFA_PREFILL", raising=False)
    monkeypatch.delenv("MPFA_NUMERICS", raising=False)
    fp8 = {"fa4-bf16": "bf16", "mpfa": "mpfa-qk8tile-psum", "mpfa-direct": "qk8tile-psum-direct"}
    paper = {"fa4-bf16": "bf16", "mpfa": "mpfa", "mpfa-direct": "qk4-pv8-direct"}
    assert served_numerics(specs, "llama-3.1-8b") == fp8  # the default for GQA 4: the fp8 kernel
    assert served_numerics(specs, "llama-3.1-8b", "exact") == paper
    monkeypatch.setenv("MPFA_PREFILL_KERNEL", "MMA-SYNC")  # the servers inherit it
    assert served_numerics(specs, "llama-3.1-8b") == paper
    assert served_numerics(specs, "llama-3.1-8b", "fp8") == fp8  # the server argument wins
    monkeypatch.setenv("MPFA_PREFILL_KERNEL", "fastest")
    with pytest.raises(UserError, match="MPFA_PREFILL_KERNEL"):
        served_numerics(specs, "llama-3.1-8b")
    assert served_numerics(specs[:1], "llama-3.1-8b") == {"fa4-bf16": "bf16"}  # no MpFA server: nothing to choose


def test_mpfa_is_checked_against_the_variant_its_served_numerics_make(monkeypatch):
    monkeypatch.delenv("MPFA_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("MPFA_PREFILL", raising=False)
    monkeypatch.setenv("MPFA_NUMERICS", "had128-k46")  # the servers inherit it
    specs = [BACKENDS[name] for name in ("fa4-bf16", "mpfa", "mpfa-direct")]
    assert served_numerics(specs, "llama-3.1-8b") == {
        "fa4-bf16": "bf16", "mpfa": "mpfa-qk8tile-psum-had128-k46", "mpfa-direct": "qk8tile-psum-direct-had128-k46"}
    assert served_numerics(specs, "llama-3.1-8b", "exact") == {
        "fa4-bf16": "bf16", "mpfa": "mpfa-had128-k46", "mpfa-direct": "qk4-pv8-direct-had128-k46"}


def test_the_reference_prefill_path_computes_the_paper_s_numerics(monkeypatch):
    monkeypatch.delenv("MPFA_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("MPFA_NUMERICS", raising=False)
    monkeypatch.setenv("MPFA_PREFILL", "reference")
    assert served_numerics([BACKENDS["mpfa"]], "llama-3.1-8b") == {"mpfa": "mpfa"}


def test_too_small_a_delta_fails_too():
    """A backend that silently computed BF16 attention would agree with the reference far too well."""
    (check,) = check_against_prediction(_result({"mpfa": 0.01}), _prediction({"mpfa": 0.45}), NUMERICS)
    assert not check.within(1.5) and check.ratio() < 1 / 1.5


def test_a_prediction_against_another_reference_or_seed_is_refused():
    with pytest.raises(UserError, match="compares against 'fp8'"):
        check_against_prediction(_result({"mpfa": 0.5}), _prediction({"mpfa": 0.45}, ref="fp8"), NUMERICS)
    with pytest.raises(UserError, match="prompt seed 3"):
        check_against_prediction(_result({"mpfa": 0.5}), _prediction({"mpfa": 0.45}, seed=3), NUMERICS)
    with pytest.raises(UserError, match="no row for any measured backend"):
        check_against_prediction(_result({"mpfa": 0.5}), _prediction({"fp8": 0.1}), NUMERICS)


def test_cli_exit_code_and_table(mpfa, tmp_path: Path):
    """On the simulator (hash logprobs) a prediction far from its deltas fails with the backends named."""
    path = tmp_path / "pred.json"
    path.write_text(json.dumps(_prediction({"mpfa": 5.0}) | {"rows": [
        {"backend": "mpfa-qk8tile-psum", "input_len": 32, "error": None, "prefill_mean_abs": 5.0}]}))
    out = mpfa("logits", "--engine", "sim", "--backend", "fa4-bf16,mpfa", "--input-len", "32", "--prompts", "1",
               "--output-len", "2", "--predicted", str(path), *FAST)
    assert out.returncode == 1, out.stderr
    assert "measured vs predicted" in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("error: measured vs predicted |Δ logprob| outside 1.5x: mpfa@32")


def test_cli_predicted_factor_is_the_allowed_ratio(mpfa, tmp_path: Path):
    """The same far-off prediction passes with a wide enough `--predicted-factor`; a factor <= 1 is refused first."""
    path = tmp_path / "pred.json"
    path.write_text(json.dumps(_prediction({"mpfa": 5.0}) | {"rows": [
        {"backend": "mpfa-qk8tile-psum", "input_len": 32, "error": None, "prefill_mean_abs": 5.0}]}))
    args = ["logits", "--engine", "sim", "--backend", "fa4-bf16,mpfa", "--input-len", "32", "--prompts", "1",
            "--output-len", "2", "--predicted", str(path), *FAST]
    wide = mpfa(*args, "--predicted-factor", "1000000")
    assert wide.returncode == 0, wide.stderr
    assert "measured vs predicted" in wide.stdout
    refused = mpfa.invoke(*args, "--predicted-factor", "1")
    assert refused.returncode == 2 and "--predicted-factor must be > 1" in refused.stderr
    assert "ready" not in refused.stdout


def test_cli_refuses_an_unknown_prefill_kernel_before_serving(mpfa):
    out = mpfa.invoke("logits", "--engine", "sim", "--backend", "fa4-bf16,mpfa", "--input-len", "32",
                      "--prefill-kernel", "mma", *FAST)
    assert out.returncode == 2 and "--prefill-kernel" in out.stderr and "ready" not in out.stdout


def test_cli_refuses_a_bad_prediction_file_before_serving(mpfa, tmp_path: Path):
    path = tmp_path / "pred.json"
    path.write_text("{not json")
    out = mpfa.invoke("logits", "--engine", "sim", "--backend", "fa4-bf16,mpfa", "--input-len", "32", "--predicted",
                      str(path), *FAST)
    assert out.returncode == 2 and "cannot read a prediction JSON" in out.stderr and "ready" not in out.stdout
