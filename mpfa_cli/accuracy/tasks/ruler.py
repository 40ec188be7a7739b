"""RULER-style long-context tasks (after NVIDIA's RULER synthetic tasks, rebuilt here), each prompt exactly `length`
tokens of the model's tokenizer, like the needle tasks of `long_context`:

* `ruler-mk` (multi-key): the context is nothing but needles "One of the special magic numbers for {key} is:
  {value}.", one a line, every key and value distinct; question i asks for the one at depth DEPTHS[i % 10].
* `ruler-mv` (multi-value): essays with four needles of one key at seeded depths; all four values are asked.
* `ruler-mq` (multi-query): essays with needles of four keys at seeded depths; all four are asked at once.
* `ruler-vt` (variable tracking): a filler line repeated, with a chain "VAR A = 12345", "VAR B = VAR A", ...
  (four hops) hidden in order at seeded lines; asked: every variable that gets the value (all five).
* `ruler-cwe` (common words extraction): a numbered list of essay words, ten of them 30 times each, the others 3 times
  (the last few, which fill the length, once); asked: the ten common ones.
* `ruler-fwe` (frequent words extraction): coded words (random letters) counted as scale / rank^2 (Zipf, alpha 2),
  the most frequent one dots to ignore; asked: the three most frequent coded words.

Keys are pairs of essay words and the listed words essay words: lowercase, 4-8 letters, used twice or more, none of
the tasks' own wording (an answer that restates the question must not find them). Every answer is scored as RULER's
`string_match_all` scores it (metric "share", `scoring.share_found`): the share of the expected strings in the whole
answer. A task's answer budget (max_new_tokens) is its `RulerTask.answer_tokens`. What fills a prompt to its exact
length is cut at the end: the last essay sentence (mv, mq), needle line (mk), filler line (vt), list entry (cwe) or
dots (fwe); the fill never repeats an asked string or outnumbers a common or frequent word.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, count, islice, repeat

from .data import TaskDataError
from .items import DEFAULT_MAX_NEW_TOKENS, GenerationItem
from .long_context import DEPTHS, NEEDLE_QUESTION, Haystack, _flat, _insert, _overhead, _rng
from .tokens import TaskTokenizer

NEEDLE = "One of the special magic numbers for {key} is: {value}."
VALUE_DIGITS = 7  # a needle's value, as the needle tasks'
KEYS_INSTRUCTION = ("Special magic numbers are hidden in the following text. Memorize them: you will be asked "
                    "for {which}.\n")
ALL_QUESTION = ("\n\nWhat are all the special magic numbers for {keys} mentioned in the text above? "
                "Reply with the numbers only, separated by commas.")
HOPS, NAME_LETTERS, CHAIN_DIGITS = 4, 5, 5  # a chain of 5 variables named by 5 capitals, a 5-digit value
FILLER = "The river is wide. The hills are green. The road is long. Here we rest. Then on we go."
VT_INSTRUCTION = "Memorize and track the chain of variable assignments hidden in the following text.\n"
VT_QUESTION = ("\n\nQuestion: Find all variables that are assigned the value {value} in the text above. "
               "Reply with the variable names only, separated by commas.")
COMMON_WORDS, COMMON_REPEATS, RARE_REPEATS = 10, 30, 3
CWE_INSTRUCTION = ("Below is a numbered list of words. Some words appear more often than others: memorize the ones "
                   "that appear most often.\n")
CWE_QUESTION = ("\n\nQuestion: What are the {n} most common words in the list above? "
                "Reply with the words only, separated by commas.").format(n=COMMON_WORDS)
FREQUENT_WORDS, CODED_LETTERS, ZIPF_ALPHA = 3, 6, 2
TOKENS_PER_CODED_WORD = 50  # the coded vocabulary has length // 50 words (RULER's size)
DOTS = "...."  # the most frequent coded word: noise the question says to ignore
FWE_INSTRUCTION = "Read the following coded text and track how often each coded word appears.\n"
FWE_QUESTION = ("\n\nQuestion: Ignore the dots '{dots}'. What are the {n} most frequent coded words in the text "
                "above? Reply with the words only, separated by commas.").format(dots=DOTS, n=FREQUENT_WORDS)
_WORDING = (NEEDLE, KEYS_INSTRUCTION, ALL_QUESTION, NEEDLE_QUESTION, FILLER, VT_INSTRUCTION, VT_QUESTION,
            CWE_INSTRUCTION, CWE_QUESTION, FWE_INSTRUCTION, FWE_QUESTION)
_OWN_WORDS = frozenset(re.findall(r"[a-z]+", " ".join(_WORDING).lower()))
_ESSAY_WORD = re.compile(r"(?<![\w'.])[a-z]{4,8}(?![\w'])")  # no "hadn" of "hadn't"; 10 x 30 fit 4,096 bytes
WORD_MIN_USES = 2  # a word the essays use once may be a typo, a name or a coinage


@dataclass
class RulerSource:
    """What the tasks draw from: the essays as a haystack and their words; ids of repeated short texts, cached."""

    tok: TaskTokenizer
    haystack: Haystack
    words: tuple[str, ...]
    _cache: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_essays(cls, tok: TaskTokenizer, haystack: Haystack, text: str) -> RulerSource:
        """`haystack`: `text` as `Haystack.from_text` makes it (the needle tasks share it)."""
        uses = Counter(_ESSAY_WORD.findall(text))
        return cls(tok, haystack, tuple(sorted({w for w, n in uses.items() if n >= WORD_MIN_USES} - _OWN_WORDS)))

    def ids(self, text: str) -> tuple[int, ...]:
        if (ids := self._cache.get(text)) is None:
            ids = self._cache[text] = tuple(self.tok.encode(text))
        return ids


@dataclass(frozen=True)
class _Prompt:
    """One question before it becomes a chat turn: text before the body ids, the body, text after, the answers."""

    before: str
    body: list[int]
    after: str
    answers: tuple[str, ...]
    depth: float | None = None


def _budget(tok: TaskTokenizer, task: str, length: int, before: str, after: str, fixed: int) -> int:
    """Body tokens left for filling once the chat turn and `fixed` tokens of the task's own lines are counted."""
    budget = length - _overhead(tok, before, after) - fixed
    if budget < 0:
        raise ValueError(f"{task}: {length} tokens cannot hold the question and its lines")
    return budget


def _take(pieces: Iterable[tuple[int, ...]], budget: int, task: str) -> list[tuple[int, ...]]:
    """Pieces in order holding exactly `budget` tokens, the last one cut."""
    out, total, pieces = [], 0, iter(pieces)
    while total < budget:
        if (piece := next(pieces, None)) is None:
            raise TaskDataError(f"{task}: the essays hold too few distinct words to fill {budget} tokens")
        out.append(piece[: budget - total])
        total += len(out[-1])
    return out


def _distinct(draw: Callable[[], str], possible: int, what: str) -> Iterator[str]:
    """Draws, each one not drawn before, until the `possible` values are spent."""
    seen: set[str] = set()
    while len(seen) < possible:
        if (value := draw()) not in seen:
            seen.add(value)
            yield value
    raise TaskDataError(f"all {possible} possible {what} are used")


def _keys(src: RulerSource, rng: random.Random) -> Iterator[str]:
    return _distinct(lambda: f"{rng.choice(src.words)}-{rng.choice(src.words)}", len(src.words) ** 2, "keys")


def _numbers(rng: random.Random, digits: int) -> Iterator[str]:
    low = 10 ** (digits - 1)
    return _distinct(lambda: str(rng.randrange(low, 10 * low)), 9 * low, f"{digits}-digit numbers")


def _letters(rng: random.Random, alphabet: str, n: int) -> Iterator[str]:
    return _distinct(lambda: "".join(rng.choices(alphabet, k=n)), len(alphabet) ** n, f"{n}-letter names")


def _listed(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"


def _multikey(src: RulerSource, rng: random.Random, task: str, length: int, index: int) -> _Prompt:
    keys, values = _keys(src, rng), _numbers(rng, VALUE_DIGITS)
    key, value = next(keys), next(values)
    asked, depth = tuple(src.tok.encode("\n" + NEEDLE.format(key=key, value=value))), DEPTHS[index % len(DEPTHS)]
    before, after = KEYS_INSTRUCTION.format(which="one of them"), NEEDLE_QUESTION.format(key=key)
    lines = (tuple(src.tok.encode("\n" + NEEDLE.format(key=k, value=v))) for k, v in zip(keys, values))
    body = _insert(_take(lines, _budget(src.tok, task, length, before, after, len(asked)), task), [(asked, depth)])
    return _Prompt(before, _flat(body), after, (value,), depth)


def _essay_needles(src: RulerSource, rng: random.Random, task: str, length: int, index: int, *, keys: int,
                   values: int) -> _Prompt:
    """`keys` keys of `values` values each, every needle at a seeded depth; every value asked."""
    asked = list(islice(_keys(src, rng), keys))
    numbers = _numbers(rng, VALUE_DIGITS)
    pairs = [(key, next(numbers)) for key in asked for _ in range(values)]
    needles = [(tuple(src.tok.encode(" " + NEEDLE.format(key=k, value=v))), rng.random()) for k, v in pairs]
    before, after = KEYS_INSTRUCTION.format(which="some of them"), ALL_QUESTION.format(keys=_listed(asked))
    budget = _budget(src.tok, task, length, before, after, sum(len(ids) for ids, _ in needles))
    body = _insert(src.haystack.take(rng.randrange(len(src.haystack.sentences)), budget), needles)
    return _Prompt(before, _flat(body), after, tuple(v for _, v in pairs))


def _variables(src: RulerSource, rng: random.Random, task: str, length: int, index: int) -> _Prompt:
    names = list(islice(_letters(rng, string.ascii_uppercase, NAME_LETTERS), HOPS + 1))
    value = next(_numbers(rng, CHAIN_DIGITS))
    chain_lines = [f"\nVAR {names[0]} = {value}", *(f"\nVAR {b} = VAR {a}" for a, b in zip(names, names[1:]))]
    statements = [tuple(src.tok.encode(line)) for line in chain_lines]
    after = VT_QUESTION.format(value=value)
    budget = _budget(src.tok, task, length, VT_INSTRUCTION, after, sum(map(len, statements)))
    filler = _take(repeat(src.ids("\n" + FILLER)), budget, task)
    depths = sorted(rng.random() for _ in statements)  # in order: each assignment after the one it reads
    return _Prompt(VT_INSTRUCTION, _flat(_insert(filler, list(zip(statements, depths)))), after, tuple(names))


def _common_words(src: RulerSource, rng: random.Random, task: str, length: int, index: int) -> _Prompt:
    budget = _budget(src.tok, task, length, CWE_INSTRUCTION, CWE_QUESTION, 0)
    words = iter(rng.sample(src.words, len(src.words)))
    common = list(islice(words, COMMON_WORDS))
    if len(common) < COMMON_WORDS:
        raise TaskDataError(f"{task}: the essays hold fewer than {COMMON_WORDS} distinct words")

    def entry(number: int, word: str) -> tuple[int, ...]:
        return src.ids(f"\n{number}.") + src.ids(" " + word)

    def cost(listed: int, word: str, repeats: int) -> int:
        """Tokens of `repeats` more entries of `word` after `listed` entries."""
        return sum(len(entry(listed + 1 + i, word)) for i in range(repeats))

    listed = common * COMMON_REPEATS
    used = sum(len(entry(number, word)) for number, word in enumerate(listed, 1))
    if used > budget:
        raise ValueError(f"{task}: {length} tokens cannot hold {COMMON_WORDS} words {COMMON_REPEATS} times each")
    for word in words:  # rare words, each RARE_REPEATS times, while they fit
        if used + (extra := cost(len(listed), word, RARE_REPEATS)) > budget:
            words = chain([word], words)
            break
        listed += [word] * RARE_REPEATS
        used += extra
    rng.shuffle(listed)
    tail = (entry(number, word) for number, word in zip(count(len(listed) + 1), words))
    body = [entry(number, word) for number, word in enumerate(listed, 1)] + _take(tail, budget - used, task)
    return _Prompt(CWE_INSTRUCTION, _flat(body), CWE_QUESTION, tuple(common))


def _frequent_words(src: RulerSource, rng: random.Random, task: str, length: int, index: int) -> _Prompt:
    budget = _budget(src.tok, task, length, FWE_INSTRUCTION, FWE_QUESTION, 0)
    size = length // TOKENS_PER_CODED_WORD
    if size < FREQUENT_WORDS + 2:
        raise ValueError(f"{task}: {length} tokens are too few for a coded vocabulary")
    coded = list(islice(_letters(rng, string.ascii_lowercase, CODED_LETTERS), size - 1))
    ids = [src.ids(" " + DOTS), *(tuple(src.tok.encode(" " + word)) for word in coded)]

    def counts(scale: int) -> list[int]:
        return [scale // rank**ZIPF_ALPHA for rank in range(1, len(ids) + 1)]

    def cost(scale: int) -> int:
        return sum(n * len(word) for n, word in zip(counts(scale), ids))

    low, high = 0, budget  # the largest scale whose words fit (the dots alone fill the budget at its top)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cost(middle) <= budget else (low, middle - 1)
    n = counts(low)
    if n[FREQUENT_WORDS] <= n[FREQUENT_WORDS + 1]:
        raise ValueError(f"{task}: {length} tokens cannot tell the {FREQUENT_WORDS} most frequent words apart")
    pieces = [word for word, times in zip(ids, n) for _ in range(times)]
    rng.shuffle(pieces)
    body = pieces + _take(repeat(ids[0]), budget - cost(low), task)
    return _Prompt(FWE_INSTRUCTION, _flat(body), FWE_QUESTION, tuple(coded[:FREQUENT_WORDS]))


@dataclass(frozen=True)
class RulerTask:
    """How a task builds a question (source, rng, task, length, question index) and the answer tokens it needs."""

    build: Callable[[RulerSource, random.Random, str, int, int], _Prompt]
    answer_tokens: int


RULER_TASKS = {
    # answer budgets: the expected strings after a restated question (RULER's own where it lists as many strings)
    "ruler-mk": RulerTask(_multikey, DEFAULT_MAX_NEW_TOKENS),  # one 7-digit number, as the needle tasks
    "ruler-mv": RulerTask(partial(_essay_needles, keys=1, values=4), 128),  # four numbers: RULER's 128
    "ruler-mq": RulerTask(partial(_essay_needles, keys=4, values=1), 128),
    "ruler-vt": RulerTask(_variables, 64),  # five names
    "ruler-cwe": RulerTask(_common_words, 120),  # ten words: RULER's 120
    "ruler-fwe": RulerTask(_frequent_words, 64),  # three coded words
}


def ruler_items(
    src: RulerSource, task: str, length: int, count: int, seed: int = 0, first: int = 0
) -> list[GenerationItem]:
    """Questions `first` .. `first + count - 1` of a RULER-style task at `length` prompt tokens."""
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER-style task {task!r}; known: {', '.join(RULER_TASKS)}")
    items = []
    for index in range(first, first + count):
        asked = RULER_TASKS[task].build(src, _rng(seed, task, length, index), task, length, index)
        prompt = src.tok.chat_ids(asked.before, asked.body, asked.after)
        items.append(GenerationItem(task, f"{task}-{length}-{index}", tuple(prompt), asked.answers, "share", length,
                                    asked.depth))
    return items
