"""`mpfa accuracy emulate` end to end on a CPU: a tiny random Llama with a byte-level tokenizer saved as a model
directory (no download), the needle cells built from the planted essays. The cells come shortest first; Ctrl-C
stores the cells done so far, with where they were computed, and the stored result exports and imports."""
from __future__ import annotations

import json
import signal
import time

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture
def model_dir(tmp_path, task_cache):
    """A 2-layer Llama (random weights) and a byte-level BPE tokenizer with a chat template, trained on the essays."""
    from transformers import PreTrainedTokenizerFast

    essays = (task_cache / "models" / "text" / "paul_graham_essays.txt").read_text()
    raw = tokenizers.ByteLevelBPETokenizer()
    raw.train_from_iterator([essays], vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw._tokenizer, eos_token="<|im_end|>")
    tok.chat_template = "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}assistant:"
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id)
    path = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_emulate_asks_the_shortest_cells_first_and_ctrl_c_keeps_the_cells_done(mpfa, model_dir):
    proc = mpfa.popen("accuracy", "emulate", "--model", str(model_dir), "--variants", "bf16,mpfa-qk8tile-psum",
                      "--cells", "niah-multikey@2000=400,niah-single@300=2", "--max-new-tokens", "4")
    done, deadline = [], time.time() + 120
    for line in proc.stdout:
        done.append(line.split(":")[0])
        if line.startswith("mpfa-qk8tile-psum niah-single@300: ") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["error: interrupted"]
    assert done[-2:] == ["bf16 niah-single@300", "mpfa-qk8tile-psum niah-single@300"]  # the short cell first
    (stored,) = json.loads(mpfa.invoke("accuracy", "served", "1", "--format", "json").stdout)
    assert stored["interrupted"] and stored["params"]["status"] == "interrupted"
    assert stored["params"]["limit"] == {"niah-multikey@2000": 400, "niah-single@300": 2}
    assert {v: sorted(cells) for v, cells in stored["scores"].items()} == {
        "bf16": ["niah-single@300"], "mpfa-qk8tile-psum": ["niah-single@300"]}
    assert [len(c["ids"]) for c in stored["cells"]] == [400, 2]  # every cell asked, in the order given
    where = stored["provenance"]["mpfa-qk8tile-psum"]
    assert where["gpu"] == "cpu" and where["kernels"] == {"emulated": "mpfa-qk8tile-psum"} and where["date"]
    export = mpfa.tmp / "emulated.json"
    assert mpfa.invoke("accuracy", "served", "1", "--format", "json", "-o", str(export)).returncode == 0
    imported = mpfa.invoke("accuracy", "import", str(export), "--db", str(mpfa.tmp / "elsewhere.db"))
    assert imported.returncode == 0, imported.stderr
