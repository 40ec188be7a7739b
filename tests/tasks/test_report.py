"""Loss vs BF16, recovery, JSON and table of task-accuracy results; request validation of the runner."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from mpfa.kernels.tasks.report import TaskAccuracyReport, TaskScores, render_task_accuracy
from mpfa.kernels.tasks.runner import run_task_accuracy


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
    ],
)
def test_bad_requests_fail_before_loading_a_model(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_task_accuracy("no-such-model", **kwargs)
