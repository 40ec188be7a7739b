"""Mooncake-layout traces: the parser's checks (one error naming the line), the token ids built from hash ids, the
send times, and the scenarios that replay a trace."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.scenario import load_problem, load_scenario
from mpfa.mpfa_cli.harness.trace import BLOCK_TOKENS, MAX_LINE_CHARS, block_token_ids, load_trace
from mpfa.scenarios import SCENARIO_DIR

SAMPLE = SCENARIO_DIR / "traces" / "mooncake-sample.jsonl"


def _line(timestamp=0, input_length=600, output_length=8, hash_ids=(1, 2), **extra) -> str:
    row = {"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
           "hash_ids": list(hash_ids), **extra}
    return json.dumps(row)


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_valid_trace_is_read_in_order_with_its_lengths(tmp_path):
    path = _write(tmp_path, _line(0, 600, 8, (1, 2)), "", _line(250, 512, 3, (1,)), _line(250.5, 1, 1, (9,)))
    trace = load_trace(path)
    assert trace.name == "t"
    assert [r.timestamp_ms for r in trace.requests] == [0, 250, 250.5]
    assert [len(p) for p in trace.prompts()] == [600, 512, 1]
    assert trace.output_lengths() == [8, 3, 1]


@pytest.mark.parametrize("line, error", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 5, "input_length": 10, "hash_ids": [1]}), "missing field(s) output_length"),
    (_line(timestamp="5"), "timestamp: expected a finite number"),
    (_line(timestamp=-1), "timestamp: expected a finite number"),
    (_line(input_length=0, hash_ids=()), "input_length: expected an integer in [1,"),
    (_line(input_length=600.0), "input_length: expected an integer"),
    (_line(output_length=-3), "output_length: expected an integer in [1,"),
    (_line(output_length=True), "output_length: expected an integer"),
    (_line(hash_ids=(1, -2)), "hash_ids: expected a list of integers"),
    (_line(hash_ids="12"), "hash_ids: expected a list of integers"),
    (_line(input_length=600, hash_ids=(1,)), "input_length 600 takes 2 block(s) of 512 tokens, but hash_ids lists 1"),
    (_line(input_length=512, hash_ids=(1, 2)), "input_length 512 takes 1 block(s)"),
    (_line(timestamp=50), "timestamp 50 is before the previous line's 100"),
    ("x" * (MAX_LINE_CHARS + 1), f"line longer than {MAX_LINE_CHARS} characters"),
])
def test_a_malformed_line_is_one_error_naming_its_line(tmp_path, line, error):
    path = _write(tmp_path, _line(0), _line(100, hash_ids=(3, 4)), line, _line(200))
    with pytest.raises(UserError) as caught:
        load_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and error in message
    assert "\n" not in message


@pytest.mark.parametrize("content, error", [
    (b"", "holds no request"),
    (b"\n\n", "holds no request"),
    (b"\xff\xfe", "not a UTF-8 text file"),
])
def test_an_empty_or_binary_trace_is_refused(tmp_path, content, error):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=error):
        load_trace(path)


def test_a_missing_trace_is_one_error(tmp_path):
    with pytest.raises(UserError, match="cannot read trace file"):
        load_trace(tmp_path / "none.jsonl")


def test_prompts_share_exactly_the_leading_blocks_whose_hash_ids_agree():
    trace = load_trace(SAMPLE)
    prompts = trace.prompts()
    shared_pairs = 0
    for i, (a, ra) in enumerate(zip(prompts, trace.requests)):
        assert len(a) == ra.input_length
        for b, rb in zip(prompts[:i], trace.requests[:i]):
            blocks = _common_prefix(list(ra.hash_ids), list(rb.hash_ids))
            assert _common_prefix(a, b) == min(blocks * BLOCK_TOKENS, len(a), len(b))
            shared_pairs += blocks > 0
    assert shared_pairs > 100  # the sample trace shares document prefixes, as it says
    assert len(set(map(tuple, prompts))) == len(prompts)  # and no prompt twice


def test_a_block_is_the_same_tokens_wherever_it_appears_in_a_run_and_the_last_is_cut(tmp_path):
    trace = load_trace(_write(tmp_path, _line(0, 700, 1, (7, 8)), _line(1, 512, 1, (8,)), _line(2, 600, 1, (7, 9))))
    first, second, third = trace.prompts(seed=3, run=1)
    assert first[512:] == second[:188] and first[:512] == third[:512]
    assert second == block_token_ids(8, 3, 1, 3 + 1)  # slots: ids in order (7, 8, 9), after run 0's three
    assert len({first[0], second[0], third[512]}) == 3  # each block opens with its own token


def test_a_later_run_shares_no_first_token_with_an_earlier_one_and_the_seed_changes_every_block():
    trace = load_trace(SAMPLE)
    run0, run1, seed1 = trace.prompts(0, 0), trace.prompts(0, 1), trace.prompts(1, 0)
    assert {p[0] for p in run0}.isdisjoint(p[0] for p in run1)  # a repeat hits nothing an earlier one cached
    assert all(a[1:512] != b[1:512] for a, b in zip(run0, seed1))


def _most_cached_brute(prompts: list[list[int]], page: int) -> int:
    total = 0
    for i, a in enumerate(prompts):
        held = max((_common_prefix(a, b) for b in prompts[:i]), default=0)
        total += min(held, len(a) - 1) // page * page
    return total


@pytest.mark.parametrize("page", [1, 128])
def test_most_cached_tokens_is_each_requests_longest_earlier_prefix(page):
    trace = load_trace(SAMPLE)
    assert trace.shares_prefixes
    most = trace.most_cached_tokens(page)
    assert most == _most_cached_brute(trace.prompts(), page) > 0


def test_most_cached_tokens_of_a_small_trace(tmp_path):
    # request 2 holds request 1's 700 tokens but its last; request 3 shares block 7 only; request 4 nothing
    trace = load_trace(_write(tmp_path, _line(0, 700, 1, (7, 8)), _line(1, 700, 1, (7, 8)),
                              _line(2, 1024, 1, (7, 9)), _line(3, 100, 1, (5,))))
    assert trace.most_cached_tokens(1) == 699 + 512
    assert trace.most_cached_tokens(128) == 640 + 512
    unshared = load_trace(_write(tmp_path, _line(0, 700, 1, (7, 8)), _line(1, 512, 1, (8,))))
    assert not unshared.shares_prefixes and unshared.most_cached_tokens(1) == 0


def test_send_times_are_the_timestamps_from_the_first_divided_by_the_speedup(tmp_path):
    trace = load_trace(_write(tmp_path, _line(1000), _line(1500), _line(4000)))
    assert trace.send_times(1.0) == [0.0, 0.5, 3.0]
    assert trace.send_times(2.0) == [0.0, 0.25, 1.5]
    with pytest.raises(ValueError):
        trace.send_times(0.0)


def test_the_shipped_scenario_replays_the_shipped_trace():
    scenario = load_scenario("mooncake-sample")
    [point] = scenario.points()
    assert point.trace is not None and point.num_requests == len(point.trace.requests) >= 50
    assert point.input_len == max(r.input_length for r in point.trace.requests)
    assert point.load == {"trace": "mooncake-sample", "speedup": 1.0}
    assert load_problem(point.load) is None
    assert load_scenario("mooncake-sample", {"speedup": 4.0}).points()[0].label == "trace mooncake-sample x4"


def test_the_shipped_trace_is_what_its_generator_writes(tmp_path):
    generator = SCENARIO_DIR / "traces" / "make_mooncake_sample.py"
    copy = tmp_path / generator.name
    copy.write_text(generator.read_text())
    namespace: dict = {"__file__": str(copy), "__name__": "generator"}
    exec(compile(copy.read_text(), str(copy), "exec"), namespace)
    namespace["main"]()
    assert (tmp_path / "mooncake-sample.jsonl").read_text() == SAMPLE.read_text()


@pytest.mark.parametrize("fields, error", [
    ({"input_len": 512}, "input_len do not apply"),
    ({"rate": 1.0}, "rate do not apply"),
    ({"speedup": 0}, "speedup: expected a number in (0,"),
    ({"trace": 3}, "trace: expected a path"),
    ({"trace": "missing.jsonl"}, "cannot read trace file"),
])
def test_a_trace_scenario_refuses_what_does_not_apply(tmp_path, fields, error):
    (tmp_path / "t.jsonl").write_text(_line() + "\n")
    raw = {"model": "llama-3.1-8b", "trace": "t.jsonl", **fields}
    path = tmp_path / "s.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in raw.items()))
    with pytest.raises(UserError, match=error.replace("(", r"\(")):
        load_scenario(str(path))


def test_speedup_without_a_trace_is_refused():
    with pytest.raises(UserError, match="speedup applies to a trace replay.*--speedup given"):
        load_scenario("smoke", {"speedup": 2.0})


@pytest.mark.parametrize("load, ok", [
    ({"trace": "t", "speedup": 2}, True),
    ({"trace": "", "speedup": 2}, False),
    ({"trace": "t", "speedup": 0}, False),
    ({"trace": "t"}, False),
])
def test_a_stored_trace_load_is_checked(load, ok):
    assert (load_problem(load) is None) == ok
