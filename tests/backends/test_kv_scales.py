"""Calibrated KV scales in a checkpoint: the tensors SGLang loads (names, float32 scalars, listed in the index), the
launch flag that makes it load them, and every way a checkpoint can lack them."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from mpfa.backends.kv_scales import (INDEX_FILE, PROVENANCE_FILE, SCALES_FILE, SGLANG_ARGS, KVScalesError,  # noqa: E402
                                     read_kv_scales, scale_name, write_kv_scales)

K, V = [0.5, 0.25, 0.125], [1.0, 2.0, 0.75]


def _checkpoint(directory: Path, layers: int = len(K), index: bool = False) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                       "num_hidden_layers": layers}))
    if index:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "w.bin"}}))
    return directory


def test_one_float32_scalar_per_layer_and_operand_under_the_names_sglang_loads(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    record = write_kv_scales(ckpt, K, V, {"text": "passages", "margin": 1.0})
    stored = load_file(ckpt / SCALES_FILE)
    assert set(stored) == {f"model.layers.{i}.self_attn.attn.{op}_scale" for i in range(len(K)) for op in "kv"}
    for i in range(len(K)):
        for op, values in (("k", K), ("v", V)):
            tensor = stored[scale_name(i, op)]
            assert tensor.dtype == torch.float32 and tensor.shape == () and float(tensor) == values[i]
    assert read_kv_scales(ckpt) == {"k": K, "v": V}
    assert json.loads((ckpt / PROVENANCE_FILE).read_text()) == record == {"text": "passages", "margin": 1.0,
                                                                          "k_scale": K, "v_scale": V}


def test_a_sharded_checkpoint_s_index_lists_the_scales(tmp_path):
    """SGLang loads only the files a checkpoint's index names."""
    ckpt = _checkpoint(tmp_path / "ckpt", index=True)
    write_kv_scales(ckpt, K, V, {})
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    assert weight_map["lm_head.weight"] == "w.bin"
    assert {name for name, file in weight_map.items() if file == SCALES_FILE} == set(load_file(ckpt / SCALES_FILE))
    assert read_kv_scales(ckpt)["k"] == K


def test_the_flag_switches_on_a_kv_cache_method_and_quantizes_no_module():
    flag, value = SGLANG_ARGS
    assert flag == "--json-model-override-args"
    assert json.loads(value) == {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                         "kv_cache_quant_algo": "FP8", "ignore": ["*"]}}


@pytest.mark.parametrize(("k", "v", "message"), [
    (K[:2], V, "2 K scales for 3 layers"),
    (K, [1.0, 0.0, 1.0], "layer 1: V scale 0.0 is not a positive number"),
    (K, [1.0, 1.0, math.nan], "layer 2: V scale nan"),
    ([-1.0, 1.0, 1.0], V, "layer 0: K scale -1.0"),
])
def test_scales_that_sglang_would_refuse_are_not_written(tmp_path, k, v, message):
    ckpt = _checkpoint(tmp_path / "ckpt")
    with pytest.raises(KVScalesError, match=message):
        write_kv_scales(ckpt, k, v, {})
    assert not (ckpt / SCALES_FILE).exists()


def test_every_way_to_lack_scales_is_one_line(tmp_path):
    with pytest.raises(KVScalesError, match="has no kv_scales.safetensors"):
        read_kv_scales(_checkpoint(tmp_path / "none"))
    with pytest.raises(KVScalesError, match="no config.json with num_hidden_layers"):
        write_kv_scales(tmp_path, K, V, {})
    partial = _checkpoint(tmp_path / "partial")
    save_file({scale_name(i, "k"): torch.tensor(1.0) for i in range(len(K))}, partial / SCALES_FILE)
    with pytest.raises(KVScalesError, match=r"model.layers.0.self_attn.attn.v_scale is missing"):
        read_kv_scales(partial)
    wide = _checkpoint(tmp_path / "wide")
    save_file({scale_name(i, op): torch.ones(2) for i in range(len(K)) for op in "kv"}, wide / SCALES_FILE)
    with pytest.raises(KVScalesError, match=r"model.layers.0.self_attn.attn.k_scale is not one value"):
        read_kv_scales(wide)
    unlisted = _checkpoint(tmp_path / "unlisted", index=True)
    write_kv_scales(unlisted, K, V, {})
    (unlisted / INDEX_FILE).write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(KVScalesError, match="does not list kv_scales.safetensors, so SGLang would not load it"):
        read_kv_scales(unlisted)
    fewer_layers = _checkpoint(tmp_path / "fewer", layers=len(K) + 1)
    save_file({scale_name(i, op): torch.tensor(1.0) for i in range(len(K)) for op in "kv"},
              fewer_layers / SCALES_FILE)
    with pytest.raises(KVScalesError, match=f"model.layers.{len(K)}.self_attn.attn.k_scale is missing"):
        read_kv_scales(fewer_layers)
    llama = _checkpoint(tmp_path / "llama")
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3}))
    with pytest.raises(KVScalesError, match=r"architecture \['LlamaForCausalLM'\] is not one whose SGLang loader"):
        write_kv_scales(llama, K, V, {})
    damaged = _checkpoint(tmp_path / "damaged")
    (damaged / SCALES_FILE).write_bytes(b"not safetensors")
    with pytest.raises(KVScalesError, match="unreadable"):
        read_kv_scales(damaged)
