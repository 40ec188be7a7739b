"""The served-accuracy client against canned `/generate` answers: counts and ids checked, answers decoded and
scored; the stored result's summary, JSON round trip and CSV rows."""
from __future__ import annotations

import json
import random

import pytest

from mpfa.mpfa_cli.accuracy import serve as accuracy_serve
from mpfa.mpfa_cli.accuracy.logits import ResponseError
from mpfa.mpfa_cli.accuracy.served import ServedAccuracy, export_csv
from mpfa.mpfa_cli.accuracy.tasks.items import ChoiceItem, GenerationItem
from mpfa.mpfa_cli.accuracy.tasks.task_sets import Cell
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer

TOK = ByteTokenizer()
ITEM = GenerationItem("niah-single", "n-0", tuple(TOK.encode("prompt")), ("4711",), "contains", 4096, 0.5)
CHOICE = ChoiceItem("social_iqa", "s-0", (1, 50, 51), ((60, 61), (70,)), frozenset({1}))


def _canned(monkeypatch, answer):
    sent = []
    monkeypatch.setattr(accuracy_serve, "post_generate", lambda url, body: sent.append(body) or answer(body))
    return sent


def test_answer_sends_ids_greedy_and_scores_the_decoded_first_line(monkeypatch):
    sent = _canned(monkeypatch, lambda body: {
        "output_ids": TOK.encode(" 4711\nmore") + [TOK.EOS], "meta_info": {"prompt_tokens": len(ITEM.prompt)}})
    assert accuracy_serve.answer("http://x", ITEM, TOK, 16) == (1.0, "4711")
    assert sent[0]["input_ids"] == list(ITEM.prompt)
    assert sent[0]["sampling_params"] == {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [TOK.EOS]}


def test_answered_also_returns_the_response_meta_info(monkeypatch):
    meta = {"prompt_tokens": len(ITEM.prompt), "cached_tokens": 128}
    _canned(monkeypatch, lambda body: {"output_ids": TOK.encode("4711"), "meta_info": meta})
    assert accuracy_serve.answered("http://x", ITEM, TOK, 16) == (1.0, "4711", meta)


def test_an_answer_scored_by_the_share_found_is_all_of_it(monkeypatch):
    item = GenerationItem("ruler-mv", "v-0", ITEM.prompt, ("1111111", "2222222"), "share", 4096)
    _canned(monkeypatch, lambda body: {"output_ids": TOK.encode("1111111\n2222222\n") + [TOK.EOS],
                                       "meta_info": {"prompt_tokens": len(item.prompt)}})
    assert accuracy_serve.answer("http://x", item, TOK, 20) == (1.0, "1111111\n2222222")


@pytest.mark.parametrize("body, message", [
    ({"output_ids": [], "meta_info": {"prompt_tokens": 5}}, "counted 5 prompt tokens, 6 were sent"),
    ({"error": {"message": "boom"}}, "server error: boom"),
    ({"output_ids": [5] * 17, "meta_info": {}}, "at most 16"),
])
def test_answer_refuses_a_response_that_does_not_fit_the_request(monkeypatch, body, message):
    _canned(monkeypatch, lambda _: body)
    with pytest.raises(ResponseError, match=message):
        accuracy_serve.answer("http://x", ITEM, TOK, 16)


def test_choose_sums_the_choice_tokens_logprobs(monkeypatch):
    logprob = {60: -1.0, 61: -2.5, 70: -3.0}

    def reply(body):
        ids = body["input_ids"]
        start = body["logprob_start_len"]
        return {"meta_info": {"prompt_tokens": len(ids), "input_token_logprobs": [
            [None if p == 0 else logprob.get(ids[p], -0.1), ids[p], None] for p in range(start, len(ids))]}}

    sent = _canned(monkeypatch, reply)
    assert accuracy_serve.choose("http://x", CHOICE) == (1.0, 1)  # -3.0 beats -3.5
    assert [b["logprob_start_len"] for b in sent] == [2, 2]
    _canned(monkeypatch, lambda body: {"meta_info": {"input_token_logprobs": [[-1.0, 99, None]] * 3}})
    with pytest.raises(ResponseError, match="not for choice token"):
        accuracy_serve.choose("http://x", CHOICE)


def test_result_summary_round_trip_and_csv():
    cell = Cell("niah-single", 4096, tuple(GenerationItem("niah-single", f"n-{i}", (1,), ("1",), "contains", 4096,
                                                          0.0) for i in range(40)))
    result = ServedAccuracy.empty("m", "bytes", "fa4-bf16", ["fa4-bf16", "mpfa"], [cell], 0, 16)
    result.scores = {"fa4-bf16": {cell.key: [1.0] * 40}, "mpfa": {cell.key: [1.0] * 30 + [0.0] * 10}}
    result.answers = {b: {cell.key: ["x"] * 40} for b in result.backends}
    ref, other = result.summary()
    assert (ref.backend, ref.score, ref.difference) == ("fa4-bf16", 1.0, None)
    assert other.score == 0.75 and other.difference.mean == pytest.approx(-0.25) and other.difference.high < 0
    assert ServedAccuracy.from_json(result.to_json()) == result
    lines = export_csv([(7, result)]).splitlines()
    assert len(lines) == 81 and lines[0].startswith("result,backend,task,length,question,depth")
    assert lines[1].startswith("7,fa4-bf16,niah-single,4096,n-0,")


def test_a_cell_records_its_answer_budget_where_it_differs_from_the_results():
    def cell(task: str, budget: int) -> Cell:
        return Cell(task, 600, (GenerationItem(task, f"{task}-0", (1,), ("a",), "share", 600),), budget)

    result = ServedAccuracy.empty("m", "bytes", "fa3-bf16", ["fa3-bf16"], [cell("ruler-mk", 32),
                                                                          cell("ruler-cwe", 120)], 0, 32)
    assert [c.max_new_tokens for c in result.cells] == [None, 120]
    assert ServedAccuracy.from_json(result.to_json()) == result
    old = result.to_json()  # a result stored before cells recorded a budget still loads
    for info in old["cells"]:
        del info["max_new_tokens"]
    assert [c.max_new_tokens for c in ServedAccuracy.from_json(old).cells] == [None, None]


def test_window_check_names_the_longest_length_that_fits():
    cell = Cell("niah-single", 100, (GenerationItem("niah-single", "n", (1,) * 100, ("1",), "contains", 100),), 28)
    longer = Cell("ruler-cwe", 90, (GenerationItem("ruler-cwe", "c", (1,) * 90, ("a",), "share", 90),), 39)
    assert accuracy_serve.context_length([cell]) == 128 and accuracy_serve.context_length([cell, longer]) == 129
    accuracy_serve.check_window([cell], 128)
    with pytest.raises(ValueError, match="ruler-cwe@90: its longest prompt with 39 new tokens needs 129 positions, "
                                         "the model's window is 128: use lengths of at most 89 tokens for ruler-cwe"):
        accuracy_serve.check_window([cell, longer], 128)


def test_trained_window_is_a_model_directorys_own(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    assert accuracy_serve.trained_window(str(tmp_path)) == 32768
    (tmp_path / "config.json").write_text("{}")
    assert accuracy_serve.trained_window(str(tmp_path)) is None
    assert accuracy_serve.trained_window("llama-3.1-8b") is None  # a bundled config: dummy weights, no window


def test_merge_joins_backends_run_apart_on_the_same_questions():
    from mpfa.mpfa_cli.accuracy.served import merge_served

    cell = Cell("squad", None, tuple(GenerationItem("squad", f"q{i}", (1,), ("a",), "f1") for i in range(20)))

    def run(backend: str, scores: list[float]) -> ServedAccuracy:
        result = ServedAccuracy.empty("m", "bytes", "fa4-bf16", [backend], [cell], 0, 32)
        result.scores, result.answers = {backend: {cell.key: scores}}, {backend: {cell.key: ["x"] * 20}}
        return result

    other = run("mpfa", [1.0] * 15 + [0.0] * 5)
    assert [r.difference for r in other.summary()] == [None]  # no reference in this run
    merged = merge_served([other, run("fa4-bf16", [1.0] * 20)])
    assert merged.ordered() == ["fa4-bf16", "mpfa"]
    ref, diff = merged.summary()
    assert ref.backend == "fa4-bf16" and diff.difference.mean == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="more than one"):
        merge_served([other, other])
    fewer = ServedAccuracy.empty("m", "bytes", "fa4-bf16", ["fa4-bf16"], [Cell("squad", None, cell.items[:5])], 0, 32)
    with pytest.raises(ValueError, match="different questions"):
        merge_served([other, fewer])
    with pytest.raises(ValueError, match="different seed"):
        merge_served([other, ServedAccuracy.empty("m", "bytes", "fa4-bf16", ["x"], [cell], 1, 32)])


def test_merge_joins_shards_of_the_same_backends_question_by_question():
    from mpfa.mpfa_cli.accuracy.served import merge_served

    def items(task: str, first: int, count: int) -> tuple:
        return tuple(GenerationItem(task, f"{task}-{i}", (1,), ("a",), "contains", 600) for i in range(first,
                                                                                                        first + count))

    def shard(cells: list[Cell], scores: dict[str, list[float]], revision: str = "abc") -> ServedAccuracy:
        result = ServedAccuracy.empty("m", "bytes", "fa3-bf16", ["fa3-bf16", "mpfa"], cells, 0, 32)
        for backend, per_question in scores.items():
            result.scores[backend] = {c.key: per_question[: len(c.items)] for c in cells}
            result.answers[backend] = {c.key: ["x"] * len(c.items) for c in cells}
            result.provenance[backend] = {"gpu": "H100", "mpfa_revision": revision}
        return result

    multikey = Cell("niah-multikey", 600, items("niah-multikey", 0, 4))
    first = shard([multikey], {"fa3-bf16": [1.0] * 4, "mpfa": [1.0, 0.0, 1.0, 1.0]})
    more = Cell("niah-multikey", 600, items("niah-multikey", 400, 2))
    single = Cell("niah-single", 600, items("niah-single", 0, 3))
    second = shard([more, single], {"fa3-bf16": [1.0] * 3, "mpfa": [0.0, 0.0, 1.0]})
    merged = merge_served([first, second])
    assert [c.key for c in merged.cells] == ["niah-multikey@600", "niah-single@600"]
    assert merged.cells[0].ids == [f"niah-multikey-{i}" for i in (0, 1, 2, 3, 400, 401)]
    assert merged.scores["mpfa"]["niah-multikey@600"] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    rows = {(r.task, r.backend): r for r in merged.summary()}
    assert rows[("niah-multikey", "mpfa")].n == 6 and rows[("niah-multikey", "mpfa")].score == pytest.approx(0.5)
    assert rows[("niah-single", "mpfa")].difference.mean == pytest.approx(-2 / 3)
    assert first.cells[0].ids == [f"niah-multikey-{i}" for i in range(4)]  # the parts are left as they were
    overlapping = shard([Cell("niah-multikey", 600, items("niah-multikey", 3, 2))],
                        {"fa3-bf16": [1.0] * 2, "mpfa": [1.0] * 2})
    with pytest.raises(ValueError, match="question niah-multikey-3 is in more than one"):
        merge_served([first, overlapping])
    with pytest.raises(ValueError, match="scored on .*'abc'.* and on .*'def'"):
        merge_served([first, shard([more], {"fa3-bf16": [1.0] * 2, "mpfa": [1.0] * 2}, "def")])
    longer = Cell("niah-multikey", 600, more.items, max_new_tokens=64)
    with pytest.raises(ValueError, match="cannot join niah-multikey@600: its answers had different budgets"):
        merge_served([first, shard([longer], {"fa3-bf16": [1.0] * 2, "mpfa": [1.0] * 2})])
    partial = shard([more, single], {"fa3-bf16": [1.0] * 3, "mpfa": [0.0] * 3})
    del partial.scores["mpfa"]["niah-single@600"]
    with pytest.raises(ValueError, match="not scored on every cell"):
        merge_served([first, partial])


def test_the_table_names_where_the_backends_were_scored_and_flags_a_mix():
    from mpfa.mpfa_cli.accuracy.served import provenance_note

    cell = Cell("squad", None, tuple(GenerationItem("squad", f"q{i}", (1,), ("a",), "f1") for i in range(4)))
    result = ServedAccuracy.empty("m", "bytes", "fa3-bf16", ["fa3-bf16", "mpfa"], [cell], 0, 32)
    assert provenance_note(result) == ""  # results stored before provenance was recorded
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "mpfa_revision": "17813754ac9b"}
    result.provenance = {"fa3-bf16": h100, "mpfa": dict(h100)}
    assert provenance_note(result) == "scored on NVIDIA H100 80GB HBM3 at mpfa 17813754ac9b"
    result.provenance["mpfa"]["mpfa_revision"] = "65b6d144e323"
    note = provenance_note(result)
    assert note.startswith("§ measured on different machines or revisions: ")
    assert "fa3-bf16 NVIDIA H100 80GB HBM3 at 17813754ac9b" in note and "65b6d144e323" in note
    again = ServedAccuracy.from_json(result.to_json())  # stored and read back
    assert again.provenance == result.provenance
    del result.provenance["fa3-bf16"]  # a result stored before provenance was, merged with a later one
    note = provenance_note(result)
    assert note.startswith("§") and "fa3-bf16 unknown GPU at unknown revision" in note and "65b6d144e323" in note


def test_a_prefill_kernel_names_the_mpfa_backends_it_applies_to():
    from mpfa.backends.specs import BACKENDS

    assert accuracy_serve.served_name(BACKENDS["mpfa"], "exact") == "mpfa+exact"
    assert accuracy_serve.served_name(BACKENDS["fa4-bf16"], "exact") == "fa4-bf16"
    assert accuracy_serve.served_name(BACKENDS["mpfa"], None) == "mpfa"


def test_workload_counts_a_request_per_question_and_per_choice():
    cells = [Cell("niah-single", 6, (ITEM, ITEM)), Cell("social_iqa", None, (CHOICE,))]
    assert accuracy_serve.workload(cells) == (2 + 2, 2 * 6 + (3 + 2) + (3 + 1))


def test_scores_by_depth_bin_the_evidence_position():
    from rich.console import Console

    from mpfa.mpfa_cli.accuracy.served import render_by_depth

    items = tuple(GenerationItem("niah-single", f"n{i}", (1,), ("1",), "contains", 64, i / 9) for i in range(10))
    result = ServedAccuracy.empty("m", "bytes", "fa4-bf16", ["fa4-bf16"], [Cell("niah-single", 64, items)], 0, 32)
    result.scores = {"fa4-bf16": {"niah-single@64": [1.0] * 9 + [0.0]}}
    console = Console(record=True, width=200)
    render_by_depth(result, console)
    row = next(line for line in console.export_text().splitlines() if "niah-single" in line)
    assert row.count("100 (1)") == 9 and row.rstrip(" │").endswith("0 (1)")


def test_pooled_rows_join_a_tasks_lengths_and_stay_paired():
    """Per task asked at two or more lengths, one row per backend over all its questions: the mean of the joined
    scores and the paired difference of the joined lists; a task asked at one length gets none."""
    from mpfa.mpfa_cli.accuracy.tasks.paired_stats import paired_difference

    def cell(task, length, n):
        return Cell(task, length, tuple(GenerationItem(task, f"{task}{length}-{i}", (1,), ("a",), "contains")
                                         for i in range(n)))

    cells = [cell("niah-single", 512, 5), cell("niah-single", 1024, 5), cell("squad", None, 4)]
    result = ServedAccuracy.empty("m", "bytes", "fa3-bf16", ["fa3-bf16", "mpfa"], cells, 7, 32)
    gen = random.Random(5)
    for backend in result.backends:
        result.scores[backend] = {c.key: [float(gen.random() < 0.7) for _ in c.ids] for c in result.cells}
    (ref_row, mpfa_row) = result.pooled()
    joined = {b: result.scores[b]["niah-single@512"] + result.scores[b]["niah-single@1024"] for b in result.backends}
    assert (ref_row.task, ref_row.length, ref_row.backend, ref_row.n) == ("niah-single", None, "fa3-bf16", 10)
    assert ref_row.score == sum(joined["fa3-bf16"]) / 10 and ref_row.difference is None
    assert mpfa_row.score == sum(joined["mpfa"]) / 10
    assert mpfa_row.difference == paired_difference(joined["mpfa"], joined["fa3-bf16"], seed=7)
    del result.scores["mpfa"]["niah-single@1024"]  # not scored on every length: no pooled row for it
    assert [r.backend for r in result.pooled()] == ["fa3-bf16"]


def test_pooled_rows_join_a_groups_tasks_per_length_and_over_all():
    """The `ruler` tasks: per length one row per backend over every task's questions there, then over every length;
    each still paired question by question with the reference."""
    from mpfa.mpfa_cli.accuracy.tasks.paired_stats import paired_difference

    def cell(task, length, n):
        return Cell(task, length, tuple(GenerationItem(task, f"{task}{length}-{i}", (1,), ("a",), "share", length)
                                         for i in range(n)))

    cells = [cell("ruler-mk", 512, 3), cell("ruler-cwe", 512, 4), cell("ruler-mk", 1024, 3),
             cell("ruler-cwe", 1024, 4), cell("ruler-vt", 2048, 5), cell("niah-single", 512, 2)]
    result = ServedAccuracy.empty("m", "bytes", "fa3-bf16", ["fa3-bf16", "mpfa"], cells, 7, 32)
    gen = random.Random(9)
    for backend in result.backends:
        result.scores[backend] = {c.key: [gen.choice([0.0, 0.25, 0.5, 1.0]) for _ in c.ids] for c in result.cells}
    rows = {(r.task, r.length, r.backend): r for r in result.pooled()}
    # per task over its lengths (ruler-vt and niah-single: one length, no row), then the group at 512, 1024, all
    assert list(dict.fromkeys((t, n) for t, n, _ in rows)) == [("ruler-mk", None), ("ruler-cwe", None),
                                                                ("ruler", 512), ("ruler", 1024), ("ruler", None)]

    def joined(backend, keys):
        return [s for key in keys for s in result.scores[backend][key]]

    at_512 = ["ruler-mk@512", "ruler-cwe@512"]
    row = rows[("ruler", 512, "mpfa")]
    assert row.n == 7 and row.score == pytest.approx(sum(joined("mpfa", at_512)) / 7)
    assert row.difference == paired_difference(joined("mpfa", at_512), joined("fa3-bf16", at_512), seed=7)
    everything = [c.key for c in result.cells if c.task.startswith("ruler-")]
    assert rows[("ruler", None, "mpfa")].n == 19 and rows[("ruler", None, "mpfa")].difference == \
        paired_difference(joined("mpfa", everything), joined("fa3-bf16", everything), seed=7)
    assert rows[("ruler", None, "fa3-bf16")].difference is None
