"""Loss vs BF16, recovery, JSON and table of task-accuracy results; request validation of the runner."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from mpfa.mpfa_cli.accuracy.tasks.task_report import TaskAccuracyReport, TaskScores, merge_reports, render_task_accuracy
from mpfa.mpfa_cli.accuracy.tasks.runner import run_task_accuracy


def _squad(bf16=0.60, fp8=0.58, direct=0.40, mpfa=0.55) -> TaskScores:
    scores = TaskScores("squad", "f1", 200)
    for variant, f1 in (("bf16", bf16), ("fp8", fp8), ("qk4-pv8-direct", direct), ("mpfa", mpfa)):
        scores.metrics[variant] = {"f1": f1, "em": f1 / 2, "same_as_bf16": 1.0 if variant == "bf16" else 0.5}
    return scores


def test_losses_and_recovery():
    scores = _squad()
    assert scores.losses() == pytest.approx({"fp8": 0.02, "qk4-pv8-direct": 0.20, "mpfa": 0.05})
    assert scores.recovery() == pytest.approx((0.20 - 0.05) / 0.20)  # 75%
    assert _squad(mpfa=0.30).recovery() == pytest.approx(-0.5)  # worse than direct: negative, not clipped


def test_recovery_is_undefined_without_a_direct_loss_or_a_variant():
    assert _squad(direct=0.60).recovery() is None
    assert _squad(direct=0.65).recovery() is None
    partial = _squad()
    del partial.metrics["mpfa"]
    assert partial.recovery() is None
    del partial.metrics["bf16"]
    assert partial.losses() == {}


def test_report_json_and_table():
    report = TaskAccuracyReport("tiny", "cpu", {"variants": ["bf16", "fp8", "qk4-pv8-direct", "mpfa"]}, [_squad()])
    payload = json.loads(json.dumps(report.to_json()))
    assert payload["tasks"][0]["recovery"] == pytest.approx(0.75)
    assert payload["tasks"][0]["losses"]["qk4-pv8-direct"] == pytest.approx(0.20)
    console = Console(record=True, width=160)
    render_task_accuracy(report, console)
    text = console.export_text()
    assert "squad" in text and "75.0%" in text and "40.0 (-20.0)" in text
    assert "same_as_bf16" in text and "100%" in text and "50%" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tasks": ["mmlu"]}, "unknown task"),
        ({"variants": ["int8"]}, "unknown variant"),
        ({"variants": []}, "at least one"),
        ({"tasks": ["squad", "squad"]}, "must not repeat"),
        ({"limit": 0}, "--limit"),
        ({"context_pad": 0}, "--context-pad"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"batch_size": 0}, "--batch-size"),
    ],
)
def test_bad_requests_fail_before_loading_a_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_task_accuracy("no-such-model", **kwargs)


def _shard(offset: int, examples: int, f1: dict, same: dict, **params) -> TaskAccuracyReport:
    scores = TaskScores("squad", "f1", examples)
    for variant in f1:
        scores.metrics[variant] = {"f1": f1[variant], "same_as_bf16": same[variant]}
        scores.seconds[variant] = 10.0
    settings = {"variants": list(f1), "context_pad": 1024, "max_new_tokens": 16, "offset": offset, **params}
    return TaskAccuracyReport("tiny", "cuda", settings, [scores])


def test_merge_weights_each_shard_by_its_examples():
    a = _shard(0, 30, {"bf16": 0.9, "qk4-pv8-direct": 0.3, "mpfa": 0.8}, {"bf16": 1.0, "qk4-pv8-direct": 0.2, "mpfa": 0.9})
    b = _shard(30, 10, {"bf16": 0.5, "qk4-pv8-direct": 0.1, "mpfa": 0.5}, {"bf16": 1.0, "qk4-pv8-direct": 0.0, "mpfa": 0.6})
    merged = merge_reports([b, a])  # any order
    squad = merged.tasks[0]
    assert squad.examples == 40 and merged.params["examples"] == {"squad": [[0, 30], [30, 40]]}
    assert squad.score("bf16") == pytest.approx((0.9 * 30 + 0.5 * 10) / 40)
    assert squad.metrics["mpfa"]["same_as_bf16"] == pytest.approx((0.9 * 30 + 0.6 * 10) / 40)
    assert squad.seconds["mpfa"] == 20.0
    assert squad.recovery() == pytest.approx(((0.8 - 0.25) - (0.8 - 0.725)) / (0.8 - 0.25))
    round_trip = TaskAccuracyReport.from_json(json.loads(json.dumps(merged.to_json())))
    assert round_trip.tasks[0].metrics == squad.metrics and round_trip.params == merged.params


@pytest.mark.parametrize(("second", "message"), [
    (dict(offset=20), "overlap"),
    (dict(offset=30, context_pad=2048), "context_pad"),
])
def test_merge_refuses_overlaps_and_different_settings(second, message):
    f1 = {"bf16": 0.9, "mpfa": 0.8}
    a = _shard(0, 30, f1, f1)
    b = _shard(second.pop("offset"), 10, f1, f1, **second)
    with pytest.raises(ValueError, match=message):
        merge_reports([a, b])


def test_offset_is_checked_before_loading_a_model():
    with pytest.raises(ValueError, match="--offset"):
        run_task_accuracy("no-such-model", offset=-1)
