"""`mpfa.mpfa_cli.accuracy.kv_calibration` on a tiny random Qwen2 checkpoint: each scale is amax / 448 of the keys
(bias and RoPE applied) and values the calibration prompts give, as an independent computation finds them; the
prompts are what they claim; transformers still loads the checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from mpfa.backends.kv_scales import PROVENANCE_FILE, SCALES_FILE, read_kv_scales  # noqa: E402
from mpfa.kernels.formats import E4M3_MAX  # noqa: E402
from mpfa.mpfa_cli.accuracy.kv_calibration import (INSTRUCTION, calibrate_checkpoint, calibration_prompts,  # noqa: E402
                                                   python_docs)
from mpfa.mpfa_cli.accuracy.random_checkpoint import write_random_checkpoint  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, THETA = 3, 2, 16, 10000.0
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
         "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
         "num_hidden_layers": LAYERS, "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "rope_theta": THETA}
PASSAGES = [f"Passage {i}: the river {i} runs past {i * 7} mills." for i in range(60)]


def qwen2_checkpoint(directory: Path) -> Path:
    """A tiny random Qwen2 (K/V projections with biases), its K bias made large as Qwen2.5's are."""
    config = directory.parent / f"{directory.name}-config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(QWEN2))
    out = write_random_checkpoint(str(config), directory, layers=None, seed=4, device="cpu")
    from safetensors.torch import load_file, save_file

    (shard,) = out.glob("model-*.safetensors")
    tensors = load_file(shard)
    for name in [n for n in tensors if n.endswith("k_proj.bias")]:
        tensors[name] = tensors[name] * 200
    save_file(tensors, shard, metadata={"format": "pt"})
    return out


def _rope(x: torch.Tensor) -> torch.Tensor:
    """x [S, H, d] rotated by position, half-split pairs (i, i + d/2), from the config's theta alone."""
    d = x.shape[-1]
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] / THETA ** (torch.arange(0, d, 2) / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


def independent_amax(directory: Path, prompts: list[list[int]], rotate: bool = True) -> tuple[torch.Tensor, ...]:
    """Per layer, the largest |K| and |V| from the K/V projections' outputs (hooks), K rotated here, BF16."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        for op in "kv":
            getattr(layer.self_attn, f"{op}_proj").register_forward_hook(
                lambda _m, _in, out, key=(i, op): outputs.__setitem__(key, out[0].reshape(-1, KV_HEADS, HEAD_DIM)))
    amax = torch.zeros(2, LAYERS)
    for ids in prompts:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
        for i in range(LAYERS):
            k = _rope(outputs[i, "k"].double()) if rotate else outputs[i, "k"]
            for row, x in enumerate((k, outputs[i, "v"])):
                amax[row, i] = max(amax[row, i], x.to(torch.bfloat16).float().abs().max())
    return amax[0], amax[1]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, dict]:
    ckpt = qwen2_checkpoint(tmp_path_factory.mktemp("kv") / "ckpt")
    return ckpt, calibrate_checkpoint(ckpt, ByteTokenizer(), PASSAGES, 2, 96, 1.0, "cpu")


def test_each_scale_is_amax_over_448_of_the_post_rope_keys_and_the_values(calibrated):
    ckpt, record = calibrated
    prompts = calibration_prompts(ByteTokenizer(), PASSAGES, 2, 96)
    k_amax, v_amax = independent_amax(ckpt, prompts)
    scales = read_kv_scales(ckpt)
    one_bf16_step = 2 ** -8  # the captured and the hooked K may round to neighbouring BF16 values
    torch.testing.assert_close(torch.tensor(scales["k"]), k_amax / E4M3_MAX, rtol=one_bf16_step, atol=0)
    torch.testing.assert_close(torch.tensor(scales["v"]), v_amax / E4M3_MAX, rtol=one_bf16_step, atol=0)
    unrotated, _ = independent_amax(ckpt, prompts, rotate=False)
    assert ((unrotated - k_amax).abs() > 4 * one_bf16_step * k_amax).any()  # RoPE moved the amax: it is checked
    assert record["k_amax"] == pytest.approx(k_amax.tolist(), rel=one_bf16_step)
    assert {key: record[key] for key in ("prompts", "tokens_per_prompt", "tokens", "margin", "tokenizer")} == {
        "prompts": 2, "tokens_per_prompt": 96, "tokens": 192, "margin": 1.0, "tokenizer": "bytes"}
    assert json.loads((ckpt / PROVENANCE_FILE).read_text()) == record


def test_a_margin_scales_every_scale(calibrated, tmp_path):
    ckpt, record = calibrated
    wider = qwen2_checkpoint(tmp_path / "wider")
    calibrate_checkpoint(wider, ByteTokenizer(), PASSAGES, 2, 96, 1.5, "cpu")
    assert read_kv_scales(wider)["v"] == pytest.approx([s * 1.5 for s in record["v_scale"]], rel=1e-6)
    with pytest.raises(ValueError, match="margin must be at least 1"):
        calibrate_checkpoint(wider, ByteTokenizer(), PASSAGES, 2, 96, 0.9, "cpu")


def test_transformers_loads_the_calibrated_checkpoint_as_before(calibrated, tmp_path):
    ckpt, _ = calibrated
    plain = qwen2_checkpoint(tmp_path / "plain")  # the same seed: the same weights
    ids = torch.tensor([calibration_prompts(ByteTokenizer(), PASSAGES, 1, 96)[0]])
    before = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    after, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    assert sorted(info["unexpected_keys"]) == sorted(scale_names(ckpt))
    with torch.inference_mode():
        assert torch.equal(before(input_ids=ids).logits, after(input_ids=ids).logits)


def scale_names(ckpt: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(ckpt / SCALES_FILE, "pt") as f:
        return list(f.keys())


def test_prompts_are_chat_turns_of_the_length_asked_reading_each_passage_once():
    tok = ByteTokenizer()
    prompts = calibration_prompts(tok, PASSAGES, 3, 160)
    assert [len(p) for p in prompts] == [160] * 3
    head = tok.chat_ids(INSTRUCTION, [0])  # 0: no byte's id, so it marks where the body goes
    body_at = head.index(0)
    tail = len(head) - body_at - 1
    bodies = [p[body_at:len(p) - tail] for p in prompts]
    assert all(p[:body_at] == head[:body_at] for p in prompts)
    read = tok.decode([t for body in bodies for t in body])
    assert read.startswith(PASSAGES[0]) and read.count(PASSAGES[1]) == 1
    with pytest.raises(ValueError, match="the calibration text fills 0 prompts of 10000 tokens, not 1"):
        calibration_prompts(tok, PASSAGES[:2], 1, 10_000)
    with pytest.raises(ValueError, match="do not hold the calibration prompt's chat turn"):
        calibration_prompts(tok, PASSAGES, 1, 5)
    with pytest.raises(ValueError, match="at least one prompt"):
        calibration_prompts(tok, PASSAGES, 0, 80)


def test_python_s_documentation_holds_the_default_calibration():
    """`calibrate-kv`'s defaults, 8 prompts of 4,096 tokens, even at one token per byte; the same topics each time."""
    docs = python_docs()
    assert docs == python_docs() and len(set(docs)) == len(docs)
    assert len(calibration_prompts(ByteTokenizer(), docs, 8, 4096)) == 8
