"""`mpfa accuracy kernel` on the committed real-activation fixture, and its bad-input errors."""
from pathlib import Path

FIXTURE = Path(__file__).parents[1] / "fixtures" / "activations" / "smollm2-135m.pt"


def test_accuracy_kernel_on_fixture_reports_recovery(mpfa) -> None:
    result = mpfa("accuracy", "kernel", str(FIXTURE), "--variants", "bf16,qk4-pv8-direct,mpfa", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "recovery of the qk4-pv8-direct error by mpfa" in result.stdout


def test_accuracy_kernel_bad_variant_is_one_line(mpfa) -> None:
    result = mpfa("accuracy", "kernel", str(FIXTURE), "--variants", "bf16,fp3")
    assert result.returncode == 2 and "fp3" in result.stderr and "Traceback" not in result.stderr


def test_accuracy_task_unknown_model_is_one_line(mpfa) -> None:
    result = mpfa("accuracy", "task", "--model", "nosuch", "--limit", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # Without transformers (CI installs no accuracy extra) the command says which extra it needs.
    assert ("known model" in result.stderr) != ("accuracy extra" in result.stderr)
