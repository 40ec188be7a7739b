"""Scenario files: every bundled one loads; overrides, expansion and bad input give clear errors."""
from pathlib import Path

import pytest

from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.scenario import available_scenarios, load_scenario, model_dir, without_bundled_model_paths


def test_bundled_scenarios_load_and_expand() -> None:
    names = available_scenarios()
    assert {"smoke", "long16k", "long32k", "long64k", "long128k", "paper-sweep"} <= set(names)
    for name in names:
        assert load_scenario(name).points()
    sweep = load_scenario("paper-sweep")
    assert {p.input_len for p in sweep.points()} == {16384, 32768, 65536, 131072}
    assert {p.concurrency for p in sweep.points()} == {1, 8, 16}
    assert sweep.output_len == 1024 and sweep.repeats == 5


def test_overrides_replace_fields() -> None:
    s = load_scenario("long32k", {"concurrency": [8], "input_len": [65536], "repeats": 2, "seed": None})
    assert [(p.input_len, p.concurrency) for p in s.points()] == [(65536, 8)]
    assert s.repeats == 2 and s.seed == 0


def test_a_load_flag_replaces_the_files_load_of_either_kind() -> None:
    assert [p.load for p in load_scenario("long32k", {"rate": [2.0]}).points()] == [{"rate": 2.0, "burstiness": 1.0}]
    assert [p.load for p in load_scenario("poisson-32k", {"concurrency": [4]}).points()] == [{"concurrency": 4}]


@pytest.mark.parametrize("overrides, message", [
    ({"seed": -1}, r"smoke\.toml: seed must be in \[0, .* \(with --seed given\)"),
    ({"rate": [float("inf")]}, r"rate must be in \(0, 1e\+06\] requests/s \(with --rate given\)"),
    ({"input_len": [10**9], "repeats": 2}, r"input_len must be in \[1, .* \(with --input-len, --repeats given\)"),
])
def test_a_bad_flag_value_names_the_flag(overrides: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        load_scenario("smoke", overrides)


def test_rate_scenario_expands_to_arrival_points() -> None:
    points = load_scenario("poisson-32k").points()
    assert [p.load for p in points] == [{"rate": 0.5, "burstiness": 1.0}, {"rate": 1.0, "burstiness": 1.0}]


def test_unknown_scenario_lists_valid_names() -> None:
    with pytest.raises(UserError, match="unknown scenario 'nope'; valid: .*long32k"):
        load_scenario("nope")


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('model = "llama-3.1-8b"\ninput_len = 512\noutput_len = = 3\n')
    with pytest.raises(UserError, match=r"bad\.toml:3: malformed TOML"):
        load_scenario(str(path))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_requests": 0}, r"num_requests must be in \[1, "),
        ({"output_len": 0}, r"output_len must be in \[1, "),
        ({"concurrency": [0]}, r"concurrency must be in \[1, "),
        ({"typo_field": 1}, "unknown field"),
        ({"rate": [1.0]}, "either concurrency or rate"),
        ({"input_len": "long"}, "input_len: expected an int"),
    ],
)
def test_invalid_fields_are_rejected(scenario_file, fields: dict, message: str) -> None:
    path = scenario_file(**fields)
    with pytest.raises(UserError, match=message):
        load_scenario(str(path))


def test_model_dir_needs_config_json(tmp_path: Path) -> None:
    assert (model_dir("llama-3.1-8b") / "config.json").is_file()
    with pytest.raises(UserError, match="has no config.json"):
        model_dir(str(tmp_path))
    with pytest.raises(UserError, match="neither a bundled config"):
        model_dir(str(tmp_path / "missing"))


def test_explicit_points_carry_their_own_request_counts() -> None:
    s = load_scenario("serving-matrix")
    assert [(p.input_len, p.concurrency, p.num_requests) for p in s.points()][:2] == [(131072, 1, 3), (32768, 1, 3)]
    assert {(p.input_len, p.concurrency) for p in s.points()} == {(n, c) for n in (16384, 32768, 65536, 131072)
                                                                    for c in (1, 8)}
    assert all(p.num_requests == {1: 3, 8: 16}[p.concurrency] for p in s.points())
    assert s.input_len == [16384, 32768, 65536, 131072] and s.output_len == 1024


def test_explicit_points_take_the_top_level_request_count(tmp_path: Path) -> None:
    path = tmp_path / "pts.toml"
    path.write_text('model = "llama-3.1-8b"\noutput_len = 8\nnum_requests = 3\n'
                    '[[points]]\ninput_len = 64\nrate = 2\n[[points]]\ninput_len = 128\nconcurrency = 2\nnum_requests = 5\n')
    points = load_scenario(str(path)).points()
    assert [(p.input_len, p.load, p.num_requests) for p in points] == [
        (64, {"rate": 2.0, "burstiness": 1.0}, 3), (128, {"concurrency": 2}, 5)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('input_len = 64\n[[points]]\ninput_len = 64\nconcurrency = 1\n', "give \\[\\[points\\]\\] or input_len"),
        ('[[points]]\ninput_len = 64\n', "either concurrency or rate"),
        ('[[points]]\ninput_len = 64\nconcurrency = 1\nrate = 1\n', "either concurrency or rate"),
        ('[[points]]\nconcurrency = 1\n', "needs input_len"),
        ('[[points]]\ninput_len = 64\nconcurrency = 1\ncolour = 1\n', "points\\[0\\]: unknown field"),
        ('[[points]]\ninput_len = 64\nconcurrency = 1\nnum_requests = 0\n', r"num_requests must be in \[1, "),
        ('[[points]]\ninput_len = "x"\nconcurrency = 1\n', "input_len: expected int"),
        ('points = 3\n', "non-empty array of tables"),
    ],
)
def test_bad_points_are_rejected(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('model = "llama-3.1-8b"\noutput_len = 8\nnum_requests = 1\n' + body)
    with pytest.raises(UserError, match=message):
        load_scenario(str(path))


def test_points_scenario_refuses_point_overrides() -> None:
    with pytest.raises(UserError, match="lists its own \\[\\[points\\]\\]"):
        load_scenario("serving-matrix", {"concurrency": [4]})
    assert load_scenario("serving-matrix", {"output_len": 16}).output_len == 16


def test_only_cuts_a_scenario_to_named_points() -> None:
    s = load_scenario("serving-matrix").only(["32k:c=8"])
    assert [(p.input_len, p.concurrency, p.num_requests) for p in s.points()] == [(32768, 8, 16)]
    assert max(s.input_len) == 131072  # the server stays sized as for the whole scenario
    sweep = load_scenario("paper-sweep").only(["128K c=8", "16K:c=1", "128K:c=8"])
    assert [p.label for p in sweep.points()] == ["128K c=8", "16K c=1"]
    with pytest.raises(UserError, match="no point 64K:c=2; valid: 16K:c=1, 16K:c=8"):
        load_scenario("paper-sweep").only(["64K:c=2"])


def test_server_info_names_bundled_models_without_their_path() -> None:
    where = str(model_dir("llama-3.1-8b"))
    info = {"model_path": where, "states": [{"tokenizer_path": where}], "port": 30000, "other": "/elsewhere/x"}
    kept = without_bundled_model_paths(info, "llama-3.1-8b")
    assert kept == {"model_path": "llama-3.1-8b", "states": [{"tokenizer_path": "llama-3.1-8b"}], "port": 30000,
                    "other": "/elsewhere/x"}
    assert without_bundled_model_paths(info, "/some/own/model") is info


def test_a_model_directory_is_served_with_its_own_weights(tmp_path: Path) -> None:
    """Only a bundled config's bare name gets SGLang's dummy weights; a directory (here an absolute path, which
    `MODEL_DIR / path` would return unchanged) is loaded from its checkpoint."""
    from mpfa.backends.specs import BACKENDS
    from mpfa.mpfa_cli.harness.engines import sglang_launch

    (tmp_path / "config.json").write_text("{}")
    given_dir = sglang_launch(BACKENDS["fa4-bf16"], 30000, str(tmp_path), 4096, 1, 1, []).command
    bundled = sglang_launch(BACKENDS["fa4-bf16"], 30000, "llama-3.1-8b", 4096, 1, 1, []).command
    assert "--load-format" not in given_dir and given_dir[given_dir.index("--model-path") + 1] == str(tmp_path)
    assert bundled[bundled.index("--load-format") + 1] == "dummy"


def test_a_server_with_the_wrong_weights_is_refused(tmp_path: Path) -> None:
    """SGLang reports its load format: dummy weights for a directory (or real ones for a bundled name) stop the run."""
    from mpfa.mpfa_cli.bench.runner import verify_weights

    verify_weights({"load_format": "dummy"}, "llama-3.1-8b")
    verify_weights({"server_args": {"load_format": "auto"}}, str(tmp_path))
    verify_weights({}, str(tmp_path))  # a server that does not say (another engine): nothing to check
    with pytest.raises(UserError, match="load_format=dummy, but model .* means the weights in"):
        verify_weights({"load_format": "dummy"}, str(tmp_path))
    with pytest.raises(UserError, match="load_format=auto, but model 'llama-3.1-8b' means dummy weights"):
        verify_weights({"load_format": "auto"}, "llama-3.1-8b")
