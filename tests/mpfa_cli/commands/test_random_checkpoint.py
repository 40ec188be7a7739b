"""`mpfa.mpfa_cli.accuracy.random_checkpoint` (`mpfa accuracy random-checkpoint`) on tiny configs: loadable by
transformers, deterministic, the distribution asked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from mpfa.mpfa_cli.errors import UserError  # noqa: E402
from mpfa.mpfa_cli.accuracy.random_checkpoint import MARKER, parameter_shapes, write_random_checkpoint  # noqa: E402
from mpfa.mpfa_cli.app import app  # noqa: E402
from mpfa.scenarios import MODEL_DIR  # noqa: E402

TINY = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False},
    # q_norm / k_norm, and an lm_head tied to the embedding (stored once)
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": True},
}


def tiny_config(directory: Path, kind: str = "llama") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {**TINY[kind], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 512,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _random_checkpoint(*args: str):
    return CliRunner().invoke(app, ["accuracy", "random-checkpoint", *args], env={"COLUMNS": "200"})


def tensors(out: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


@pytest.mark.parametrize("kind", sorted(TINY))
def test_transformers_loads_it_without_missing_or_unexpected_keys(tmp_path, kind):
    out = write_random_checkpoint(str(tiny_config(tmp_path / "cfg", kind)), tmp_path / "ckpt", layers=None, seed=3)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    stored = tensors(out)
    assert set(stored) == {name for name, _ in model.named_parameters()}
    assert ("lm_head.weight" in stored) == (kind == "llama")  # the tied one is stored once, as the embedding
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    for name, param in model.named_parameters():
        assert torch.equal(param, stored[name].float()), name
    config = json.loads((out / "config.json").read_text())
    assert config[MARKER] == {"seed": 3, "std": 0.02, "source": str(tmp_path / "cfg"), "device": "cpu"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in stored.values())


def test_norms_are_ones_and_the_rest_has_the_std_asked(tmp_path):
    out = write_random_checkpoint(str(tiny_config(tmp_path / "cfg", "qwen3")), tmp_path / "ckpt", layers=None,
                                  std=0.05)
    stored = tensors(out)
    norms = [name for name in stored if "norm" in name]
    assert {n.rsplit(".", 2)[-2] for n in norms} == {"input_layernorm", "post_attention_layernorm", "q_norm",
                                                     "k_norm", "norm"}
    for name in norms:
        assert torch.equal(stored[name], torch.ones_like(stored[name])), name
    drawn = {name: t.double() for name, t in stored.items() if name not in norms}
    for name, values in drawn.items():  # >= 2048 values each: the std within ~2% (1 sigma)
        assert abs(values.std().item() / 0.05 - 1) < 0.15, name
    pooled = torch.cat([values.flatten() for values in drawn.values()])  # ~1e5 values
    assert abs(pooled.std().item() / 0.05 - 1) < 0.01 and abs(pooled.mean().item()) < 0.05 * 0.01


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    config = str(tiny_config(tmp_path / "cfg"))
    first, again, other = (write_random_checkpoint(config, tmp_path / name, layers=None, seed=seed)
                           for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    shards = sorted(p.name for p in first.glob("*.safetensors"))
    assert shards == sorted(p.name for p in again.glob("*.safetensors"))
    assert all((first / s).read_bytes() == (again / s).read_bytes() for s in shards)
    a, c = tensors(first), tensors(other)
    for name in a:
        assert torch.equal(a[name], c[name]) == ("norm" in name), name
    # no two parameters share values (each has its own generator)
    firsts = [t.flatten()[:8] for name, t in a.items() if "norm" not in name]
    assert len({tuple(t.tolist()) for t in firsts}) == len(firsts)


def test_layers_override_keeps_the_shared_parameters(tmp_path):
    config = str(tiny_config(tmp_path / "cfg"))
    two = tensors(write_random_checkpoint(config, tmp_path / "two", layers=None))
    one_dir = write_random_checkpoint(config, tmp_path / "one", layers=1)
    three_dir = write_random_checkpoint(config, tmp_path / "three", layers=3)
    assert json.loads((one_dir / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((three_dir / "config.json").read_text())["num_hidden_layers"] == 3
    one, three = tensors(one_dir), tensors(three_dir)
    assert not any(".layers.1." in name for name in one) and any(".layers.2." in name for name in three)
    assert set(one) < set(two) < set(three)
    assert all(torch.equal(one[name], two[name]) and torch.equal(two[name], three[name]) for name in one)


def test_shards_stay_under_the_limit_and_load(tmp_path):
    out = write_random_checkpoint(str(tiny_config(tmp_path / "cfg")), tmp_path / "ckpt", layers=None,
                                  shard_bytes=100_000)
    embedding_bytes = 512 * 64 * 2  # 65536: two of them do not fit one shard
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 3
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    assert all(p.stat().st_size < 100_000 + 10_000 for p in shards)  # data plus a small header
    assert sum(p.stat().st_size for p in shards) > 2 * embedding_bytes
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_bundled_llama_8b_has_its_8b_parameters():
    config = json.loads((MODEL_DIR / "llama-3.1-8b" / "config.json").read_text())
    shapes = parameter_shapes(config)
    assert len(shapes) == 32 * 9 + 3
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert shapes["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    assert sum(s.numel() for s in shapes.values()) == 8_030_261_248


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    cases = [
        (["--model", "no-such-model", "--out", str(tmp_path / "o1")], "model 'no-such-model' is neither"),
        (["--model", str(tiny_config(tmp_path / "cfg")), "--out", str(taken)], "exists and is not an empty directory"),
        (["--model", str(tmp_path / "cfg"), "--out", str(tmp_path / "o2"), "--layers", "0"], "--layers must be >= 1"),
        (["--model", str(tmp_path / "cfg"), "--out", str(tmp_path / "o4"), "--dtype", "fp8"], "--dtype: 'fp8'"),
        (["--model", str(tmp_path / "cfg"), "--out", str(tmp_path / "o5"), "--device", "tpu"], "--device: 'tpu'"),
    ]
    for argv, message in cases:
        done = _random_checkpoint(*argv)
        assert done.exit_code == 2
        err = done.stderr
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o4", "o5"))
    assert sorted(p.name for p in taken.iterdir()) == ["x"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(UserError, match="transformers cannot build a causal LM"):
        write_random_checkpoint(str(bad), tmp_path / "o3", layers=None)
    assert not (tmp_path / "o3").exists()


def test_the_command_prints_the_directory_and_its_bytes(tmp_path):
    out = tmp_path / "ckpt"
    done = _random_checkpoint("--model", str(tiny_config(tmp_path / "cfg")), "--out", str(out), "--layers", "1",
                              "--dtype", "float32", "--std", "0.5", "--seed", "7", "--device", "cpu")
    assert done.exit_code == 0, done.output
    total = sum(p.stat().st_size for p in out.iterdir())
    assert done.stdout == f"{out} {total} bytes\n"
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["torch_dtype"] == "float32"
    assert config[MARKER] == {"seed": 7, "std": 0.5, "source": str(tmp_path / "cfg"), "device": "cpu"}
