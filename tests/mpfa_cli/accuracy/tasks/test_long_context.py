"""Long-context task builders with the byte tokenizer (every token known): exact lengths, needles where asked,
documents whose questions share all but their own tokens, the SQuAD passage hidden among other articles'
passages, determinism."""

from __future__ import annotations

import os
import string

import pytest

from mpfa.mpfa_cli.accuracy.tasks.data import SquadExample, TaskDataError
from mpfa.mpfa_cli.accuracy.tasks.items import GenerationItem, choice_items, squad_items
from mpfa.mpfa_cli.accuracy.tasks.data import ChoiceExample
from mpfa.mpfa_cli.accuracy.tasks.long_context import (DEPTHS, NEEDLE, NEEDLE_INSTRUCTION, NEEDLE_QUESTION, Haystack,
                                                       needle_items, shared_needle_documents, squad_long_items)
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer, answer_text

TOK = ByteTokenizer()
ESSAY = " ".join(f"Sentence number {i} talks about startups and painters." for i in range(400))


def _text(item: GenerationItem) -> str:
    return TOK.decode(item.prompt)


@pytest.mark.parametrize("task, needles", [("niah-single", 1), ("niah-multikey", 4)])
def test_needle_prompts_have_the_exact_length_and_their_needles(task, needles):
    hay = Haystack.from_text(TOK, ESSAY)
    items = needle_items(TOK, task, hay, 2000, count=20, seed=3)
    assert [it.depth for it in items[:10]] == list(DEPTHS) and items[10].depth == DEPTHS[0]
    for it in items:
        assert len(it.prompt) == 2000 and it.length == 2000 and it.metric == "contains"
        text = _text(it)
        assert text.count("The special magic number for") == needles
        (value,) = it.answers
        assert f"is: {value}." in text and len(value) == 7
        key = text.split("What is the special magic number for ")[1].split(" mentioned")[0]
        assert f"for {key} is: {value}." in text  # the question asks for the key of the answer's needle
    assert needle_items(TOK, task, hay, 2000, count=20, seed=3) == items  # deterministic
    assert needle_items(TOK, task, hay, 2000, count=20, seed=4) != items
    assert needle_items(TOK, task, hay, 2000, count=5, seed=3, first=15) == items[15:]


def test_needle_depth_places_the_needle_in_order():
    hay = Haystack.from_text(TOK, ESSAY)
    positions = []
    for it in needle_items(TOK, "niah-single", hay, 3000, count=10):
        body = _text(it).split("one of them.\n\n")[1].split("\n\nWhat is")[0]
        positions.append(body.index(NEEDLE.split("{")[0].strip()) / len(body))
    assert positions[0] < 0.02 and positions[-1] > 0.95
    assert positions == sorted(positions)
    assert all(abs(p - d) < 0.05 for p, d in zip(positions, DEPTHS))


def test_needles_refuse_a_length_that_cannot_hold_them():
    with pytest.raises(ValueError, match="cannot hold"):
        needle_items(TOK, "niah-single", Haystack.from_text(TOK, ESSAY), 100, count=1)
    with pytest.raises(ValueError, match="unknown needle task"):
        needle_items(TOK, "niah-other", Haystack.from_text(TOK, ESSAY), 4000, count=1)


# Every sentence begins with its own character, none with the needles' "T": documents that begin at different
# sentences share no text.
DISTINCT = " ".join(f"{c}{c} is a sentence about startups and painters."
                    for c in (string.ascii_letters + string.digits).replace("T", ""))


def _asked_key(item: GenerationItem) -> str:
    return _text(item).split("What is the special magic number for ")[1].split(" mentioned")[0]


def test_shared_documents_ask_each_needle_after_the_same_document_ids():
    docs = shared_needle_documents(TOK, Haystack.from_text(TOK, DISTINCT), 3000, documents=3, seed=2)
    items = [it for doc in docs for it in doc]
    assert [len(doc) for doc in docs] == [4, 4, 4]
    assert [it.depth for it in items] == [DEPTHS[i % len(DEPTHS)] for i in range(12)]  # question 4d + j's depth
    for doc in docs:
        documents = set()
        for it in doc:
            assert (len(it.prompt), it.length, it.metric, it.task) == (3000, 3000, "contains", "niah-multikey")
            (value,) = it.answers
            text = _text(it)
            assert text.count("The special magic number for") == 4 and f"for {_asked_key(it)} is: {value}." in text
            tail = TOK.encode(NEEDLE_QUESTION.format(key=_asked_key(it)) + "\nAssistant:")
            assert it.prompt[-len(tail):] == tuple(tail)  # the question's own tokens, after the document
            documents.add(it.prompt[: -len(tail)])
        assert len(documents) == 1  # one document, the same ids for every question
        assert len({it.answers for it in doc}) == len({_asked_key(it) for it in doc}) == 4  # each needle asked once


def test_different_shared_documents_share_only_the_chat_turns_opening():
    docs = shared_needle_documents(TOK, Haystack.from_text(TOK, DISTINCT), 3000, documents=5, seed=2)
    opening = [TOK.BOS, *TOK.encode(f"User: {NEEDLE_INSTRUCTION}")]
    needle = len(TOK.encode(NEEDLE.format(key="", value="")))
    at_start = [d for d, doc in enumerate(docs) if any(it.depth == 0 for it in doc)]
    assert at_start == [0, 2]  # questions 0 and 10; documents 1, 3 and 4 begin with a haystack sentence
    for i in range(len(docs)):
        for j in range(i + 1, len(docs)):
            shared = os.path.commonprefix([docs[i][0].prompt, docs[j][0].prompt])
            assert list(shared[: len(opening)]) == opening
            # beyond it a space, or the first words of two needles at depth 0: never haystack text
            assert len(shared) - len(opening) < (needle if {i, j} <= set(at_start) else 2)


def test_shared_documents_are_seeded_and_refuse_what_cannot_be_built():
    hay = Haystack.from_text(TOK, DISTINCT)
    docs = shared_needle_documents(TOK, hay, 3000, documents=2, seed=5)
    assert shared_needle_documents(TOK, hay, 3000, documents=2, seed=5) == docs
    assert shared_needle_documents(TOK, hay, 3000, documents=2, seed=6) != docs
    with pytest.raises(ValueError, match="cannot hold"):
        shared_needle_documents(TOK, hay, 150, documents=1)
    with pytest.raises(ValueError, match="haystack sentences"):
        shared_needle_documents(TOK, hay, 3000, documents=len(hay.sentences) + 1)


def _squad(n_articles: int = 30) -> list[SquadExample]:
    return [SquadExample(f"q{a}-{i}", f"article {a}", f"Passage of article {a} number {i}. " * 5,
                         f"Question {a}-{i}?", (f"answer {a}",))
            for a in range(n_articles) for i in range(3)]


def test_squad_long_hides_the_passage_among_other_articles_at_the_exact_length():
    everything = _squad()
    items = squad_long_items(TOK, everything[:6], everything, 3000, seed=1)
    for ex, it in zip(everything[:6], items):
        text = _text(it)
        assert len(it.prompt) == 3000 and it.metric == "f1" and it.answers == ex.answers
        assert text.count(ex.context) == 1 and f"Question: {ex.question}" in text
        own_article = [e.context for e in everything if e.title == ex.title and e.context != ex.context]
        assert not any(c in text for c in own_article)  # no passage of the same article: one right answer
        assert 0 <= it.depth < 1
    assert squad_long_items(TOK, everything[:6], everything, 3000, seed=1) == items
    assert [it.depth for it in squad_long_items(TOK, everything[:6], everything, 3000, seed=2)] != \
        [it.depth for it in items]
    with pytest.raises(TaskDataError, match="not enough passages"):
        squad_long_items(TOK, everything[:1], everything[:6], 3000)


def test_normal_length_items_and_answers():
    ex = SquadExample("q1", "t", "The Rhine flows north.", "Which way?", ("north",))
    (item,) = squad_items(TOK, [ex])
    assert _text(item).startswith("User: Answer the question") and _text(item).endswith("\nAssistant:")
    assert item.length is None and item.score("North.") == 1.0 and item.score("south") == 0.0
    (choice,) = choice_items(TOK, [ChoiceExample("Who naps?", ("dog", "cat"), frozenset({1}))], "social_iqa", 7)
    assert choice.id == "social_iqa-7" and TOK.decode(choice.choices[1]) == " cat"
    assert TOK.decode(choice.context) == "Who naps?\nOptions: dog; cat\nAnswer:"
    needle = GenerationItem("niah-single", "x", (), ("1234567",), "contains")
    assert needle.score("The number is 1234567.") == 1.0 and needle.score("123456") == 0.0
    assert answer_text(TOK, TOK.encode(" 42 \nmore") + [TOK.EOS]) == "42"
    assert answer_text(TOK, TOK.encode("ab") + [TOK.EOS] + TOK.encode("cd")) == "ab"
