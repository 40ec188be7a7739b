"""`mpfa logits`' comparison math on hand-made SGLang responses, and the simulator's logprobs over real HTTP."""
from __future__ import annotations

import json

import pytest

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.accuracy.logits import (LogitsResult, ResponseError, Row, Sample, compare, first_divergence,
                                           parse_response, reference_stats, request_body)
from mpfa.mpfa_cli.harness.serving_workload import make_prompt


def response(prompt: list[int], output: list[int], prompt_lps: list[float], output_lps: list[float],
             top: list[int] | None = None, **meta: object) -> dict:
    """A `/generate` body laid out as SGLang 0.5.15 returns it with --skip-tokenizer-init."""
    body = {
        "output_ids": output,
        "meta_info": {
            "prompt_tokens": len(prompt), "completion_tokens": len(output),
            "input_token_logprobs": [[None, prompt[0], None]] + [[lp, t, None] for lp, t in zip(prompt_lps, prompt[1:])],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(output_lps, output)],
            **meta,
        },
    }
    if top is not None:
        body["meta_info"]["input_top_logprobs"] = [None] + [[[-0.1, t, None]] for t in top]
    return body


PROMPT = [5, 6, 7, 8]
OUT = [11, 12, 13]


def sample(prompt_lps, output, output_lps, top=None) -> Sample:
    return parse_response(response(PROMPT, output, prompt_lps, output_lps, top), PROMPT, len(output))


def test_request_asks_for_every_logprob_greedily():
    body = request_body([1, 2, 3], 16)
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0 and body["top_logprobs_num"] == 1
    assert body["sampling_params"] == {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}


def test_parse_skips_position_zero_and_reads_top_ids():
    s = sample([-1.0, -2.0, -3.0], OUT, [-0.5, -0.6, -0.7], top=[6, 9, 8])
    assert s.prompt_logprobs == [-1.0, -2.0, -3.0]
    assert s.prompt_top_ids == [6, 9, 8]
    assert s.output_ids == OUT and s.output_logprobs == [-0.5, -0.6, -0.7]
    assert sample([-1.0, -2.0, -3.0], OUT, [-0.5] * 3).prompt_top_ids is None  # no top logprobs returned


@pytest.mark.parametrize("change, message", [
    (lambda b: b.update(output_ids=OUT[:2]), "2 output ids, 3 were requested"),
    (lambda b: b["meta_info"].update(completion_tokens=2), "generated 2 tokens, 3 were requested"),
    (lambda b: b["meta_info"].update(prompt_tokens=5), "counted 5 prompt tokens, 4 were sent"),
    (lambda b: b["meta_info"]["input_token_logprobs"].pop(), "3 input_token_logprobs for a prompt of 4"),
    (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "2 output_token_logprobs for 3 output"),
    (lambda b: b["meta_info"]["input_token_logprobs"][2].__setitem__(1, 99), r"\[2\] is for token 99"),
    (lambda b: b["meta_info"]["input_token_logprobs"][1].__setitem__(0, None), "not a finite logprob"),
    (lambda b: b["meta_info"].pop("input_token_logprobs"), "ignore return_logprob"),
    (lambda b: b.update(error={"message": "boom"}), "server error: boom"),
])
def test_count_and_id_mismatches_are_errors(change, message):
    body = response(PROMPT, OUT, [-1.0, -2.0, -3.0], [-0.5, -0.6, -0.7])
    change(body)
    with pytest.raises(ResponseError, match=message):
        parse_response(body, PROMPT, len(OUT))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [7, 2, 3]) == 0


def test_compare_prefill_deltas_top1_and_decode_up_to_divergence():
    ref = [sample([-1.0, -2.0, -3.0], OUT, [-0.5, -0.6, -0.7], top=[6, 7, 8]),
           sample([-1.0, -1.0, -1.0], OUT, [-0.5, -0.5, -0.5], top=[6, 7, 8])]
    other = [sample([-1.1, -2.0, -2.8], OUT, [-0.4, -0.6, -0.7], top=[6, 7, 9]),  # identical output ids
             sample([-1.0, -1.0, -1.4], [11, 99, 13], [-0.25, -9.0, -9.0], top=[6, 7, 8])]  # diverges at 1
    row = compare("mpfa", 4, ref, other)
    assert row.error is None and row.prompts == 2 and row.prefill_positions == 6
    assert row.prefill_mean_abs == pytest.approx((0.1 + 0 + 0.2 + 0 + 0 + 0.4) / 6)
    assert row.prefill_max_abs == pytest.approx(0.4)
    assert 0.2 < row.prefill_p99_abs <= 0.4
    assert row.prefill_top1_agree == pytest.approx(5 / 6)
    assert row.first_divergence == [None, 1] and row.earliest_divergence == 1
    assert row.decode_identical == 0.5
    # prompt 0: all 3 positions (0.1, 0, 0); prompt 1: only position 0 (0.25) — after the split contexts differ
    assert row.decode_compared == 4
    assert row.decode_mean_abs == pytest.approx((0.1 + 0.25) / 4)
    assert row.decode_max_abs == pytest.approx(0.25)


def test_compare_with_itself_is_exact_and_without_tops_has_no_agreement():
    ref = [sample([-1.0, -2.0, -3.0], OUT, [-0.5, -0.6, -0.7])]
    row = compare("fa4-bf16", 4, ref, ref)
    assert row.prefill_mean_abs == 0 and row.decode_mean_abs == 0 and row.decode_identical == 1.0
    assert row.prefill_top1_agree is None and row.first_divergence == [None]


def test_compare_refuses_mismatched_sample_counts():
    ref = [sample([-1.0, -2.0, -3.0], OUT, [-0.5, -0.6, -0.7])]
    assert compare("x", 4, ref, ref + ref).error == "2 samples vs the reference's 1"


def test_threshold_ignores_the_reference_and_error_rows():
    rows = [Row("fa4-bf16", 8, 1, prefill_mean_abs=0.5), Row("mpfa", 8, 1, prefill_mean_abs=0.01, decode_mean_abs=0.2),
            Row("mpfa-direct", 8, 1, prefill_mean_abs=0.01), Row("flashinfer-fp8", 8, 1, error="boom")]
    result = LogitsResult(ref="fa4-bf16", model="m", simulated=False, output_len=3, seed=0, rows=rows, reference={})
    assert [r.backend for r in result.over_threshold(0.1)] == ["mpfa"]
    assert result.over_threshold(1.0) == []
    assert json.loads(json.dumps(result.to_json()))["rows"][1]["decode_mean_abs"] == 0.2


def test_reference_stats_spread():
    stats = reference_stats([sample([-1.0, -2.0, -3.0], OUT, [-0.5] * 3)])
    assert stats["prompt_logprob_mean"] == pytest.approx(-2.0)
    assert stats["prompt_logprob_std"] == pytest.approx((2 / 3) ** 0.5)


# --- the simulator ---------------------------------------------------------------------------------------------


def _logprob_answer(server, prompt: list[int], max_new: int) -> dict:
    status, raw = server.post("/generate", request_body(prompt, max_new))
    assert status == 200, raw
    return json.loads(raw)


def test_sim_returns_sglang_logprob_layout_deterministically(start_sim):
    ref, other = start_sim("fa4-bf16"), start_sim("mpfa-direct")
    prompt = make_prompt(seed=4, index=0, input_len=50)
    body = _logprob_answer(ref, prompt, 6)
    meta = body["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, prompt[0], None]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 1
    assert [t[0][1] for t in meta["output_top_logprobs"]] == body["output_ids"]  # greedy: output is the top-1
    assert all(lp < 0 for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"])
    a, b = parse_response(body, prompt, 6), parse_response(_logprob_answer(other, prompt, 6), prompt, 6)
    assert parse_response(_logprob_answer(ref, prompt, 6), prompt, 6) == a  # deterministic
    row = compare("mpfa-direct", 50, [a], [b])
    assert 0 < row.prefill_max_abs <= BACKENDS["mpfa-direct"].sim.logprob_perturbation
    assert row.decode_identical == 1.0 and row.prefill_top1_agree == 1.0


def test_sim_without_return_logprob_is_unchanged(sim):
    status, raw = sim.post("/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200
    meta = json.loads(raw)["meta_info"]
    assert "input_token_logprobs" not in meta and "output_token_logprobs" not in meta


def test_sim_logprob_options_validated(sim):
    body = {**request_body([3, 4, 5], 2), "logprob_start_len": 3}
    status, raw = sim.post("/generate", body)
    assert status == 400 and b"logprob_start_len" in raw
    status, raw = sim.post("/generate", {**request_body([3, 4, 5], 2), "top_logprobs_num": -1})
    assert status == 400 and b"top_logprobs_num" in raw
    no_top = {**request_body([3, 4, 5], 2), "top_logprobs_num": 0, "logprob_start_len": -1}
    meta = json.loads(sim.post("/generate", no_top)[1])["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2
    assert "input_top_logprobs" not in meta
