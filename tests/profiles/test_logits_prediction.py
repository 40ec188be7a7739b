"""`mpfa.mpfa_cli.accuracy.logits_prediction` (`mpfa accuracy predict-logits`) on a tiny random checkpoint whose
vocabulary holds `mpfa logits`' prompt ids."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from mpfa.mpfa_cli.errors import UserError  # noqa: E402
from mpfa.mpfa_cli.accuracy.logits import prompts_for  # noqa: E402
from mpfa.mpfa_cli.accuracy.random_checkpoint import write_random_checkpoint  # noqa: E402
from mpfa.mpfa_cli.harness.serving_workload import VOCAB_RANGE  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.attention_swap import install  # noqa: E402
from mpfa.mpfa_cli.accuracy.logits_prediction import predict, prompt_sample  # noqa: E402
from mpfa.mpfa_cli.app import app  # noqa: E402

LENGTH = 48


def _checkpoint(directory: Path, vocab: int) -> Path:
    config_dir = directory / "config"
    config_dir.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": 2, "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True}
    (config_dir / "config.json").write_text(json.dumps(config))
    return write_random_checkpoint(str(config_dir), directory / "checkpoint", layers=None, seed=5)


def _predict_logits(*args: str):
    return CliRunner().invoke(app, ["accuracy", "predict-logits", *args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("tiny"), VOCAB_RANGE[1])


@pytest.mark.parametrize("variant", ["bf16", "mpfa"])
def test_a_variant_against_itself_is_exactly_zero(checkpoint, variant):
    prediction = predict(checkpoint, [variant], variant, [LENGTH], 2, seed=0)
    assert len(prediction.rows) == 2
    for row in prediction.rows:
        assert row.error is None and row.prefill_positions == 2 * (LENGTH - 1)
        assert row.prefill_max_abs == 0 and row.prefill_top1_agree == 1.0


def test_mpfa_vs_bf16_differs_a_little(checkpoint, tmp_path):
    out = tmp_path / "prediction.json"
    done = _predict_logits(str(checkpoint), "--input-len", f"{LENGTH},64", "--prompts", "2", "--variant", "mpfa",
                           "--ref", "bf16", "--json", str(out))
    assert done.exit_code == 0, done.output
    assert "Predicted prefill logprobs vs bf16" in done.stdout and f"mpfa {LENGTH} tokens, prompt 1:" in done.stderr
    result = json.loads(out.read_text())
    rows = {(r["backend"], r["input_len"]): r for r in result["rows"]}
    assert set(rows) == {(v, n) for v in ("bf16", "mpfa") for n in (LENGTH, 64)}
    for n in (LENGTH, 64):
        row = rows[("mpfa", n)]
        assert row["prefill_positions"] == 2 * (n - 1)
        assert 0 < row["prefill_mean_abs"] <= row["prefill_p99_abs"] <= row["prefill_max_abs"] < 1
        assert all(math.isfinite(row[k]) for k in ("prefill_mean_abs", "prefill_p99_abs", "prefill_max_abs"))
        assert 0.5 < row["prefill_top1_agree"] <= 1
        reference = result["reference"][str(n)]
        assert reference["prompt_logprob_mean"] < -math.log(VOCAB_RANGE[1]) + 1
        assert reference["prompt_logprob_std"] > 0.01  # not near-uniform: attention can move the logits
        assert result["seconds_per_prompt"]["mpfa"][str(n)] > 0


@torch.inference_mode()
def test_position_i_is_the_logprob_of_token_i_given_the_tokens_before(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    prompt = prompts_for(0, 1, LENGTH)[0]
    logits = model(input_ids=torch.tensor([prompt])).logits[0].double()
    expected = [torch.log_softmax(logits[i - 1], -1)[prompt[i]].item() for i in range(1, LENGTH)]
    sample = prompt_sample(model, install(model, "float64"), prompt)
    assert sample.prompt_logprobs == pytest.approx(expected, abs=1e-4)
    assert sample.prompt_top_ids == logits[:-1].argmax(-1).tolist()


def test_bad_input_is_a_clear_error(checkpoint, tmp_path):
    small = _checkpoint(tmp_path, vocab=512)
    with pytest.raises(UserError, match="past the model's vocabulary of 512"):
        predict(small, ["mpfa"], "bf16", [LENGTH], 1, seed=0)
    with pytest.raises(UserError, match="unknown attention variant fp4"):
        predict(checkpoint, ["fp4"], "bf16", [LENGTH], 1, seed=0)
    with pytest.raises(UserError, match="no config.json"):
        predict(tmp_path / "nothing", ["mpfa"], "bf16", [LENGTH], 1, seed=0)
    done = _predict_logits(str(checkpoint), "--input-len", "1")
    assert done.exit_code == 2
    assert done.stderr == "error: --input-len: every length must be >= 2 (position 0 has no logprob)\n"
