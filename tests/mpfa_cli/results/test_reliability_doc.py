"""docs/reliability.md names the test behind each fault it lists: every name it gives (`file.py::test_name` or a
bare `test_name`) must be a test that exists, so the table cannot point at a renamed or deleted test."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "reliability.md"


def _tests() -> dict[str, str]:
    return {path.name: path.read_text() for path in (ROOT / "tests").rglob("test_*.py")}


def test_every_test_the_reliability_doc_names_exists():
    text, tests = DOC.read_text(), _tests()
    named = re.findall(r"`(test_\w+\.py)::(\w+)", text)
    assert len(named) >= 10  # the doc's tables do name their tests
    missing = [f"{file}::{name}" for file, name in named
               if file not in tests or not re.search(rf"\bdef {name}\b", tests[file])]
    missing += [name for name in re.findall(r"`(test_\w+)`", text)
                if not any(re.search(rf"\bdef {name}\b", source) for source in tests.values())]
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
