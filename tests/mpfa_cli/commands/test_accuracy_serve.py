"""`mpfa accuracy serve` end to end on the simulator (real HTTP, real subprocess servers) with task data planted in
the cache: every answer and grade the command stores is recomputed here from the simulator's documented
deterministic outputs, so a wrong prompt, decode, request or score fails; then the stored result's exports."""
from __future__ import annotations

import csv
import io
import itertools
import json
import signal
import time
from pathlib import Path

import psutil

from mpfa.backends.specs import backend_spec
from mpfa.mpfa_cli.harness.sim_server import SimLogprobs, echoed_ids, prompt_digest
from mpfa.mpfa_cli.results.store import ResultStore
from mpfa.mpfa_cli.accuracy.tasks.items import DEFAULT_MAX_NEW_TOKENS, ChoiceItem
from mpfa.mpfa_cli.accuracy.tasks.scoring import best_choice
from mpfa.mpfa_cli.accuracy.tasks.ruler import RULER_TASKS
from mpfa.mpfa_cli.accuracy.tasks.task_sets import build_cells, build_picked_cells, parse_cells
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer, answer_text

BACKENDS = ("fa3-bf16", "mpfa")
MAX_NEW = 12
RESULTS = Path(__file__).resolve().parents[3] / "profiles" / "results"
SERVED_EXPORT = RESULTS / "accuracy-serve-niah-qwen2.5-coder-1.5b-fa3-fa4-flashinfer-mpfa-h100.json"
INTERVALS_EXPORT = RESULTS / "accuracy-serve-niah-intervals-qwen2.5-coder-1.5b-fa3-bf16-mpfa-h100.json"
EMULATED_EXPORT = RESULTS / "accuracy-emulate-niah-4k-8k-qwen2.5-coder-1.5b-bf16-mpfa-qk8tile-psum-h100.json"


def _expected(cell, backend: str, tok: ByteTokenizer, max_new: int = MAX_NEW) -> tuple[list[float], list]:
    """What the simulator's answers must score: generation echoes a prompt span; a choice's log-likelihood sums the
    simulated logprobs of its tokens."""
    scores, said = [], []
    for item in cell.items:
        if isinstance(item, ChoiceItem):
            sums = []
            for choice in item.choices:
                ids = [*item.context, *choice]
                lp = SimLogprobs(backend_spec(backend), prompt_digest(ids), ids, echoed_ids(ids, prompt_digest(ids), 1),
                                 len(item.context) - 1, 0)
                sums.append(sum(lp.values[len(item.context):len(ids)]))
            pick = best_choice(sums)
            scores.append(float(pick in item.correct))
            said.append(pick)
        else:
            text = answer_text(tok, echoed_ids(list(item.prompt), prompt_digest(list(item.prompt)), max_new),
                               item.first_line)
            scores.append(item.score(text))
            said.append(text)
    return scores, said


def test_serve_scores_every_backend_through_the_simulator_and_stores_it(mpfa, task_cache):
    run = mpfa("accuracy", "serve", "--engine", "sim", "--time-scale", "0.02", "-b", ",".join(BACKENDS),
               "--tasks", "niah-multikey,squad-long,social_iqa", "--lengths", "600,900", "--limit", "6",
               "--max-new-tokens", str(MAX_NEW), "--seed", "2", "--concurrency", "3", timeout=120)
    assert run.returncode == 0, run.stderr
    assert "SIMULATED" in run.stdout and "niah-multikey" in run.stdout
    # in a pipe, progress comes as lines while it happens: each server's state, then each cell as it finishes
    lines = run.stdout.splitlines()
    for backend in BACKENDS:
        starting = lines.index(f"{backend}: starting server")
        assert lines[starting + 1].startswith(f"{backend}: server ready after ")
        assert lines[starting + 2].startswith(f"{backend} niah-multikey@600: 6/6 in ")

    with ResultStore(mpfa.db) as store:
        (stored,) = store.list_profiles("accuracy-serve")
    assert stored.simulated and stored.gpu == "simulated"
    doc = stored.result
    tok = ByteTokenizer()
    cells = build_cells(tok, ["niah-multikey", "squad-long", "social_iqa"], [600, 900], limit=6, seed=2)
    assert [c["task"] for c in doc["cells"]] == [c.task for c in cells]
    assert all(len(item.prompt) == c.length for c in cells if c.length for item in c.items)
    for backend in BACKENDS:
        for cell in cells:
            scores, said = _expected(cell, backend, tok)
            assert doc["answers"][backend][cell.key] == said, (backend, cell.key)
            assert doc["scores"][backend][cell.key] == scores, (backend, cell.key)
    assert any(s > 0 for s in doc["scores"]["fa3-bf16"]["squad-long@900"])  # some echoed spans hit the answer
    for backend in BACKENDS:  # where and when each backend was scored, and what its server ran, travel with it
        where = doc["provenance"][backend]
        assert where["gpu"] == "simulated" and where["date"][:2] == "20" and where["mpfa_revision"]
        assert where["kernels"]["source"] == "simulated"
    assert f"scored on simulated at mpfa {doc['provenance']['mpfa']['mpfa_revision']}" in run.stdout

    # `served`, `plot --accuracy` and `import` as processes; the other listings, which start nothing, in this one
    listed = mpfa("accuracy", "served")
    assert listed.returncode == 0 and "SIMULATED" in listed.stdout
    exported = mpfa.invoke("accuracy", "served", str(stored.id), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert len(rows) == len(BACKENDS) * sum(len(c.items) for c in cells)
    assert {r["simulated"] for r in rows} == {"True"}
    (served,) = json.loads(mpfa.invoke("accuracy", "served", str(stored.id), "--format", "json").stdout)
    summary = served["summary"]
    assert served["provenance"] == doc["provenance"]
    other = [r for r in summary if r["backend"] == "mpfa"]
    assert len(other) == len(cells) and all(r["difference"]["n"] == 6 for r in other)
    plot = mpfa.invoke("accuracy", "served", str(stored.id), "--plot", str(mpfa.tmp / "served.png"))
    assert plot.returncode == 0 and (mpfa.tmp / "served.png").stat().st_size > 0
    # beside speed results: compare and plot --accuracy take it (the newest accuracy result by default)
    compared = mpfa.invoke("compare", "--accuracy")
    assert compared.returncode == 0 and "SIMULATED" in compared.stdout and "niah-multikey" in compared.stdout
    figure = mpfa("plot", "--accuracy", str(stored.id), "--format", "both", "-o", str(mpfa.tmp / "acc.png"))
    assert figure.returncode == 0 and all((mpfa.tmp / f"acc.{kind}").stat().st_size > 0 for kind in ("png", "svg"))
    # exported and imported elsewhere: the same result, simulated, with its summary recomputed from the scores
    export = mpfa.tmp / "served.json"
    assert mpfa.invoke("accuracy", "served", str(stored.id), "--format", "json", "-o", str(export)).returncode == 0
    elsewhere = mpfa.tmp / "elsewhere.db"
    imported = mpfa("accuracy", "import", str(export), "--db", str(elsewhere))
    assert imported.returncode == 0 and "(simulated)" in imported.stdout, imported.stderr
    again = json.loads(mpfa.invoke("accuracy", "served", "1", "--format", "json", "--db", str(elsewhere)).stdout)[0]
    first = json.loads(export.read_text())[0]
    assert {k: v for k, v in again.items() if k not in ("id", "params")} == \
        {k: v for k, v in first.items() if k not in ("id", "params")}
    assert again["params"] == {**first["params"], "imported_from": "served.json"}


def test_cells_asks_each_cell_its_own_number_of_questions_and_the_same_questions_as_limit(mpfa, task_cache):
    """`--cells task@length=N`: only those cells, each with N questions, the first N of what `--limit` asks."""
    base = ("accuracy", "serve", "--engine", "sim", "--time-scale", "0.02", "-b", "fa3-bf16", "--seed", "2")
    assert mpfa(*base, "--tasks", "niah-single,niah-multikey", "--lengths", "600,900", "--limit", "5",
                timeout=120).returncode == 0
    run = mpfa(*base, "--cells", "niah-multikey@900=5,niah-single@600=2,social_iqa=3", timeout=120)
    assert run.returncode == 0, run.stderr
    assert "3 cells, 10 questions" in run.stdout
    with ResultStore(mpfa.db) as store:
        whole, picked = (store.get_profile(i) for i in (1, 2))
    assert picked.params["limit"] == {"niah-multikey@900": 5, "niah-single@600": 2, "social_iqa": 3}
    asked = {c["task"] + str(c["length"]): c["ids"] for c in picked.result["cells"]}
    full = {c["task"] + str(c["length"]): c["ids"] for c in whole.result["cells"]}
    assert list(asked) == ["niah-multikey900", "niah-single600", "social_iqaNone"]
    assert asked["niah-multikey900"] == full["niah-multikey900"]
    assert asked["niah-single600"] == full["niah-single600"][:2]
    scores = picked.result["scores"]["fa3-bf16"]
    assert scores["niah-multikey@900"] == whole.result["scores"]["fa3-bf16"]["niah-multikey@900"]


def test_the_ruler_group_is_asked_with_each_tasks_answer_budget(mpfa, task_cache):
    """`--cells ruler@4096=N`: every RULER-style task, each answered within its own budget and scored on all of the
    answer (the simulator echoes as many prompt ids as it is asked for); `--max-new-tokens` sets one for all."""
    words = ["".join(letters) for letters in itertools.product("bcdfghjklm", repeat=4)]  # no English word
    (task_cache / "models" / "text" / "paul_graham_essays.txt").write_text(
        " ".join(" ".join(words[i:i + 8]) + "." for i in range(0, len(words), 8)) * 2)
    base = ("accuracy", "serve", "--engine", "sim", "--time-scale", "0.02", "-b", ",".join(BACKENDS), "--seed", "1")
    run = mpfa(*base, "--cells", "ruler@4096=2", timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{len(RULER_TASKS)} cells, {2 * len(RULER_TASKS)} questions" in run.stdout
    assert " ruler " in run.stdout  # the group's pooled row
    tok = ByteTokenizer()
    cells = build_picked_cells(tok, parse_cells("ruler@4096=2"), seed=1)
    with ResultStore(mpfa.db) as store:
        doc = store.get_profile(1).result
    assert doc["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS
    budgets = {c["task"]: c["max_new_tokens"] or doc["max_new_tokens"] for c in doc["cells"]}
    assert budgets == {task: spec.answer_tokens for task, spec in RULER_TASKS.items()}
    for backend in BACKENDS:
        for cell in cells:
            scores, said = _expected(cell, backend, tok, cell.max_new_tokens)
            assert doc["answers"][backend][cell.key] == said and doc["scores"][backend][cell.key] == scores
    run = mpfa(*base, "--cells", "ruler-cwe@4096=1", "--max-new-tokens", "9", timeout=120)
    assert run.returncode == 0, run.stderr
    with ResultStore(mpfa.db) as store:
        doc = store.get_profile(2).result
    assert doc["max_new_tokens"] == 9 and doc["cells"][0]["max_new_tokens"] is None
    cwe = next(c for c in cells if c.task == "ruler-cwe")
    assert doc["answers"]["fa3-bf16"][cwe.key] == _expected(cwe, "fa3-bf16", tok, 9)[1][:1]
    run = mpfa(*base, "--cells", "ruler@1024=2")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == ["error: ruler-cwe: 1024 tokens cannot hold 10 words 30 times each"]
    helped = " ".join(mpfa("accuracy", "serve", "--help").stdout.replace("│", " ").split())  # tasks and the group
    assert all(task in helped for task in RULER_TASKS) and "; ruler: ruler-mk," in helped


def test_ctrl_c_stores_the_cells_scored_so_far_and_stops_the_server(mpfa, task_cache):
    proc = mpfa.popen("accuracy", "serve", "--engine", "sim", "--time-scale", "0.5", "-b", "fa3-bf16,mpfa",
                      "--cells", "niah-single@600=3,niah-multikey@600=2000")
    deadline = time.time() + 60
    for line in proc.stdout:
        if line.startswith("fa3-bf16 niah-single@600: 3/3 in ") or time.time() > deadline:
            break
    time.sleep(1)  # the line comes as the cell's last answer does, just before its scores are kept
    proc.send_signal(signal.SIGINT)
    out, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["error: interrupted: the cells scored before it are stored (result 1)"]
    with ResultStore(mpfa.db) as store:
        stored = store.get_profile(1)
    assert stored.result["interrupted"] and stored.result["errors"] == {"fa3-bf16": "interrupted"}
    assert list(stored.result["scores"]["fa3-bf16"]) == ["niah-single@600"]
    assert len(stored.result["scores"]["fa3-bf16"]["niah-single@600"]) == 3
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(mpfa.tmp) in " ".join(p.info["cmdline"] or [])]
    export = mpfa.tmp / "interrupted.json"  # mpfa was never scored: the export still imports
    assert mpfa.invoke("accuracy", "served", "1", "--format", "json", "-o", str(export)).returncode == 0
    imported = mpfa.invoke("accuracy", "import", str(export), "--db", str(mpfa.tmp / "elsewhere.db"))
    assert imported.returncode == 0, imported.stderr


def test_serve_refuses_bad_input_in_one_line(mpfa, task_cache):
    """The first refusal through a real `mpfa` process, the others in this one (they start nothing)."""
    for index, (args, message) in enumerate([
        (("--tasks", "bogus"), "unknown task bogus"),
        (("--tasks", "niah-single", "--lengths", "100"), "at least 256 tokens"),
        (("--tokenizer", "/nonexistent"), "neither 'bytes' nor a model directory"),
        (("--cells", "niah-single@4096=20", "--limit", "5"), "--cells replaces --limit"),
        (("--cells", "niah-single=20"), "take a length of at least 256 tokens"),
        (("--cells", "squad@600=20"), "take a length of at least 256 tokens"),
        (("--cells", "niah-single@600"), "bad cell 'niah-single@600'"),
        (("--cells", "niah-single@600=2,niah-single@600=3"), "cells must not repeat"),
    ]):
        run = (mpfa if index == 0 else mpfa.invoke)("accuracy", "serve", "--engine", "sim", *args)
        assert run.returncode == 2, (args, run.stderr)
        assert message in run.stderr and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    run = mpfa.invoke("accuracy", "served", "1")
    assert run.returncode == 2 and "no profile with id 1" in run.stderr


def test_the_committed_served_export_imports_with_its_gpu_and_summary(mpfa):
    """The H100 needle results (docs/accuracy.md) stored from their export alone: GPU named, every backend's
    per-cell difference to fa3-bf16 recomputed from the scores equal to the export's."""
    run = mpfa.invoke("accuracy", "import", str(SERVED_EXPORT))
    assert run.returncode == 0 and "(NVIDIA H100 80GB HBM3)" in run.stdout, run.stderr
    (exported,) = json.loads(SERVED_EXPORT.read_text())
    (stored,) = json.loads(mpfa.invoke("accuracy", "served", "1", "--format", "json").stdout)
    assert stored["summary"] == exported["summary"]
    assert stored["backends"] == ["fa3-bf16", "mpfa+fp8", "mpfa+exact", "fa3-fp8", "mpfa-direct", "fa4-bf16",
                                  "flashinfer-fp8"]
    assert stored["pooled"] == exported["pooled"]
    four = next(r for r in stored["pooled"] if (r["task"], r["backend"]) == ("niah-multikey", "mpfa+fp8"))
    assert (four["n"], round(100 * four["difference"]["mean"], 1), round(100 * four["difference"]["low"], 1),
            round(100 * four["difference"]["high"], 1)) == (160, -3.8, -7.5, -0.6)  # docs/accuracy.md's table
    table = mpfa.invoke("accuracy", "served", "1")
    assert table.returncode == 0 and "§" in table.stdout  # the reference predates recorded provenance
    assert sum(" all " in line for line in table.stdout.splitlines()) >= 2  # a pooled row per needle task


def _rounded(row: dict) -> tuple:
    d = row["difference"]
    return row["n"], round(100 * d["mean"], 1), round(100 * d["low"], 1), round(100 * d["high"], 1)


def test_the_committed_interval_run_recomputes_to_docs_accuracy_numbers(mpfa):
    """The H100 run with as many questions per cell as ±3 points needed at n = 40 (two shards joined): recomputed
    from its scores, the differences docs/accuracy.md quotes."""
    assert mpfa.invoke("accuracy", "import", str(INTERVALS_EXPORT)).returncode == 0
    (stored,) = json.loads(mpfa.invoke("accuracy", "served", "1", "--format", "json").stdout)
    (exported,) = json.loads(INTERVALS_EXPORT.read_text())
    assert stored["summary"] == exported["summary"] and stored["pooled"] == exported["pooled"]
    mpfa_rows = {(r["task"], r["length"]): _rounded(r) for r in stored["summary"] if r["backend"] == "mpfa"}
    assert mpfa_rows == {("niah-multikey", 8192): (208, -2.4, -5.3, 0.5),
                         ("niah-multikey", 16384): (160, -5.0, -8.8, -1.9),
                         ("niah-single", 32736): (107, -0.9, -2.8, 0.0),
                         ("niah-multikey", 32736): (470, -7.4, -10.6, -4.3)}
    (pooled,) = [r for r in stored["pooled"] if r["backend"] == "mpfa"]
    assert _rounded(pooled) == (838, -5.7, -7.8, -3.7)
    assert {p["mpfa_revision"] for p in stored["provenance"].values()} == {"1e1f6566f8bd"}


def test_the_emulation_answers_the_served_questions_as_the_servers_did(mpfa):
    """The reference emulation on the H100 (`mpfa accuracy emulate`, the 4K and 8K cells it finished) joined with the
    served run: the same questions, and per question the same score as the served backend of the same numerics."""
    assert mpfa.invoke("accuracy", "import", str(SERVED_EXPORT)).returncode == 0
    assert mpfa.invoke("accuracy", "import", str(EMULATED_EXPORT)).returncode == 0
    merged = mpfa.invoke("accuracy", "served", "1,2", "--merge")
    assert merged.returncode == 0, merged.stderr
    (result,) = json.loads(mpfa.invoke("accuracy", "served", "3", "--format", "json").stdout)
    emulated = result["scores"]["mpfa-qk8tile-psum"]
    assert sorted(emulated) == ["niah-multikey@4096", "niah-multikey@8192", "niah-single@4096", "niah-single@8192"]
    same_answers = 0
    for cell in emulated:
        assert result["scores"]["bf16"][cell] == result["scores"]["fa3-bf16"][cell]
        assert emulated[cell] == result["scores"]["mpfa+fp8"][cell]
        same_answers += sum(a == b for a, b in zip(result["answers"]["mpfa-qk8tile-psum"][cell],
                                                   result["answers"]["mpfa+fp8"][cell]))
    assert same_answers == 159  # of 160: one question both miss, with different wrong numbers


def test_import_refuses_a_result_without_gpu_unless_named_and_a_non_export_in_one_line(mpfa):
    (exported,) = json.loads(SERVED_EXPORT.read_text())
    older = mpfa.tmp / "older.json"  # as exports were written before they named the GPU
    older.write_text(json.dumps([{k: v for k, v in exported.items() if k not in ("gpu", "params")}]))
    refused = mpfa.invoke("accuracy", "import", str(older))
    assert refused.returncode == 2 and "do not name their GPU: pass --gpu" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    named = mpfa.invoke("accuracy", "import", str(older), "--gpu", "NVIDIA H100 80GB HBM3")
    assert named.returncode == 0 and "(NVIDIA H100 80GB HBM3)" in named.stdout
    for content, reason in (("{}", "not a list of results"), ("[{\"model\": 1}]", "result 1:"),
                            ("not json", "is not a served-accuracy export")):
        bad = mpfa.tmp / "bad.json"
        bad.write_text(content)
        run = mpfa.invoke("accuracy", "import", str(bad), "--gpu", "x")
        assert run.returncode == 2 and reason in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
    with ResultStore(mpfa.db) as store:
        assert len(store.list_profiles("accuracy-serve")) == 1  # nothing stored from the refused files
