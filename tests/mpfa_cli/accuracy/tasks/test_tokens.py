"""`HFTokenizer` on a tiny word-level transformers tokenizer with a chat template (no download): a body of ids
goes between the turn's text unchanged, so a prompt's length is exact; without a body the whole turn is tokenized
at once, as the reference runner always did."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from mpfa.mpfa_cli.accuracy.tasks.tokens import HFTokenizer, answer_text  # noqa: E402

WORDS = ["<unk>", "<eos>", "<turn>", "user:", "assistant:", "find", "the", "number", "42", "hay", "question"]


def _tokenizer(chat: bool) -> HFTokenizer:
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    raw.decoder = tokenizers.decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<turn>"]})
    if chat:
        tok.chat_template = ("{% for m in messages %}<turn> user: {{ m['content'] }} <turn>{% endfor %}"
                             "{% if add_generation_prompt %} assistant:{% endif %}")
    return HFTokenizer(tok, "tiny")


def test_chat_ids_put_the_body_between_the_turn_text():
    tok = _tokenizer(chat=True)
    body = [WORDS.index("hay")] * 7
    ids = tok.chat_ids("find the number", body, " question")
    prefix = tok.encode("<turn> user: find the number")
    assert ids[:len(prefix)] == prefix and ids[len(prefix):len(prefix) + 7] == body
    assert tok.decode(ids[len(prefix) + 7:]) == "question assistant:"
    assert len(ids) == len(tok.chat_ids("find the number", [0], " question")) - 1 + 7  # what the builders count on
    assert tok.chat_ids("find the number") == tok.encode("<turn> user: find the number <turn> assistant:")
    assert WORDS.index("<eos>") in tok.stop_ids()
    assert answer_text(tok, [WORDS.index("42"), WORDS.index("<eos>"), WORDS.index("hay")]) == "42"


def test_without_a_chat_template_the_prompt_is_plain_text_then_answer():
    tok = _tokenizer(chat=False)
    ids = tok.chat_ids("find the", [WORDS.index("hay")], " number")
    assert ids == [WORDS.index(w) for w in ("find", "the", "hay", "number", "<unk>")]  # "Answer:" is not a word here


def test_stop_ids_hold_end_of_turn_tokens_and_answers_never_rebuild_the_vocabulary(monkeypatch):
    """`get_vocab()` builds the whole vocabulary (~0.3 s for Qwen2.5's 151K entries): looked up per request, it
    held the GIL and serialized the served-accuracy client's threads. The stop ids are found once."""
    tok = _tokenizer(chat=True)
    tok.tokenizer.add_special_tokens({"additional_special_tokens": ["<turn>", "<|im_end|>"]})
    tok = HFTokenizer(tok.tokenizer, "tiny")
    im_end = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tok.stop_ids() == {WORDS.index("<eos>"), im_end}
    calls = []
    monkeypatch.setattr(tok.tokenizer, "get_vocab", lambda: calls.append(1) or {})
    for _ in range(50):
        assert answer_text(tok, [WORDS.index("42"), im_end, WORDS.index("hay")]) == "42"
    assert calls == []
