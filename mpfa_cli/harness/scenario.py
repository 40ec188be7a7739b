"""Load scenarios from TOML, apply CLI overrides, and expand them into the load points a run measures."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError, field_names
from .latency_model import ModelShape
from .trace import MAX_SPEEDUP, Trace, load_trace
from .prefix_workloads import MAX_HISTORY_TOKENS, MultiTurn, SharedPrefix
from ...scenarios import MODEL_DIR, SCENARIO_DIR


@dataclass(frozen=True)
class LoadPoint:
    """One measured configuration: a context length at one concurrency or arrival rate, or a trace replayed at its
    timestamps divided by `speedup` (`input_len` then its longest prompt)."""

    input_len: int
    num_requests: int
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    trace: Trace | None = None
    speedup: float = 1.0

    @property
    def load(self) -> dict[str, Any]:
        if self.trace is not None:
            return {"trace": self.trace.name, "speedup": self.speedup}
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        return {"rate": self.rate, "burstiness": self.burstiness}

    @property
    def label(self) -> str:
        if self.trace is not None:
            return f"trace {self.trace.name} x{self.speedup:g}"
        load = f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate}/s"
        return f"{self.input_len // 1024}K {load}" if self.input_len >= 1024 else f"{self.input_len} {load}"



@dataclass
class Scenario:
    name: str
    description: str
    model: str
    input_len: list[int]
    output_len: int
    num_requests: int
    warmup_requests: int
    repeats: int
    seed: int
    concurrency: list[int] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    burstiness: float = 1.0
    explicit_points: list[LoadPoint] = field(default_factory=list)
    trace: Trace | None = None  # replayed instead of input_len x concurrency (or rate): `_with_trace`
    speedup: float = 1.0
    # Prompts that share prefixes on purpose (served with the prefix cache on); None: every prompt unshareable
    workload: SharedPrefix | MultiTurn | None = None

    @property
    def shares_prefixes(self) -> bool:
        return self.workload is not None or (self.trace is not None and self.trace.shares_prefixes)

    def points(self) -> list[LoadPoint]:
        """The `[[points]]` the file lists, else every input length at every concurrency (or rate), else the
        trace's replay."""
        if self.explicit_points:
            return self.explicit_points
        if self.trace is not None:
            return [LoadPoint(input_len=self.input_len[0], num_requests=self.num_requests, trace=self.trace,
                              speedup=self.speedup)]
        loads = [dict(concurrency=c) for c in self.concurrency] or [
            dict(rate=r, burstiness=self.burstiness) for r in self.rate
        ]
        return [LoadPoint(input_len=n, num_requests=self.num_requests, **load) for n in self.input_len for load in loads]

    def only(self, labels: list[str]) -> Scenario:
        """The scenario cut to the points named like their labels, e.g. "128K:c=1" (or "128K c=1"): a matrix run
        a few points at a time, each point's workload unchanged, and the server still sized for the whole
        scenario's longest prompt (`input_len`), as a full run's is."""
        by_key = {point_key(p.label): p for p in self.points()}
        unknown = [label for label in labels if point_key(label) not in by_key]
        if unknown:
            valid = ", ".join(p.label.replace(" ", ":") for p in self.points())
            raise UserError(f"scenario '{self.name}' has no point {', '.join(unknown)}; valid: {valid}")
        chosen = [by_key[key] for key in dict.fromkeys(point_key(label) for label in labels)]
        return dataclasses.replace(self, explicit_points=chosen)


def point_key(label: str) -> str:
    return re.sub(r"[\s:]+", ":", label.strip().lower())


_INT_FIELDS = ("output_len", "num_requests", "warmup_requests", "repeats", "seed")

# Upper bounds of a scenario's numbers: beyond them a run would not end in a working day or not fit in memory.
MAX_INPUT_LEN = 4 * 1024 * 1024
MAX_OUTPUT_LEN = 1024 * 1024
MAX_REQUESTS = 1_000_000
MAX_REPEATS = 1000
MAX_CONCURRENCY = 100_000
MAX_RATE = 1e6
MAX_SEED = 2**63 - 1



def load_problem(load: Any) -> str | None:
    """Why a load as stored with a run or a baseline entry is not one a scenario makes, if it is not: it must be
    {"concurrency": c}, {"rate": r[, "burstiness": b]} or {"trace": name, "speedup": s}, within the scenario
    bounds."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if isinstance(load, dict) and load.keys() == {"trace", "speedup"}:
        name, speedup = load["trace"], load["speedup"]
        if not (isinstance(name, str) and 0 < len(name) <= 200):
            return f"load trace {name!r:.40} is not a trace's name"
        if not (number(speedup) and 0 < speedup <= MAX_SPEEDUP):
            return f"load speedup {speedup!r:.40} is not a number in (0, {MAX_SPEEDUP:g}]"
        return None
    if isinstance(load, dict) and load.keys() == {"concurrency"}:
        concurrency = load["concurrency"]
        if isinstance(concurrency, int) and not isinstance(concurrency, bool) and 1 <= concurrency <= MAX_CONCURRENCY:
            return None
        return f"load concurrency {concurrency!r:.40} is not an integer in [1, {MAX_CONCURRENCY}]"
    if isinstance(load, dict) and "rate" in load and load.keys() <= {"rate", "burstiness"}:
        rate, burstiness = load["rate"], load.get("burstiness", 1.0)
        if not (number(rate) and 0 < rate <= MAX_RATE):
            return f"load rate {rate!r:.40} is not a number in (0, {MAX_RATE:g}]"
        if not (number(burstiness) and 0 < burstiness < math.inf):
            return f"load burstiness {burstiness!r:.40} is not a finite number > 0"
        return None
    return f"load {load!r:.60} is neither {{concurrency}}, {{rate, burstiness}} nor {{trace, speedup}}"


def available_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def scenario_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise UserError(f"scenario file not found: {path}")
        return path
    path = SCENARIO_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise UserError(
            f"unknown scenario '{name_or_path}'; valid: {', '.join(available_scenarios())} (or a path to a .toml file)"
        )
    return path


def _as_list(value: Any, kind: type | tuple[type, ...], where: str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        name = "int" if kind is int else "number"
        raise UserError(f"{where}: expected {'an' if kind is int else 'a'} {name} or a list of them, got {value!r:.40}")
    return values


def load_scenario(name_or_path: str, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read a scenario; `overrides` (CLI flags, None meaning "not given") replace fields before validation."""
    path = scenario_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read scenario file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a UTF-8 text file (byte {exc.start}); a scenario is TOML") from None
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        line = found.group(1) if found else "?"
        raise UserError(f"{path}:{line}: malformed TOML: {exc}") from None
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "points" in raw and {"input_len", "concurrency", "rate"} & set(given):
        raise UserError(f"{path}: lists its own [[points]]; --input-len, --concurrency and --rate do not apply")
    raw.update(given)
    for load, other in (("concurrency", "rate"), ("rate", "concurrency")):  # a load flag replaces the file's load
        if load in given:
            raw.pop(other, None)
    try:
        return _parse(raw, path)
    except UserError as exc:
        if not given:
            raise
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in given)
        raise UserError(f"{exc} (with {flags} given)") from None


def _parse(raw: dict[str, Any], path: Path) -> Scenario:
    """A scenario from its fields (the file's, flags applied), validated."""
    known = {f.name for f in dataclasses.fields(Scenario)} - {"name", "explicit_points", "workload"} | {"points"}
    known |= set(_WORKLOADS)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{path}: unknown field(s) {field_names(unknown)}; valid: {', '.join(sorted(known))}")
    if "points" in raw:
        if set(_WORKLOADS) & set(raw):
            raise UserError(f"{path}: [[points]] do not go with {' or '.join(_WORKLOADS)}")
        return _with_points(raw, path)
    if "trace" in raw:
        return _with_trace(raw, path)
    if "speedup" in raw:
        raise UserError(f"{path}: speedup applies to a trace replay (a scenario with trace = \"FILE.jsonl\")")
    workload = _workload(raw, path)
    missing = [f for f in ("model", "input_len", "output_len", "num_requests") if f not in raw]
    if missing:
        raise UserError(f"{path}: missing field(s) {', '.join(missing)}")
    if "concurrency" in raw and "rate" in raw:
        raise UserError(f"{path}: give either concurrency or rate, not both")
    if "concurrency" not in raw and "rate" not in raw:
        raise UserError(f"{path}: give a concurrency list or a request rate list")
    _check_int_fields(raw, path)
    scenario = Scenario(
        name=path.stem,
        description=raw.get("description", ""),
        model=raw["model"],
        input_len=_as_list(raw["input_len"], int, f"{path}: input_len"),
        output_len=raw["output_len"],
        num_requests=raw["num_requests"],
        warmup_requests=raw.get("warmup_requests", 0),
        repeats=raw.get("repeats", 1),
        seed=raw.get("seed", 0),
        concurrency=_as_list(raw["concurrency"], int, f"{path}: concurrency") if "concurrency" in raw else [],
        rate=[float(r) for r in _as_list(raw["rate"], (int, float), f"{path}: rate")] if "rate" in raw else [],
        burstiness=_burstiness(raw, path),
        workload=workload,
    )
    _validate(scenario, path)
    return scenario


# The tables that declare a workload sharing prefixes: its fields, and whether each is an int (else a number >= 0).
_WORKLOADS: dict[str, tuple[type[SharedPrefix] | type[MultiTurn], dict[str, bool]]] = {
    "shared_prefix": (SharedPrefix, {"groups": True, "prefix_len": True, "suffix_len": True, "per_group": True}),
    "multi_turn": (MultiTurn, {"conversations": True, "turns": True, "user_len": True, "think_time_s": False}),
}


def _workload(raw: dict[str, Any], path: Path) -> SharedPrefix | MultiTurn | None:
    """The `[shared_prefix]` or `[multi_turn]` table, validated; it sets `input_len` (the longest prompt) and
    `num_requests` in `raw`, which must not give them."""
    given = [name for name in _WORKLOADS if name in raw]
    if not given:
        return None
    if len(given) > 1:
        raise UserError(f"{path}: give [shared_prefix] or [multi_turn], not both")
    name = given[0]
    cls, fields = _WORKLOADS[name]
    table = raw.pop(name)
    where = f"{path}: [{name}]"
    if not isinstance(table, dict):
        raise UserError(f"{where}: expected a table of {', '.join(fields)}")
    if unknown := sorted(set(table) - set(fields)):
        raise UserError(f"{where}: unknown field(s) {field_names(unknown)}; valid: {', '.join(fields)}")
    if missing := [f for f, is_int in fields.items() if f not in table and is_int]:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}")
    for key, value in table.items():
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (isinstance(value, int) if fields[key] else is_number) or isinstance(value, bool):
            raise UserError(f"{where}: {key}: expected {'an integer' if fields[key] else 'a number'}, "
                            f"got {value!r:.40}")
        low = 1 if fields[key] else 0
        if not (low <= value < math.inf):
            raise UserError(f"{where}: {key} must be >= {low}, got {value}")
    if clash := [f for f in ("input_len", "num_requests") if f in raw]:
        raise UserError(f"{where} sets the prompts' lengths and count: {', '.join(clash)} do not apply")
    workload = cls(**table)
    if isinstance(workload, MultiTurn):
        if "rate" in raw:
            raise UserError(f"{where}: conversations run at a concurrency (conversations in flight), not a rate")
        output_len = raw.get("output_len", 1)
        longest = workload.prompt_len(workload.turns, output_len if isinstance(output_len, int) else 1)
        if longest + output_len > MAX_HISTORY_TOKENS:
            raise UserError(f"{where}: the last turn's history ({longest} + {output_len} tokens) exceeds "
                            f"{MAX_HISTORY_TOKENS} tokens")
        raw["input_len"] = longest
    else:
        raw["input_len"] = workload.input_len
    raw["num_requests"] = workload.num_requests
    return workload


def _check_int_fields(raw: dict[str, Any], path: Path) -> None:
    for key in _INT_FIELDS:
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
            raise UserError(f"{path}: {key}: expected an integer, got {raw[key]!r:.40}")
    for key in ("model", "description"):
        if key in raw and not isinstance(raw[key], str):
            raise UserError(f"{path}: {key}: expected a string, got {raw[key]!r:.40}")


def _burstiness(raw: dict[str, Any], path: Path) -> float:
    value = raw.get("burstiness", 1.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserError(f"{path}: burstiness: expected a number, got {value!r:.40}")
    return float(value)


_POINT_FIELDS = {"input_len", "concurrency", "rate", "num_requests"}


def _with_points(raw: dict[str, Any], path: Path) -> Scenario:
    """A scenario of explicit `[[points]]`: each names its input_len, its concurrency or rate, and optionally its
    own num_requests (default: the top-level one). For matrices that are not a full cross product."""
    points = raw.pop("points")
    clash = sorted({"input_len", "concurrency", "rate"} & set(raw))
    if clash:
        raise UserError(f"{path}: give [[points]] or {', '.join(clash)}, not both")
    missing = [f for f in ("model", "output_len") if f not in raw]
    if missing:
        raise UserError(f"{path}: missing field(s) {', '.join(missing)}")
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) for p in points):
        raise UserError(f"{path}: points must be a non-empty array of tables ([[points]])")
    _check_int_fields(raw, path)
    burstiness = _burstiness(raw, path)
    explicit = [_point(p, raw.get("num_requests"), burstiness, f"{path}: points[{i}]") for i, p in enumerate(points)]
    scenario = Scenario(
        name=path.stem, description=raw.get("description", ""), model=raw["model"], burstiness=burstiness,
        input_len=sorted({p.input_len for p in explicit}), output_len=raw["output_len"],
        num_requests=max(p.num_requests for p in explicit), warmup_requests=raw.get("warmup_requests", 0),
        repeats=raw.get("repeats", 1), seed=raw.get("seed", 0),
        concurrency=sorted({p.concurrency for p in explicit if p.concurrency is not None}),
        rate=sorted({p.rate for p in explicit if p.rate is not None}), explicit_points=explicit,
    )
    _validate(scenario, path)
    return scenario


def _with_trace(raw: dict[str, Any], path: Path) -> Scenario:
    """A scenario that replays a trace (`trace.py`), named by a path relative to the scenario file's folder: its
    requests, lengths and send times come from the trace, sped up `speedup` times."""
    clash = sorted({"input_len", "output_len", "num_requests", "concurrency", "rate", "burstiness"} & set(raw))
    if clash:
        raise UserError(f"{path}: a trace sets each request's lengths and send time; {', '.join(clash)} do not apply")
    if "model" not in raw:
        raise UserError(f"{path}: missing field(s) model")
    if not isinstance(raw["trace"], str):
        raise UserError(f"{path}: trace: expected a path to a JSONL file, got {raw['trace']!r:.40}")
    speedup = raw.get("speedup", 1.0)
    if not isinstance(speedup, (int, float)) or isinstance(speedup, bool) or not 0 < speedup <= MAX_SPEEDUP:
        raise UserError(f"{path}: speedup: expected a number in (0, {MAX_SPEEDUP:g}], got {speedup!r:.40}")
    _check_int_fields(raw, path)
    trace = load_trace(path.parent / raw["trace"])
    scenario = Scenario(
        name=path.stem, description=raw.get("description", ""), model=raw["model"],
        input_len=[max(r.input_length for r in trace.requests)],
        output_len=max(r.output_length for r in trace.requests), num_requests=len(trace.requests),
        warmup_requests=raw.get("warmup_requests", 0), repeats=raw.get("repeats", 1), seed=raw.get("seed", 0),
        trace=trace, speedup=float(speedup),
    )
    _validate(scenario, path)
    return scenario


def _point(table: dict[str, Any], num_requests: int | None, burstiness: float, where: str) -> LoadPoint:
    unknown = sorted(set(table) - _POINT_FIELDS)
    if unknown:
        raise UserError(f"{where}: unknown field(s) {field_names(unknown)}; valid: {', '.join(sorted(_POINT_FIELDS))}")
    if ("concurrency" in table) == ("rate" in table):
        raise UserError(f"{where}: give either concurrency or rate")
    for key in ("input_len", "concurrency", "num_requests"):
        if key in table and (not isinstance(table[key], int) or isinstance(table[key], bool)):
            raise UserError(f"{where}: {key}: expected int, got {table[key]!r}")
    count = table.get("num_requests", num_requests)
    if "input_len" not in table or count is None:
        raise UserError(f"{where}: needs input_len and num_requests (here or at the top level)")
    if "rate" in table:
        rate = table["rate"]
        if not isinstance(rate, (int, float)) or isinstance(rate, bool):
            raise UserError(f"{where}: rate: expected a number, got {rate!r}")
        return LoadPoint(input_len=table["input_len"], num_requests=count, rate=float(rate), burstiness=burstiness)
    return LoadPoint(input_len=table["input_len"], num_requests=count, concurrency=table["concurrency"])


def _validate(s: Scenario, path: Path) -> None:
    checks = [
        (all(1 <= n <= MAX_INPUT_LEN for n in s.input_len), f"input_len must be in [1, {MAX_INPUT_LEN}]"),
        (1 <= s.output_len <= MAX_OUTPUT_LEN,
         f"output_len must be in [1, {MAX_OUTPUT_LEN}] (the client measures generated tokens)"),
        (all(1 <= n <= MAX_REQUESTS for n in (s.num_requests, *(p.num_requests for p in s.points()))),
         f"num_requests must be in [1, {MAX_REQUESTS}]"),
        (0 <= s.warmup_requests <= MAX_REQUESTS, f"warmup_requests must be in [0, {MAX_REQUESTS}]"),
        (1 <= s.repeats <= MAX_REPEATS, f"repeats must be in [1, {MAX_REPEATS}]"),
        (all(1 <= c <= MAX_CONCURRENCY for c in s.concurrency), f"concurrency must be in [1, {MAX_CONCURRENCY}]"),
        (all(0 < r <= MAX_RATE for r in s.rate), f"rate must be in (0, {MAX_RATE:g}] requests/s"),
        (0 < s.burstiness < math.inf, "burstiness must be a finite number > 0"),
        (0 <= s.seed <= MAX_SEED, f"seed must be in [0, {MAX_SEED}]"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"{path}: {message}")


def model_dir(model: str) -> Path:
    """A bundled config name (dummy weights) or a directory holding a HuggingFace config.json."""
    path = MODEL_DIR / model if is_bundled_model(model) else Path(model)
    if not path.is_dir():
        names = ", ".join(sorted(p.name for p in MODEL_DIR.iterdir() if p.is_dir()))
        raise UserError(f"model '{model}' is neither a bundled config ({names}) nor a directory")
    if not (path / "config.json").is_file():
        raise UserError(f"model directory {path} has no config.json")
    return path


def load_model_shape(model: str) -> ModelShape:
    """The geometry of a bundled model config or of a model directory's HuggingFace config.json."""
    path = model_dir(model)
    return ModelShape.from_hf_config(path.name, json.loads((path / "config.json").read_text()))


def is_bundled_model(model: str) -> bool:
    """A bundled config's bare name. Not a path: `MODEL_DIR / "/abs/dir"` is "/abs/dir", and a directory given as a
    path holds real weights (served without `--load-format dummy`)."""
    return Path(model).name == model and model not in ("", ".", "..") and (MODEL_DIR / model).is_dir()


def without_bundled_model_paths(info: dict[str, Any], model: str) -> dict[str, Any]:
    """`info` (a server's own report) with the bundled config's absolute directory replaced by its name, so that
    stored runs and their exports name no path of the machine they ran on."""
    if not is_bundled_model(model):
        return info
    return json.loads(json.dumps(info).replace(json.dumps(str(MODEL_DIR / model))[1:-1], model))
