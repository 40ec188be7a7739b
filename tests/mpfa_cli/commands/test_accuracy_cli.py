"""`mpfa accuracy kernel` on the committed real-activation fixture, and its bad-input errors; `accuracy task`'s and
`accuracy results`'. Each command runs once as a real `mpfa` process, its other cases in this one."""
from pathlib import Path

FIXTURE = Path(__file__).parents[2] / "fixtures" / "activations" / "smollm2-135m.pt"


def test_accuracy_kernel_on_fixture_reports_recovery(mpfa) -> None:
    result = mpfa("accuracy", "kernel", str(FIXTURE), "--variants", "bf16,qk4-pv8-direct,mpfa", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "recovery of the qk4-pv8-direct error by mpfa" in result.stdout


def test_accuracy_kernel_qk8_variants_with_kv_tile_size(mpfa) -> None:
    result = mpfa.invoke("accuracy", "kernel", str(FIXTURE), "--variants", "mpfa,mpfa-qk8row,mpfa-qk8tile", "--layers",
                         "29", "--block-n", "64")
    assert result.returncode == 0, result.stderr
    assert "mpfa-qk8tile" in result.stdout
    bad = mpfa.invoke("accuracy", "kernel", str(FIXTURE), "--variants", "mpfa-qk8tile", "--block-n", "100")
    assert bad.returncode == 2 and "block_n" in bad.stderr and "Traceback" not in bad.stderr


def test_accuracy_kernel_bad_variant_is_one_line(mpfa) -> None:
    result = mpfa.invoke("accuracy", "kernel", str(FIXTURE), "--variants", "bf16,fp3")
    assert result.returncode == 2 and "fp3" in result.stderr and "Traceback" not in result.stderr


def test_accuracy_task_unknown_model_is_one_line(mpfa) -> None:
    result = mpfa("accuracy", "task", "--model", "nosuch", "--limit", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # Without transformers (CI installs no accuracy extra) the command says which extra it needs.
    assert ("known model" in result.stderr) != ("accuracy extra" in result.stderr)


def test_accuracy_task_bad_batch_size_is_one_line(mpfa) -> None:
    result = mpfa.invoke("accuracy", "task", "--model", "nosuch", "--batch-size", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert ("--batch-size" in result.stderr) != ("accuracy extra" in result.stderr)


def _store_shard(db: Path, offset: int, examples: int, f1: float) -> None:
    from mpfa.mpfa_cli.results.store import ResultStore
    from mpfa.mpfa_cli.accuracy.tasks.task_report import TaskAccuracyReport, TaskScores

    scores = TaskScores("social_iqa", "grade", examples,
                        {v: {"grade": f1, "same_as_bf16": 1.0} for v in ("bf16", "qk4-pv8-direct", "mpfa")})
    params = {"variants": ["bf16", "qk4-pv8-direct", "mpfa"], "context_pad": 1024, "max_new_tokens": 16,
              "offset": offset, "limit": examples, "tasks": ["social_iqa"]}
    report = TaskAccuracyReport("tiny", "cuda", params, [scores])
    with ResultStore(db) as store:
        store.add_profile("accuracy-task", "cuda", {**params, "model": "tiny"}, report.to_json())


def test_accuracy_results_lists_merges_and_refuses_overlaps(mpfa) -> None:
    _store_shard(mpfa.db, 0, 30, 0.5)
    _store_shard(mpfa.db, 30, 10, 0.7)
    _store_shard(mpfa.db, 35, 10, 0.7)
    listed = mpfa("accuracy", "results")
    assert listed.returncode == 0 and "social_iqa (30)" in listed.stdout and "social_iqa (10)" in listed.stdout
    merged = mpfa.invoke("accuracy", "results", "1,2", "--merge")
    assert merged.returncode == 0, merged.stderr
    assert "55.0" in merged.stdout and "stored merged accuracy result 4" in merged.stdout  # (0.5*30 + 0.7*10) / 40
    overlap = mpfa.invoke("accuracy", "results", "2,3", "--merge")
    assert overlap.returncode == 2 and "overlap" in overlap.stderr and "Traceback" not in overlap.stderr
