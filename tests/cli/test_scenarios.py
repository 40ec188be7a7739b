"""Scenario files: every bundled one loads; overrides, expansion and bad input give clear errors."""
from pathlib import Path

import pytest

from mpfa.cli.errors import UserError
from mpfa.cli.scenario import available_scenarios, load_scenario, model_dir


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
        ({"num_requests": 0}, "num_requests must be >= 1"),
        ({"output_len": 0}, "output_len must be >= 1"),
        ({"concurrency": [0]}, "concurrency must be >= 1"),
        ({"typo_field": 1}, "unknown field"),
        ({"rate": [1.0]}, "either concurrency or rate"),
        ({"input_len": "long"}, "input_len: expected int"),
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
