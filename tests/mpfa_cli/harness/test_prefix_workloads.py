"""The workloads that share prefixes: exact token counts, sharing exactly as declared, none by accident."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.prefix_workloads import MultiTurn, SharedPrefix
from mpfa.mpfa_cli.harness.scenario import available_scenarios, load_scenario
from mpfa.mpfa_cli.harness.serving_workload import make_prompts
from mpfa.mpfa_cli.harness.sim_prefix_cache import common_prefix

PAGE = 128


def _shared(a: list[int], b: list[int]) -> int:
    return common_prefix(np.asarray(a), np.asarray(b))


def test_shared_prefix_shares_exactly_its_prefix_within_a_group_and_nothing_else() -> None:
    layout = SharedPrefix(groups=3, prefix_len=300, suffix_len=40, per_group=4)
    measured, warmup = layout.prompts(seed=7, run=0, warmup=5, max_warmup=5)
    assert len(measured) == 12 and len(warmup) == 5
    assert all(len(p) == 340 for p in measured + warmup)
    group = [i % 3 for i in range(12)]  # round-robin: every group's first request before any group's second
    assert group[:3] == [0, 1, 2]
    for (i, a), (j, b) in itertools.combinations(enumerate(measured), 2):
        assert _shared(a, b) == (300 if group[i] == group[j] else 0)
    for a in measured:
        assert all(_shared(a, w) == 0 for w in warmup)
    later_run, _ = layout.prompts(seed=7, run=1, warmup=0, max_warmup=5)
    assert all(_shared(a, b) == 0 for a in measured + warmup for b in later_run)
    assert layout.prompts(seed=7, run=0, warmup=5, max_warmup=5) == (measured, warmup)


@pytest.mark.parametrize("page, expected", [(1, 3 * 3 * 300), (128, 3 * 3 * 256)])
def test_shared_prefix_declares_whole_pages_of_the_prefix_for_all_but_each_groups_first(page, expected) -> None:
    assert SharedPrefix(groups=3, prefix_len=300, suffix_len=40, per_group=4).expected_cached_tokens(page) == expected


def test_multi_turn_prompt_lengths_and_declared_hits() -> None:
    talk = MultiTurn(conversations=2, turns=3, user_len=100, think_time_s=0.5)
    assert [talk.prompt_len(t, 20) for t in (1, 2, 3)] == [100, 220, 340]
    # turn t+1 finds turn t's prompt and answer but the answer's last token, in whole pages
    assert talk.expected_cached_tokens(1, 20) == 2 * ((100 + 19) + (220 + 19))
    assert talk.expected_cached_tokens(PAGE, 20) == 2 * (0 + 128)


def test_multi_turn_user_messages_share_nothing_across_conversations_and_runs() -> None:
    talk = MultiTurn(conversations=3, turns=2, user_len=50)
    firsts = [talk.user_tokens(1, run, c, 1, max_warmup=2) for run in (0, 1) for c in range(5)]
    assert all(len(m) == 50 for m in firsts)
    assert len({m[0] for m in firsts}) == len(firsts)  # distinct first tokens: not even one token is shared
    assert len(talk.user_tokens(1, 0, 0, 2, max_warmup=2)) == 50


def test_bundled_sharing_scenarios() -> None:
    shared = load_scenario("shared-prefix")
    assert shared.workload == SharedPrefix(groups=1, prefix_len=32768, suffix_len=256, per_group=8)
    assert (shared.input_len, shared.num_requests) == ([33024], 8)
    talk = load_scenario("multi-turn")
    assert isinstance(talk.workload, MultiTurn) and talk.input_len[0] + talk.output_len <= 128 * 1024
    assert talk.input_len[0] > 60 * 1024 and talk.num_requests == talk.workload.conversations * talk.workload.turns


def test_plain_scenarios_share_no_first_page() -> None:
    """Every other bundled scenario's prompts (measured and warmup, every point) are unshareable: no two share their
    first page of 128 tokens (and they are served with the prefix cache off)."""
    for name in available_scenarios():
        scenario = load_scenario(name)
        if scenario.shares_prefixes:
            continue
        firsts = set()
        for point in scenario.points():
            for seed, count in ((scenario.seed, point.num_requests), (scenario.seed + 1, scenario.warmup_requests)):
                firsts |= {(len(p), tuple(p[:PAGE])) for p in make_prompts(seed, count, point.input_len)}
        pages = [page for _, page in firsts]
        assert len(set(pages)) == len(pages), name


@pytest.mark.parametrize("text, message", [
    ("[shared_prefix]\ngroups = 1\nprefix_len = 8\nsuffix_len = 8\nper_group = 2\n"
     "[multi_turn]\nconversations = 1\nturns = 2\nuser_len = 8\n", "not both"),
    ("input_len = 64\n[shared_prefix]\ngroups = 1\nprefix_len = 8\nsuffix_len = 8\nper_group = 2\n",
     "input_len do not apply"),
    ("[shared_prefix]\ngroups = 1\nprefix_len = 8\nsuffix_len = 0\nper_group = 2\n", "suffix_len must be >= 1"),
    ("[shared_prefix]\ngroups = 1\nprefix_len = 8\nper_group = 2\n", "missing field(s) suffix_len"),
    ("[shared_prefix]\ngroups = 1\nprefix_len = 8\nsuffix_len = 8\nper_group = 2\nshare = 1\n", "unknown field"),
    ("[multi_turn]\nconversations = 1\nturns = 20\nuser_len = 8000\n", "exceeds 131072 tokens"),
    ("[multi_turn]\nconversations = 1\nturns = 2\nuser_len = 8\nthink_time_s = -1\n", "think_time_s must be >= 0"),
])
def test_bad_sharing_tables_are_one_line_errors(tmp_path, text, message) -> None:
    path = tmp_path / "s.toml"
    path.write_text('model = "llama-3.1-8b"\noutput_len = 16\nconcurrency = [1]\n' + text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_scenario(str(path))


def test_multi_turn_runs_at_a_concurrency_not_a_rate(tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('model = "llama-3.1-8b"\noutput_len = 16\nconcurrency = [1]\n'
                    "[multi_turn]\nconversations = 1\nturns = 2\nuser_len = 8\n")
    with pytest.raises(UserError, match="not a rate"):
        load_scenario(str(path), {"rate": [1.0], "concurrency": None})
