"""Task data loaders on small synthetic files (no download)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from mpfa.mpfa_cli.accuracy.tasks import data
from mpfa.mpfa_cli.accuracy.tasks.data import ChoiceExample, SquadExample, TaskDataError

SQUAD = {
    "version": "1.1",
    "data": [
        {"title": "Rivers", "paragraphs": [
            {"context": "The Rhine flows north.", "qas": [
                {"id": "q1", "question": "Which way does the Rhine flow?",
                 "answers": [{"answer_start": 15, "text": "north"}, {"answer_start": 11, "text": "flows north"}]},
                {"id": "q2", "question": "What flows north?", "answers": [{"answer_start": 4, "text": "Rhine"}]},
            ]},
        ]},
        {"title": "Cats", "paragraphs": [
            {"context": "Cats sleep a lot.", "qas": [
                {"id": "q3", "question": "Who sleeps a lot?", "answers": [{"answer_start": 0, "text": "Cats"}]},
            ]},
        ]},
    ],
}


def _write_json(path, obj):
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def test_load_squad_flattens_articles_in_file_order(tmp_path):
    examples = data.load_squad(_write_json(tmp_path / "squad.json", SQUAD))
    assert examples == [
        SquadExample(
            "q1", "Rivers", "The Rhine flows north.", "Which way does the Rhine flow?", ("north", "flows north")
        ),
        SquadExample("q2", "Rivers", "The Rhine flows north.", "What flows north?", ("Rhine",)),
        SquadExample("q3", "Cats", "Cats sleep a lot.", "Who sleeps a lot?", ("Cats",)),
    ]


def test_load_squad_rejects_other_formats(tmp_path):
    with pytest.raises(TaskDataError, match="SQuAD v1.1 format"):
        data.load_squad(_write_json(tmp_path / "x.json", {"examples": []}))
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TaskDataError, match="cannot read JSON"):
        data.load_squad(tmp_path / "bad.json")


def test_load_multiple_choice(tmp_path):
    task = {"examples": [
        {"input": " Who naps? ", "target_scores": {"the dog": 0, "the cat": 1, "nobody": 0}},
        {"input": "Pick two", "target_scores": {"a": 1, "b": 1}},
    ]}
    assert data.load_multiple_choice(_write_json(tmp_path / "task.json", task)) == [
        ChoiceExample("Who naps?", ("the dog", "the cat", "nobody"), frozenset({1})),
        ChoiceExample("Pick two", ("a", "b"), frozenset({0, 1})),
    ]
    task["examples"].append({"input": "no answer", "target_scores": {"a": 0, "b": 0}})
    with pytest.raises(TaskDataError, match="scored 1"):
        data.load_multiple_choice(_write_json(tmp_path / "task.json", task))


def test_extract_task_files_streams_only_the_wanted_members(tmp_path):
    archive = tmp_path / "bigbench-1.0.0.tar.gz"
    members = {f"bigbench-1.0.0/bigbench/benchmark_tasks/{rel}": json.dumps({"rel": rel}).encode()
               for rel in data.TASK_FILES.values()}
    members["bigbench-1.0.0/bigbench/benchmark_tasks/other/task.json"] = b"{}"
    with tarfile.open(archive, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    out = tmp_path / "cache"
    data._extract_task_files(archive, out)
    for rel in data.TASK_FILES.values():
        assert json.loads((out / rel).read_text()) == {"rel": rel}
    assert not (out / "other").exists()


def test_task_file_uses_the_cache_and_rejects_unknown_tasks(tmp_path, monkeypatch):
    def no_download(*_):
        raise AssertionError("must not download when the file is cached")

    monkeypatch.setattr(data, "_download_sdist", no_download)
    cached = tmp_path / "bigbench-1.0.0" / data.TASK_FILES["squad"]
    cached.parent.mkdir(parents=True)
    _write_json(cached, SQUAD)
    assert data.task_file("squad", tmp_path) == cached
    with pytest.raises(TaskDataError, match="unknown task"):
        data.task_file("nope", tmp_path)
