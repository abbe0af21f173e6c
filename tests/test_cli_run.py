"""`memra run` end to end on the reference backend, and user errors as one clear line (no traceback)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def memra(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_llama_gguf"])
def test_run_tiny_models_on_reference(fixture, request):
    path = request.getfixturevalue(fixture)
    out = memra(
        "run", str(path), "--prompt", "hello world", "--max-tokens", "5", "--stats", "--backend", "reference"
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stderr.strip().splitlines()[-1].removeprefix("memra: "))
    assert stats["backend"] == "reference" and stats["generated_tokens"] >= 1
    assert stats["finish_reason"] in ("length", "stop")
    again = memra("run", str(path), "--prompt", "hello world", "--max-tokens", "5", "--backend", "reference")
    assert again.stdout == out.stdout  # greedy is reproducible


@pytest.mark.slow
def test_run_smollm2_chat_answers_paris(smollm2_path):
    out = memra(
        "run",
        str(smollm2_path),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "12",
        "--stats",
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "numpy reference backend" in out.stderr  # says which backend ran and why
    stats = json.loads(out.stderr.strip().splitlines()[-1].removeprefix("memra: "))
    assert stats["decode_tok_s"] is None or stats["decode_tok_s"] > 0


def _assert_user_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for n in needles:
        assert n in out.stderr, (n, out.stderr)


def test_truncated_gguf_is_a_clear_error(tiny_llama_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = tiny_llama_gguf.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    _assert_user_error(memra("run", str(bad), "--prompt", "x", "--backend", "reference"), "cut.gguf")


def test_garbage_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    _assert_user_error(memra("run", str(bad), "--prompt", "x", "--backend", "reference"), "junk.gguf")


def test_truncated_safetensors_is_a_clear_error(tiny_llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    _assert_user_error(memra("run", str(d), "--prompt", "x", "--backend", "reference"), "model.safetensors")


def test_config_missing_field_is_a_clear_error(tiny_qwen3_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_qwen3_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    _assert_user_error(
        memra("run", str(d), "--prompt", "x", "--backend", "reference"), "config.json", "hidden_size"
    )


def test_missing_model_path(tmp_path):
    _assert_user_error(memra("run", str(tmp_path / "nope"), "--prompt", "x"), "does not exist")


def test_bad_sampling_flag_names_the_field(tiny_llama_dir):
    _assert_user_error(
        memra("run", str(tiny_llama_dir), "--prompt", "x", "--top-p", "3", "--backend", "reference"), "top_p"
    )
