"""`mpfa logits` end to end as a real subprocess: against the simulator, against servers that miscount; bad input
(refused before any server starts) in this process."""
from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mpfa.backends.specs import BACKENDS

FAST = ["--time-scale", "0.02"]


def _profiles(db) -> list[sqlite3.Row]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute("SELECT * FROM profiles WHERE kind = 'logits' ORDER BY id").fetchall()
    finally:
        conn.close()


def test_two_backends_on_the_simulator(mpfa):
    out = mpfa("logits", "--engine", "sim", "--backend", "mpfa,fa4-bf16", "--ref", "fa4-bf16",
               "--input-len", "64,300", "--prompts", "2", "--output-len", "5", *FAST)
    assert out.returncode == 0, out.stderr
    assert "SIMULATED" in out.stdout and "meaningless as accuracy" in out.stdout
    assert "fa4-bf16 (ref)" in out.stdout
    (stored,) = _profiles(mpfa.db)
    assert stored["simulated"] == 1 and stored["gpu"] == "simulated"
    params, result = json.loads(stored["params"]), json.loads(stored["result"])
    assert params["backends"] == ["fa4-bf16", "mpfa"]  # the reference runs first
    assert params["input_len"] == [64, 300] and params["prompts"] == 2 and params["output_len"] == 5
    assert "--random-seed" not in params["server_args"]  # an SGLang flag; serve-sim has none
    rows = {(r["backend"], r["input_len"]): r for r in result["rows"]}
    assert set(rows) == {(b, n) for b in ("fa4-bf16", "mpfa") for n in (64, 300)}
    for n in (64, 300):
        ref, mpfa_row = rows[("fa4-bf16", n)], rows[("mpfa", n)]
        assert ref["error"] is None and ref["prefill_mean_abs"] == 0 and ref["decode_identical"] == 1.0
        assert mpfa_row["error"] is None and mpfa_row["prefill_positions"] == 2 * (n - 1)
        assert 0 < mpfa_row["prefill_mean_abs"] < mpfa_row["prefill_max_abs"] <= 0.02
        assert mpfa_row["decode_identical"] == 1.0 and mpfa_row["decode_compared"] == 2 * 5
        assert mpfa_row["first_divergence"] == [None, None] and mpfa_row["prefill_top1_agree"] == 1.0
    assert result["simulated"] is True and result["server_info"]["mpfa"]["attention_backend"] == "mpfa"


def test_threshold_turns_the_numbers_into_an_exit_code(mpfa):
    out = mpfa("logits", "--engine", "sim", "--backend", "fa4-bf16,mpfa-direct", "--input-len", "32",
               "--prompts", "1", "--output-len", "2", "--max-mean-abs-dlogprob", "1e-6", *FAST)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["error: mean |Δ logprob| above 1e-06: mpfa-direct@32"]
    assert len(_profiles(mpfa.db)) == 1  # stored all the same


class _FakeSGLang(BaseHTTPRequestHandler):
    """Answers /generate in SGLang's logprob layout; under /short it generates one token too few."""

    def log_message(self, *args) -> None:
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json({"attention_backend": "mpfa" if self.path.startswith("/short") else "fa4"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, wanted = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        made = wanted - 1 if self.path.startswith("/short") else wanted
        output = [1000 + i for i in range(made)]
        self._json({"output_ids": output, "meta_info": {
            "prompt_tokens": len(prompt), "completion_tokens": made,
            "input_token_logprobs": [[None if i == 0 else -1.0, t, None] for i, t in enumerate(prompt)],
            "output_token_logprobs": [[-0.5, t, None] for t in output],
        }})


@pytest.fixture
def fake_sglang() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_wrong_token_count_is_an_error_row(mpfa, fake_sglang):
    out = mpfa("logits", "--backend", "fa4-bf16,mpfa", "--url", f"{fake_sglang}/ok,{fake_sglang}/short",
               "--input-len", "16", "--prompts", "2", "--output-len", "4")
    assert out.returncode == 1
    assert "error: 1 row(s) failed: mpfa at 16: prompt 0 (16 tokens): server generated 3 tokens, 4 were requested" \
        in out.stderr
    assert "SIMULATED" not in out.stdout
    result = json.loads(_profiles(mpfa.db)[0]["result"])
    rows = {r["backend"]: r for r in result["rows"]}
    assert rows["fa4-bf16"]["error"] is None and rows["fa4-bf16"]["prefill_top1_agree"] is None
    assert "4 were requested" in rows["mpfa"]["error"]
    assert result["reference"]["16"]["prompt_logprob_std"] == 0  # the fake is flat: the table warns
    assert "near-uniform" in out.stdout


def test_url_servers_are_checked_against_their_backend(mpfa, fake_sglang):
    out = mpfa("logits", "--backend", "fa4-bf16,mpfa", "--url", f"{fake_sglang}/ok,{fake_sglang}/ok",
               "--input-len", "16", "--prompts", "1", "--output-len", "2")
    assert out.returncode == 1
    assert "server reports attention_backend=fa4, but backend 'mpfa' asks for mpfa" in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--backend", "fa4-bf16,nope"], "unknown backend 'nope'; valid: " + ", ".join(BACKENDS)),
    (["--ref", "nope"], "unknown backend 'nope'; valid: " + ", ".join(BACKENDS)),
    (["--backend", "fa4-bf16"], "give at least one backend besides the reference"),
    (["--input-len", "512,x"], "--input-len: expected comma-separated int values, got '512,x'"),
    (["--input-len", "1"], "--input-len: every length must be >= 2"),
    (["--prompts", "0"], "--prompts and --output-len must be >= 1"),
    (["--predicted-factor", "1"], "--predicted-factor must be > 1, got 1.0"),
    (["--backend", "fa4-bf16,mpfa", "--url", "http://127.0.0.1:1"], "--url: 1 URL(s) for 2 backend(s)"),
])
def test_bad_input_is_one_line_and_exit_2(mpfa, args, message):
    out = mpfa.invoke("logits", "--engine", "sim", *args)
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not mpfa.db.exists() or not _profiles(mpfa.db)
