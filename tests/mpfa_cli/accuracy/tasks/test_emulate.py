"""`emulate_cells` on a tiny random Llama (no download): each question's answer and score are those of running it
alone through the swapped attention, whatever the batch; choices are picked by their log-likelihood."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mpfa.mpfa_cli.accuracy.tasks.attention_swap import install  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.emulate import emulate_cells  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.generation import LoadedModel, choice_logprobs, greedy_answers  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.items import ChoiceItem, GenerationItem  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.scoring import best_choice  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.task_sets import Cell  # noqa: E402


class _Letters:
    """Token t is chr(ord('a') + t % 26); 0 ends the sequence."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids if t != 0 or not skip_special_tokens)


@torch.inference_mode()
def test_emulated_answers_are_each_question_alone():
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    lm = LoadedModel("tiny", model, _Letters(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    prompts = [tuple(torch.randint(11, 64, (n,), generator=gen).tolist()) for n in (20, 9, 14)]
    first = [greedy_answers(lm, [list(p)], install(model, "mpfa"), 5)[0] for p in prompts]
    items = tuple(GenerationItem("niah-single", f"q{i}", p, (a[:2] if i else "zzz",), "contains")
                  for i, (p, a) in enumerate(zip(prompts, first)))
    choice = ChoiceItem("social_iqa", "c0", prompts[1], ((12, 13), (14,), (15, 16, 17)), frozenset({0}))
    cells = [Cell("niah-single", 64, items, max_new_tokens=5), Cell("social_iqa", None, (choice,))]
    seen = []
    out = emulate_cells(lm, cells, ["bf16", "mpfa"], lambda v: install(model, v), batch_size=2,
                        progress=lambda *args: seen.append(args), batch_tokens=20)
    done = {(variant, key): (scores, answers) for variant, key, scores, answers in out}
    # the shortest cell first, every variant of a cell before the next
    assert list(done) == [("bf16", "social_iqa"), ("mpfa", "social_iqa"), ("bf16", "niah-single@64"),
                          ("mpfa", "niah-single@64")]
    scores, answers = done[("mpfa", "niah-single@64")]
    assert answers == first and scores == [0.0, 1.0, 1.0]  # "zzz" is not in the first answer
    pick = best_choice(choice_logprobs(lm, list(choice.context), [list(c) for c in choice.choices],
                                       install(model, "bf16")))
    assert done[("bf16", "social_iqa")] == ([float(pick == 0)], [pick])
    # 20 prompt tokens per call: the 20-token prompt alone, then the 14- and 9-token ones one by one
    assert [count for variant, key, count, _ in seen if (variant, key) == ("mpfa", "niah-single@64")] == [1, 2, 3]
