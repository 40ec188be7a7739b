"""SQuAD F1 / EM, the share of expected strings found (RULER's string_match_all) and the multiple-choice metrics
against hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch

from mpfa.mpfa_cli.accuracy.tasks.scoring import (best_choice, choice_grade, continuation_logprobs, normalize_answer,
                                                  share_found, squad_exact_match, squad_f1)


def test_normalize_answer_follows_the_squad_script():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theater") == "theater"  # "the" only as a whole word


def test_f1_hand_checked():
    # prediction tokens {denver, broncos, team}, truth {denver, broncos}: P = 2/3, R = 1, F1 = 0.8
    assert squad_f1("Denver Broncos team", ["the Denver Broncos"]) == pytest.approx(0.8)
    # repeated tokens count with multiplicity: pred {a1 x2}, truth {a1}: P = 1/2, R = 1 -> 2/3
    assert squad_f1("x x", ["x"]) == pytest.approx(2 / 3)
    assert squad_f1("Carolina Panthers", ["Denver Broncos"]) == 0.0
    assert squad_f1("", ["Denver Broncos"]) == 0.0


def test_f1_and_em_take_the_best_reference():
    truths = ["Santa Clara, California", "Levi's Stadium", "Levi's Stadium in the San Francisco Bay Area"]
    assert squad_exact_match("levi's stadium.", truths) == 1.0
    assert squad_f1("levi's stadium.", truths) == 1.0
    assert squad_exact_match("Levi's Stadium in Santa Clara", truths) == 0.0
    # best is "Levi's Stadium": P = 2/5, R = 1 -> 4/7; the other two references give 1/2
    assert squad_f1("Levi's Stadium in Santa Clara", truths) == pytest.approx(4 / 7)


def test_squad_metrics_need_a_reference():
    with pytest.raises(ValueError, match="reference answer"):
        squad_f1("x", [])
    with pytest.raises(ValueError, match="reference answer"):
        squad_exact_match("x", [])


def test_share_found_counts_each_expected_string_once_as_a_whole_word():
    expected = ("1234567", "7654321", "2345678", "8765432")
    assert share_found("The numbers are 1234567, 7654321, 2345678 and 8765432.", expected) == 1.0  # right
    assert share_found("1234567\n2345678", expected) == 0.5  # partial, over lines
    assert share_found("1234567 1234567 1234567 1234567", expected) == 0.25  # one found, however often
    assert share_found("I don't know.", expected) == 0.0  # wrong
    assert share_found("12345678 and 76543210", expected) == 0.0  # inside longer numbers: not found
    words = ("form", "garden", "tree")
    assert share_found("Information, GARDEN, Trees", words) == pytest.approx(1 / 3)  # case-insensitive, whole words
    assert share_found("form-garden: tree.", words) == 1.0  # punctuation ends a word
    with pytest.raises(ValueError, match="at least one expected string"):
        share_found("x", ())


def test_continuation_logprobs_match_float64_log_softmax():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 11, generator=gen)
    tokens = torch.tensor([4, 0, 10])
    expected = sum(
        float(logits[i, t]) - math.log(sum(math.exp(float(x)) for x in logits[i])) for i, t in enumerate(tokens)
    )
    assert continuation_logprobs(logits[None], tokens[None]) == [pytest.approx(expected, rel=1e-12)]
    first = float(logits[0, 4]) - math.log(sum(math.exp(float(x)) for x in logits[0]))
    padded = continuation_logprobs(torch.stack([logits, logits]), torch.stack([tokens, tokens]),
                                   valid=torch.tensor([[True] * 3, [True, False, False]]))  # row 1: one real token
    assert padded == [pytest.approx(expected, rel=1e-12), pytest.approx(first, rel=1e-12)]


def test_choice_grade():
    assert choice_grade([-3.0, -1.0, -2.0], {1}) == 1.0
    assert choice_grade([-3.0, -1.0, -2.0], {0, 2}) == 0.0
    assert choice_grade([-1.0, -1.0], {0}) == 1.0  # ties go to the first choice
    assert choice_grade([-1.0, -1.0], {1}) == 0.0
    assert best_choice([-2.0, -0.5, -0.5]) == 1
    with pytest.raises(ValueError, match="finite"):
        choice_grade([math.nan, -1.0], {1})
    with pytest.raises(ValueError, match="finite"):
        choice_grade([], {0})
