"""`memra run`, `memra serve` and `memra warmup` on Qwen3-MoE, through the CLI as a user runs it:
tiny MoE checkpoints (per-expert safetensors and a stacked GGUF) on the reference backend."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fixtures.checkpoints import write_qwen3_moe_gguf, write_qwen3_moe_safetensors
from test_cli_run import _assert_user_error, memra

ROOT = Path(__file__).resolve().parent.parent
MIXED = dict(num_hidden_layers=3, mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return write_qwen3_moe_safetensors(tmp_path_factory.mktemp("moe_cli"), seed=2, **MIXED)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    return write_qwen3_moe_gguf(tmp_path_factory.mktemp("moe_cli_gguf") / "tiny-moe.q8_0.gguf", seed=2, **MIXED)


@pytest.mark.parametrize("which", ["moe_dir", "moe_gguf"])
def test_run_on_reference(which, request):
    path = request.getfixturevalue(which)
    args = ("run", str(path), "--prompt", "hello world", "--max-tokens", "6", "--backend", "reference")
    out = memra(*args, "--stats")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stderr.strip().splitlines()[-1].removeprefix("memra: "))
    assert stats["backend"] == "reference" and stats["generated_tokens"] >= 1
    assert memra(*args).stdout == out.stdout  # greedy is reproducible


def test_run_reports_a_malformed_moe_checkpoint_in_one_line(moe_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(moe_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"num_experts": 3}))
    out = memra("run", str(bad), "--prompt", "hi", "--max-tokens", "2", "--backend", "reference")
    _assert_user_error(out, "model.safetensors: tensor 'model.layers.0.mlp.experts.3.gate_proj.weight'", "'num_experts'")


def test_warmup_lists_the_moe_kernels():
    out = memra("warmup", "--family", "qwen3_moe", "--quant", "q4_k_m", "--device-profile", "h100", "--list")
    assert out.returncode == 0, out.stderr
    assert "moe_topk__e128_k8_n1" in out.stdout and "moe_gemv_down_grouped_q4_k" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_a_chat_completion(moe_dir, tmp_path):
    port = _free_port()
    env = dict(os.environ, MEMRA_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    log = open(tmp_path / "serve.log", "w")
    cmd = [sys.executable, "-m", "engine.cli", "serve", str(moe_dir), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--backend", "reference"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("memra serve did not become healthy in 120 s")
        body = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
        req = urllib.request.Request(
            f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        answers = []
        for _ in range(2):
            with urllib.request.urlopen(req, timeout=60) as r:
                reply = json.loads(r.read())
            assert reply["object"] == "chat.completion"
            assert 0 < reply["usage"]["completion_tokens"] <= 5
            answers.append(reply["choices"][0]["message"]["content"])
        assert answers[0] == answers[1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
