"""`retrieval_heads` on a byte-tokenized needle prompt and on synthetic Q/K/V: the needles are found at their exact
token positions, a head whose last query points at the asked needle's keys gets its mass, and the variant's error is
0 for float64 and positive (finite) for the shipped numerics."""

from __future__ import annotations

import math

import pytest
import torch

from mpfa.mpfa_cli.accuracy.capture import LayerQKV
from mpfa.mpfa_cli.accuracy.tasks.long_context import NEEDLE, Haystack, needle_items
from mpfa.mpfa_cli.accuracy.tasks.retrieval_heads import NeedleSpan, head_rows, needle_spans, retrieval_summary
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer

TEXT = " ".join(f"Sentence {i} says little about anything in particular." for i in range(200))


def test_needle_spans_find_every_needle_at_its_tokens():
    tok = ByteTokenizer()
    (item,) = needle_items(tok, "niah-multikey", Haystack.from_text(tok, TEXT), 3000, 1, seed=0, first=7)
    asked, others = needle_spans(tok, item)
    assert asked.value == item.answers[0] and len(others) == 3
    for needle in (asked, *others):
        assert tok.decode(item.prompt[needle.start:needle.end]) == NEEDLE.format(key=needle.key, value=needle.value)
    assert asked.key in tok.decode(item.prompt[-200:])  # the question asks for the asked needle's key


def _layers(seq: int, asked: NeedleSpan, gen: torch.Generator) -> list[LayerQKV]:
    q = torch.randn(seq, 4, 128, generator=gen) * 0.3
    k = torch.randn(seq, 2, 128, generator=gen) * 0.3
    v = torch.randn(seq, 2, 128, generator=gen)
    k[asked.start:asked.end, 0] = q[-1, 0] * 8  # head 0 (KV head 0) looks at the asked needle
    return [LayerQKV(5, q.bfloat16(), k.bfloat16(), v.bfloat16())]


def test_a_head_pointing_at_the_needle_gets_its_mass_and_errors_are_measured():
    gen = torch.Generator().manual_seed(1)
    asked, other = NeedleSpan("a-b", "1234567", 100, 120), NeedleSpan("c-d", "7654321", 300, 320)
    layers = _layers(512, asked, gen)
    exact = head_rows(layers, 1 / math.sqrt(128), asked, [other], "float64", rows=8)
    assert [(r.layer, r.head) for r in exact] == [(5, h) for h in range(4)]
    assert exact[0].mass_asked > 0.9 and all(r.mass_asked < 0.2 for r in exact[1:])
    assert all(r.mass_others < 0.2 for r in exact)
    assert all(r.error == pytest.approx(0, abs=1e-12) for r in exact)
    shipped = head_rows(layers, 1 / math.sqrt(128), asked, [other], "mpfa-qk8tile-psum", rows=8)
    assert all(0 < r.error < 0.5 and math.isfinite(r.error) for r in shipped)
    assert [r.mass_asked for r in shipped] == [r.mass_asked for r in exact]  # the mass is float64's, not the variant's
    summary = retrieval_summary(shipped)
    assert summary["retrieving"] == 1 and summary["rest"] == 3
    assert summary["error_retrieving"] == pytest.approx(shipped[0].error)


def test_the_command_refuses_bad_input_in_one_line():
    from typer.testing import CliRunner

    from mpfa.mpfa_cli.app import app

    for args in (["--model", "x", "--task", "squad"], ["--model", "/no/such/dir"], ["--model", "x", "--rows", "0"]):
        result = CliRunner().invoke(app, ["accuracy", "heads", *args])
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("error:"), result.output
