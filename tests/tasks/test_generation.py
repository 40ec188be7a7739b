"""Greedy decoding and continuation scoring through the swapped attention, on a tiny random Llama (no download)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mpfa.kernels.tasks.attention_swap import install  # noqa: E402
from mpfa.kernels.tasks.generation import LoadedModel, choice_logprobs, greedy_answer  # noqa: E402
from mpfa.kernels.tasks.scoring import continuation_logprob  # noqa: E402

VOCAB = 64


class _LetterTokenizer:
    """Token t is the letter chr(ord('a') + t % 26); token 10 ('k') is the newline, 0 the end of sequence."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("\n" if t == 10 else chr(ord("a") + t % 26) for t in ids if t != 0 or not skip_special_tokens)


def _tiny_lm(seed: int) -> LoadedModel:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return LoadedModel("tiny", model, _LetterTokenizer(), torch.device("cpu"))


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(11, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def test_greedy_answer_is_the_argmax_chain():
    lm = _tiny_lm(11)
    prompt = _ids(12, 24)
    answer = greedy_answer(lm, prompt, install(lm.model, "float64"), max_new_tokens=6)
    # reference: recompute every step from scratch with the model's own attention, no cache
    lm.model.set_attn_implementation("sdpa")
    ids, expected = list(prompt), []
    for _ in range(6):
        token = int(lm.model(torch.tensor([ids])).logits[0, -1].argmax())
        if token == 0 or token == 10:
            break
        ids.append(token)
        expected.append(token)
    assert len(expected) >= 2  # the check below compares a real multi-step decode
    assert answer == lm.tokenizer.decode(expected)


@torch.inference_mode()
def test_choice_logprobs_match_a_full_forward_and_choices_do_not_leak():
    lm = _tiny_lm(13)
    context, choices = _ids(14, 20), [_ids(15, 3), _ids(16, 1), _ids(17, 5)]
    scores = choice_logprobs(lm, context, choices, install(lm.model, "bf16"))
    lm.model.set_attn_implementation("sdpa")
    for choice, score in zip(choices, scores):
        logits = lm.model(torch.tensor([context + choice])).logits[0]
        expected = continuation_logprob(logits[len(context) - 1 : -1], torch.tensor(choice))
        assert score == pytest.approx(expected, rel=2e-3, abs=2e-3)
    with pytest.raises(ValueError, match="at least one token"):
        choice_logprobs(lm, context, [[]], install(lm.model, "bf16"))
