"""`mpfa accuracy calibrate-kv` and the `fa3-fp8-calibrated` backend: the command writes the scales a checkpoint
lacked; the backend is listed, starts SGLang with the flag that applies them and refuses a checkpoint without them
in one line, before any server starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")
from mpfa.backends.kv_scales import PROVENANCE_FILE, SGLANG_ARGS, read_kv_scales  # noqa: E402
from mpfa.backends.specs import BACKENDS  # noqa: E402
from mpfa.mpfa_cli.accuracy.random_checkpoint import write_random_checkpoint  # noqa: E402
from mpfa.mpfa_cli.app import app  # noqa: E402
from mpfa.mpfa_cli.errors import UserError  # noqa: E402
from mpfa.mpfa_cli.harness.engines import resolve_backends, sglang_launch  # noqa: E402

REFUSAL = "backend 'fa3-fp8-calibrated' serves only a checkpoint with calibrated FP8 KV scales, and "
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
         "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}


def _checkpoint(tmp_path: Path, name: str = "ckpt") -> Path:
    config = tmp_path / f"{name}-config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(QWEN2))
    return write_random_checkpoint(str(config), tmp_path / name, layers=None, device="cpu")


def test_calibrate_kv_writes_the_scales_the_calibrated_backend_needs(mpfa, tmp_path):
    ckpt = _checkpoint(tmp_path)
    run = mpfa("accuracy", "calibrate-kv", str(ckpt), "--tokenizer", "bytes", "--prompts", "2",
               "--prompt-tokens", "128", "--margin", "1.25")
    assert run.returncode == 0, run.stderr
    assert "calibrated the K and V scales of 2 layers on 256 tokens of Python 3." in run.stdout
    scales = read_kv_scales(ckpt)
    record = json.loads((ckpt / PROVENANCE_FILE).read_text())
    assert record["k_scale"] == scales["k"] and record["margin"] == 1.25 and record["prompts"] == 2
    assert record["text"].endswith("reference documentation topics (pydoc_data.topics), in name order")
    launch = sglang_launch(BACKENDS["fa3-fp8-calibrated"], 30000, str(ckpt), 4096, 1, 1, [])
    flags = launch.command[launch.command.index("--attention-backend"):]
    assert flags == ["--attention-backend", "fa3", "--kv-cache-dtype", "fp8_e4m3", *SGLANG_ARGS]
    plain = sglang_launch(BACKENDS["fa3-fp8"], 30000, str(ckpt), 4096, 1, 1, [])  # scale 1.0 on the same checkpoint
    assert SGLANG_ARGS[0] not in plain.command


def test_the_calibrated_backend_refuses_a_checkpoint_without_scales(mpfa, tmp_path):
    ckpt = _checkpoint(tmp_path)
    bench = mpfa("bench", "--engine", "sglang", "--scenario", "smoke", "-b", "fa3-fp8-calibrated", "--model", str(ckpt))
    assert bench.returncode == 2
    assert bench.stderr.strip().splitlines() == [
        f"error: {REFUSAL}{ckpt} has no kv_scales.safetensors; write them with `mpfa accuracy calibrate-kv DIR`"]
    dummy = mpfa("bench", "--engine", "sglang", "--scenario", "smoke", "-b", "fa3-fp8-calibrated")
    assert dummy.returncode == 2 and f"{REFUSAL}'llama-3.1-8b' is a bundled config (dummy weights);" in dummy.stderr
    # `accuracy serve` checks every backend's checkpoint before it starts the first server (the reference's); the
    # checkpoint is checked before the packages SGLang needs, which this machine may lack
    with pytest.raises(UserError, match=f"{REFUSAL}.* has no kv_scales.safetensors"):
        resolve_backends("fa3-bf16,fa3-fp8-calibrated", "sglang", str(ckpt))
    with pytest.raises(UserError, match=f"{REFUSAL}.* has no kv_scales.safetensors"):
        sglang_launch(BACKENDS["fa3-fp8-calibrated"], 30000, str(ckpt), 4096, 1, 1, [])
    assert [s.name for s in resolve_backends("fa3-fp8-calibrated", "sim", str(ckpt))] == ["fa3-fp8-calibrated"]


def test_bad_calibration_input_is_one_line(tmp_path):
    ckpt = _checkpoint(tmp_path)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({**QWEN2, "architectures": ["LlamaForCausalLM"]}))
    for args, message in [
        ((str(tmp_path),), "not a checkpoint directory (no config.json)"),
        ((str(ckpt), "--device", "gpu"), "--device: 'gpu' is not cpu or cuda"),
        ((str(ckpt), "--tokenizer", "bytes", "--margin", "0.5"), "the margin must be at least 1"),
        ((str(ckpt), "--tokenizer", "bytes", "--prompts", "1000"), "the calibration text fills"),
        ((str(ckpt), "--tokenizer", str(tmp_path / "nowhere")), "neither 'bytes' nor a model directory"),
        ((str(llama), "--tokenizer", "bytes"), "architecture ['LlamaForCausalLM'] is not one whose SGLang loader"),
    ]:
        done = CliRunner().invoke(app, ["accuracy", "calibrate-kv", *args], env={"COLUMNS": "200"})
        assert done.exit_code == 2 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
        assert message in done.stderr, (args, done.stderr)
    assert not (ckpt / PROVENANCE_FILE).exists()


def test_backends_lists_it_with_its_flags(mpfa):
    listed = mpfa("backends")
    assert listed.returncode == 0, listed.stderr
    assert "fa3-fp8-calibrated" in listed.stdout and "--json-model-override-args" in listed.stdout
