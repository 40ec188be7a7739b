"""Greedy decoding and continuation scoring through the swapped attention, on a tiny random Llama (no download)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mpfa.mpfa_cli.accuracy.tasks.attention_swap import install  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.generation import LoadedModel, choice_logprobs, greedy_answers  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.scoring import continuation_logprobs  # noqa: E402

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


def _greedy_answer(lm: LoadedModel, prompt: list[int], attention, max_new_tokens: int) -> str:
    """One prompt alone: a batch of one row."""
    return greedy_answers(lm, [prompt], attention, max_new_tokens)[0]


def _logprob(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """log p of ``tokens`` [n] under ``logits`` [n, vocab]: a batch of one row."""
    return continuation_logprobs(logits[None], tokens[None])[0]


@torch.inference_mode()
def test_greedy_answers_are_the_argmax_chain():
    lm = _tiny_lm(11)
    prompt = _ids(12, 24)
    answer = _greedy_answer(lm, prompt, install(lm.model, "float64"), max_new_tokens=6)
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
        expected = _logprob(logits[len(context) - 1 : -1], torch.tensor(choice))
        assert score == pytest.approx(expected, rel=2e-3, abs=2e-3)
    with pytest.raises(ValueError, match="at least one token"):
        choice_logprobs(lm, context, [[]], install(lm.model, "bf16"))


# Batched runs: each question must get the numerics of running alone (FP32 summation order aside). KV tiles of 16
# keys make the short prompts span several tiles, so a row whose keys were not compacted to start at tile 0 would
# show up; prompts of different lengths give padded prefills and gaps in the decode steps' cache slots.
BATCH_VARIANTS = ["bf16", "fp8", "qk4-pv8-direct", "mpfa", "qk4-pv4", "float64"]


def _swap(lm: LoadedModel, variant: str):
    attention = install(lm.model, variant)
    attention.block_n = 16
    return attention


@torch.inference_mode()
@pytest.mark.parametrize("variant", BATCH_VARIANTS)
def test_batched_greedy_answers_equal_one_at_a_time(variant):
    lm = _tiny_lm(21)
    prompts = [_ids(22 + i, n) for i, n in enumerate([24, 7, 40, 13, 1])]
    attention = _swap(lm, variant)
    alone = [_greedy_answer(lm, p, attention, max_new_tokens=8) for p in prompts]
    # make one row stop early (at the tokens of its second letter), so later steps carry a finished row's pad token
    lm.model.generation_config.eos_token_id = [0, *(t for t in range(VOCAB) if lm.tokenizer.decode([t]) == alone[1][1])]
    alone = [_greedy_answer(lm, p, attention, max_new_tokens=8) for p in prompts]
    batched = greedy_answers(lm, prompts, attention, max_new_tokens=8)
    assert batched == alone
    assert len(alone[1]) <= 1 and max(len(a) for a in alone) == 8  # rows stopped at different steps


@torch.inference_mode()
def test_greedy_answers_go_past_a_newline_unless_first_line():
    """A newline ends a first-line answer (SQuAD, the needles), not a whole one (the RULER-style lists)."""
    lm = _tiny_lm(11)
    prompt = _ids(12, 24)
    attention = install(lm.model, "float64")
    lm.model.generation_config.eos_token_id = [VOCAB]  # no id stops: every answer runs to max_new_tokens
    whole = greedy_answers(lm, [prompt], attention, 6, first_line=False)[0]
    assert len(whole) == 6
    letter = whole[2]

    class _Lines(_LetterTokenizer):  # the third answer token's letter is now a newline
        def decode(self, ids, skip_special_tokens=False):
            return super().decode(ids, skip_special_tokens).replace(letter, "\n")

    lm = LoadedModel(lm.name, lm.model, _Lines(), lm.device)
    lines = whole.replace(letter, "\n")
    assert greedy_answers(lm, [prompt], attention, 6, first_line=False) == [lines.strip()]
    assert greedy_answers(lm, [prompt], attention, 6) == [lines.split("\n")[0]]


def _choices_one_at_a_time(lm: LoadedModel, context: list[int], choices: list[list[int]], attention) -> list[float]:
    """The unpadded path: the context's prefill, then each choice alone on a copy of its cache (no slot mask)."""
    import copy

    attention.reset()
    ctx = lm.model(input_ids=torch.tensor([context]), use_cache=True)
    scores = []
    for choice in choices:
        out = lm.model(input_ids=torch.tensor([choice]), cache=copy.deepcopy(ctx.cache), use_cache=True)
        logits = torch.cat([ctx.logits[0, -1:], out.logits[0, :-1]])
        scores.append(_logprob(logits, torch.tensor(choice)))
    return scores


@torch.inference_mode()
@pytest.mark.parametrize("variant", BATCH_VARIANTS)
def test_batched_choice_logprobs_equal_one_at_a_time(variant):
    from mpfa.mpfa_cli.accuracy.tasks.generation import batch_choice_logprobs

    lm = _tiny_lm(31)
    questions = [
        (_ids(32, 20), [_ids(33, 3), _ids(34, 1), _ids(35, 5)]),
        (_ids(36, 6), [_ids(37, 2), _ids(38, 4)]),
        (_ids(39, 35), [_ids(40, 1), _ids(41, 1), _ids(42, 6), _ids(43, 2)]),
        (_ids(44, 11), [_ids(45, 4)]),
    ]
    attention = _swap(lm, variant)
    batched = batch_choice_logprobs(lm, questions, attention)
    for (context, choices), scores in zip(questions, batched):
        alone = _choices_one_at_a_time(lm, context, choices, attention)
        assert scores == pytest.approx(alone, rel=0, abs=1e-4)
        assert choice_logprobs(lm, context, choices, attention) == pytest.approx(alone, rel=0, abs=1e-4)


def test_prompt_logits_take_each_rows_own_from_a_cross_indexed_output():
    """transformers 5.12 returns [B, B, 1, V] for per-row `logits_to_keep`; row b's logits are at [b, b]."""
    from types import SimpleNamespace

    from mpfa.mpfa_cli.accuracy.tasks.generation import _prompt_logits

    per_row = torch.randn(3, 1, 5)
    crossed = torch.randn(3, 3, 1, 5)
    for b in range(3):
        crossed[b, b] = per_row[b]
    assert torch.equal(_prompt_logits(SimpleNamespace(logits=crossed), 3), per_row)
    assert torch.equal(_prompt_logits(SimpleNamespace(logits=per_row), 3), per_row)  # 5.2x: already per row
