"""RULER-style tasks with the byte tokenizer (every token known): exact prompt lengths at 4K-32K, every expected
string in the prompt as the task declares it, determinism per seed, distinct questions, answer budgets that hold the
answers, and the score of right, partial and wrong answers."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from mpfa.mpfa_cli.accuracy.tasks.data import TaskDataError
from mpfa.mpfa_cli.accuracy.tasks.long_context import DEPTHS, Haystack
from mpfa.mpfa_cli.accuracy.tasks.ruler import (COMMON_REPEATS, COMMON_WORDS, DOTS, FREQUENT_WORDS, HOPS, NEEDLE,
                                                RULER_TASKS, RulerSource, ruler_items)
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer

TOK = ByteTokenizer()
LENGTHS = (4096, 8192, 16384, 32768)
QUESTIONS = 12


@pytest.fixture(scope="module")
def src(essay_words) -> RulerSource:
    return RulerSource.from_essays(TOK, Haystack.from_text(TOK, essay_words), essay_words)


def _text(item) -> str:
    return TOK.decode(item.prompt)


def _body(item, end: str) -> str:
    """The prompt between the instruction's blank line and the question (`end`: the question's start)."""
    text = _text(item)
    return text[text.index("\n", text.index("User:")) + 1: text.rindex(end)]


def _count(text: str, word: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(word)}(?!\w)", text))


def _check_multikey(item) -> None:
    text = _text(item)
    key = re.search(r"special magic number for (\S+) mentioned", text)[1]
    (value,) = item.answers
    assert text.count(NEEDLE.format(key=key, value=value)) == 1 and _count(text, value) == 1
    needles = re.findall(r"numbers for (\S+) is: (\d+)\.", text)
    assert len(needles) > 20  # many distractor needles, every key and value once
    assert len({k for k, _ in needles}) == len(needles) and len({v for _, v in needles}) == len(needles)


def _check_essay_needles(keys: int):
    def check(item) -> None:
        text = _text(item)
        asked = re.search(r"magic numbers for (.+) mentioned", text)[1].replace(" and ", ", ").split(", ")
        assert len(asked) == keys and len(item.answers) == 4 and len(set(item.answers)) == 4
        per_key = 4 // keys
        for i, value in enumerate(item.answers):  # each key's values in order, each once
            assert text.count(NEEDLE.format(key=asked[i // per_key], value=value)) == 1 and _count(text, value) == 1
        assert text.count("One of the special magic numbers") == 4
    return check


def _check_variables(item) -> None:
    text = _text(item)
    value = re.search(r"assigned the value (\d+) in", text)[1]
    names = item.answers
    assert len(names) == HOPS + 1 and len(set(names)) == len(names)
    chain = [f"VAR {names[0]} = {value}", *(f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:]))]
    positions = [text.index(line + "\n") for line in chain]
    assert positions == sorted(positions)  # each assignment after the one it reads
    assert all(text.count(line) == 1 for line in chain) and len(re.findall("^VAR ", text, re.M)) == len(chain)


def _check_common_words(item) -> None:
    listed = re.findall(r"\n(\d+)\. (\S+)", _body(item, "\n\nQuestion:"))
    assert [int(n) for n, _ in listed] == list(range(1, len(listed) + 1))  # numbered in order
    counts = Counter(word for _, word in listed)
    assert len(item.answers) == COMMON_WORDS and all(counts[w] == COMMON_REPEATS for w in item.answers)
    assert max(n for w, n in counts.items() if w not in item.answers) < COMMON_REPEATS


def _check_frequent_words(item) -> None:
    counts = Counter(_body(item, "\n\nQuestion:").split())
    ranked = [w for w, _ in counts.most_common() if w != DOTS]
    assert counts.most_common(1)[0][0] == DOTS  # the noise outnumbers every coded word
    assert len(item.answers) == FREQUENT_WORDS and set(item.answers) == set(ranked[:FREQUENT_WORDS])
    assert min(counts[w] for w in item.answers) > counts[ranked[FREQUENT_WORDS]]  # the three stand apart


CHECKS = {"ruler-mk": _check_multikey, "ruler-mv": _check_essay_needles(keys=1),
          "ruler-mq": _check_essay_needles(keys=4), "ruler-vt": _check_variables,
          "ruler-cwe": _check_common_words, "ruler-fwe": _check_frequent_words}


def test_every_task_is_checked():
    assert set(CHECKS) == set(RULER_TASKS)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", RULER_TASKS)
def test_prompts_have_the_exact_length_and_their_answers_as_declared(src, task, length):
    items = ruler_items(src, task, length, QUESTIONS, seed=3)
    for index, item in enumerate(items):
        assert len(item.prompt) == length and item.length == length and item.metric == "share"
        assert item.id == f"{task}-{length}-{index}" and item.task == task
        assert all(_count(_text(item), answer) >= 1 for answer in item.answers)
        CHECKS[task](item)
    # distinct questions: no two prompts alike, no two asking for the same strings
    assert len({it.prompt for it in items}) == QUESTIONS and len({it.answers for it in items}) == QUESTIONS


def test_multikey_asks_at_the_questions_depth(src):
    items = ruler_items(src, "ruler-mk", 4096, 20)
    assert [it.depth for it in items] == [*DEPTHS, *DEPTHS]
    positions = []
    for it in items[:10]:
        body = _body(it, "\n\nWhat is")
        positions.append(body.index(NEEDLE.format(key=re.search(r"number for (\S+) mentioned", _text(it))[1],
                                                  value=it.answers[0])) / len(body))
    assert positions == sorted(positions) and positions[0] < 0.02 and positions[-1] > 0.95


@pytest.mark.parametrize("task", RULER_TASKS)
def test_questions_are_deterministic_per_seed(src, task):
    items = ruler_items(src, task, 4096, 6, seed=3)
    assert ruler_items(src, task, 4096, 6, seed=3) == items
    assert ruler_items(src, task, 4096, 2, seed=3, first=4) == items[4:]
    other = ruler_items(src, task, 4096, 6, seed=4)
    assert all(a.prompt != b.prompt and a.answers != b.answers for a, b in zip(items, other))


@pytest.mark.parametrize("task", RULER_TASKS)
def test_the_answer_budget_holds_the_answer_as_asked(src, task):
    """Written as the question asks (comma-separated), every expected string fits the task's budget with one token
    per byte; the answer text scores 1, half of it 0.5, none of it 0, over lines too."""
    (item,) = ruler_items(src, task, 8192, 1)
    said = ", ".join(item.answers)
    assert len(TOK.encode(said)) <= RULER_TASKS[task].answer_tokens
    assert item.score(f"The answer: {said}.") == 1.0
    assert item.score("\n".join(item.answers)) == 1.0 and not item.first_line  # the whole answer is scored
    if len(item.answers) > 1:
        half = len(item.answers) // 2
        assert item.score(", ".join(item.answers[:half])) == pytest.approx(half / len(item.answers))
    assert item.score("I cannot tell.") == 0.0


def test_lengths_too_short_or_unknown_tasks_are_refused(src):
    with pytest.raises(ValueError, match="cannot hold"):
        ruler_items(src, "ruler-cwe", 1024, 1)
    with pytest.raises(ValueError, match="too few for a coded vocabulary"):
        ruler_items(src, "ruler-fwe", 240, 1)
    with pytest.raises(ValueError, match="cannot tell the 3 most frequent words apart"):
        ruler_items(src, "ruler-fwe", 300, 1)
    with pytest.raises(ValueError, match="cannot hold the question"):
        ruler_items(src, "ruler-mv", 100, 1)
    with pytest.raises(ValueError, match="unknown RULER-style task 'ruler-xx'"):
        ruler_items(src, "ruler-xx", 4096, 1)


def test_too_few_essay_words_are_a_data_error():
    text = "The painters and hackers paint. The painters and hackers hack."
    small = RulerSource.from_essays(TOK, Haystack.from_text(TOK, text), text)
    assert small.words == ("hackers", "painters")
    with pytest.raises(TaskDataError, match="all 4 possible keys are used"):
        ruler_items(small, "ruler-mk", 4096, 1)
    with pytest.raises(TaskDataError, match="fewer than 10 distinct words"):
        ruler_items(small, "ruler-cwe", 4096, 1)


def test_the_tasks_own_wording_never_becomes_a_listed_word():
    """A listed word or key never comes from the prompts' own text, so a restated question finds none; nor does a
    word used once, a capitalised one or a piece of a contraction."""
    text = ("The special magic numbers hidden in the garden. Which common words appear? Reply with the garden "
            "words. Special magic numbers. The question hadn't ended; it hadn't. Apples grow in the orchard.")
    words = RulerSource.from_essays(TOK, Haystack.from_text(TOK, text), text).words
    assert words == ("garden",)
