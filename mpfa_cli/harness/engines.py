"""How a run gets a server: launch SGLang, launch the built-in simulator, or use a server at a given URL."""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ...backends.kv_scales import KVScalesError, read_kv_scales
from ...backends.specs import BACKENDS, BackendSpec, UnknownBackend, backend_spec
from ..errors import UserError
from .scenario import is_bundled_model, model_dir

ENGINES = ("auto", "sim", "sglang", "url")
READY_TIMEOUT_S = {"sim": 60.0, "sglang": 900.0}
# SGLang 0.5.15 puts its gRPC port at the HTTP port + 10000 and refuses to start when that exceeds 65535.
SGLANG_HIGHEST_PORT = 65535 - 10000


def gpu_names() -> list[str]:
    """Names of the CUDA GPUs `nvidia-smi` sees; empty where there is none."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_label(simulated: bool = False, names: list[str] | None = None) -> str:
    """The GPU a stored result names: "simulated" for the simulator, else the first of `names` (default:
    `gpu_names()`), "unknown" where there is none."""
    if simulated:
        return "simulated"
    return next(iter(gpu_names() if names is None else names), "unknown")


def resolve_engine(engine: str, url: str | None) -> str:
    if url:
        return "url"
    if engine not in ENGINES:
        raise UserError(f"unknown engine '{engine}'; valid: {', '.join(ENGINES)}")
    if engine == "url":
        raise UserError("engine 'url' needs --url")
    if engine == "auto":
        return "sglang" if gpu_names() else "sim"
    return engine


def serving_backend(name: str) -> BackendSpec:
    """The registered serving backend `name`; a UserError says which names are valid (or how to serve the kernels
    of a kernel-bench variant)."""
    try:
        return backend_spec(name)
    except UnknownBackend as exc:
        raise UserError(str(exc)) from None


def check_checkpoint(spec: BackendSpec, model: str) -> None:
    """A UserError where the backend serves only checkpoints with calibrated KV scales and `model` has none."""
    if not spec.kv_scales:
        return
    try:
        if is_bundled_model(model):
            raise KVScalesError(f"'{model}' is a bundled config (dummy weights)")
        read_kv_scales(model_dir(model))
    except KVScalesError as exc:
        raise UserError(f"backend '{spec.name}' serves only a checkpoint with calibrated FP8 KV scales, and {exc}; "
                        "write them with `mpfa accuracy calibrate-kv DIR`") from None


def resolve_backends(names: str, engine: str, model: str | None = None) -> list[BackendSpec]:
    """Validate a comma-separated backend list; on the SGLang engine, check that the `model` its servers will load
    (if given) suits each one (`check_checkpoint`), then that each one can run here."""
    specs = [serving_backend(name) for name in [n.strip() for n in names.split(",") if n.strip()]]
    if not specs:
        raise UserError(f"no backend given; valid: {', '.join(BACKENDS)}")
    if engine != "sglang":
        return specs
    if model is not None:
        for spec in specs:
            check_checkpoint(spec, model)
    for spec in specs:
        if missing := spec.missing():
            what = "the MpFA SGLang plugin is not built yet" if spec.plugin in missing else "missing packages"
            raise UserError(
                f"backend '{spec.name}' cannot run on SGLang here: {what} ({', '.join(missing)}); "
                "install with `pip install -e .[serve,kernels]`"
            )
    return specs


@dataclass(frozen=True)
class ServerLaunch:
    command: list[str]
    env: dict[str, str]


# serve-sim flags the launch itself sets: given again as a server argument they would change nothing measured (the
# metrics are in modelled time at any time scale), so they are refused with what to use instead.
SIM_LAUNCH_FLAGS = {"--time-scale": "--time-scale paces the simulator; its metrics are in modelled time at any pace "
                                    "(for a slower backend: --sim-slowdown 1.2; for noisy repeats: --sim-noise 3%)"}


def refuse_sim_launch_flags(extra_args: list[str]) -> None:
    """A UserError for an extra simulator argument of `SIM_LAUNCH_FLAGS`."""
    for arg in extra_args:
        if (flag := arg.split("=", 1)[0]) in SIM_LAUNCH_FLAGS:
            raise UserError(f"--server-arg {arg}: {SIM_LAUNCH_FLAGS[flag]}")


def radix_cache_args(radix_cache: bool) -> list[str]:
    """The server flag that turns SGLang's prefix (radix) cache off, unless the workload shares prefixes: prompts
    that share nothing on purpose must not hit a cache that earlier repeats filled."""
    return [] if radix_cache else ["--disable-radix-cache"]


def sim_launch(spec: BackendSpec, port: int, time_scale: float, model: str, extra_args: list[str],
               radix_cache: bool = False) -> ServerLaunch:
    """`mpfa serve-sim` for `spec`; an extra argument of `SIM_LAUNCH_FLAGS` is a UserError."""
    refuse_sim_launch_flags(extra_args)
    return ServerLaunch(
        command=[
            sys.executable, "-m", "mpfa.mpfa_cli", "serve-sim", "--host", "127.0.0.1", "--port", str(port),
            "--backend", spec.name, "--time-scale", str(time_scale), "--model", model,
            *radix_cache_args(radix_cache), *extra_args,
        ],
        env={},
    )


def sglang_launch(
    spec: BackendSpec, port: int, model: str, context_len: int, tp: int, dp: int, extra_args: list[str],
    radix_cache: bool = False,
) -> ServerLaunch:
    """SGLang with the backend's flags, dummy weights for a bundled config, the radix cache off unless asked; a
    UserError for a model the backend cannot serve (`check_checkpoint`)."""
    check_checkpoint(spec, model)
    path = model_dir(model)
    dummy = ["--load-format", "dummy"] if is_bundled_model(model) else []
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(path), *dummy,
        "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), *radix_cache_args(radix_cache),
        "--grammar-backend", "none", "--context-length", str(context_len), "--tp-size", str(tp),
        "--dp-size", str(dp), *spec.sglang_args, *extra_args,
    ]
    # Bundled configs may ask for a longer context than their max_position_embeddings (YaRN to 128K).
    env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", **spec.env}
    return ServerLaunch(command=command, env=env)


def model_name(model: str) -> str:
    return model if is_bundled_model(model) else Path(model).name
