"""The real thing: `memra serve` (subprocess, waitress, loopback) on the numpy reference backend (or
the one MEMRA_TEST_BACKEND names: tools/gpu_serve_check.sh runs it with cuda)
with the real SmolLM2-135M-Instruct GGUF, driven by the official openai and anthropic SDKs, then a
load test (24 requests, 16 concurrent, 5 disconnected mid-stream after 1-3 chunks; 64 with 19
disconnected after 1-4 chunks in .ci/run's long step) after which every KV block is free again.
"""

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

ROOT = Path(__file__).resolve().parent.parent
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow
# the backend under test: reference in CI; the GPU session runs this file with MEMRA_TEST_BACKEND=cuda
BACKEND = os.environ.get("MEMRA_TEST_BACKEND", "reference")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    keys = tmp / "keys.toml"
    cfg = tmp / "memra.toml"
    port = _free_port()
    cfg.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nkeys_file = "keys.toml"\nmax_running = 16\n'
    )
    env = dict(os.environ, MEMRA_CACHE_DIR=str(tmp / "cache"), PYTHONUNBUFFERED="1")
    added = subprocess.run(
        [sys.executable, "-m", "engine.cli", "keys", "add", "--config", str(cfg), "--tenant", "ci"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    key = added.stdout.split("key (shown once, store it now): ")[1].split()[0]
    assert key not in keys.read_text()  # only the hash is stored
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            str(smollm2_path),
            "--config",
            str(cfg),
            "--backend",
            BACKEND,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    saw_loading = False
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"memra serve exited early:\n{(tmp / 'serve.log').read_text()[-4000:]}")
        try:
            status, body = _get(f"{base}/health")
        except OSError:
            time.sleep(0.2)
            continue
        if status == 503:
            saw_loading = saw_loading or body.get("status") == "loading"
        if status == 200:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("memra serve did not become healthy in 180 s")
    yield {"base": base, "key": key, "proc": proc, "log": tmp / "serve.log", "saw_loading": saw_loading}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _oa(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=server["key"], max_retries=0, timeout=120)


def test_chat_non_streaming_answers_paris(server):
    r = _oa(server).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 12
    assert r.id.startswith("chatcmpl-") and r.system_fingerprint


def test_chat_streaming_and_prefix_cache(server):
    client = _oa(server)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=msgs,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before


def test_completions(server):
    r = _oa(server).completions.create(
        model="default", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert r.choices[0].text.strip() and r.choices[0].finish_reason in ("length", "stop")


def test_tool_round_trip_is_accepted(server):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    r = _oa(server).chat.completions.create(
        model="default", messages=msgs, tools=tools, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_messages(server):
    client = anthropic.Anthropic(base_url=server["base"], api_key=server["key"], max_retries=0, timeout=120)
    m = client.messages.create(
        model="default",
        max_tokens=12,
        extra_body={"temperature": 0},  # this SDK version has no temperature argument
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert m.content[0].type == "text" and "Paris" in m.content[0].text
    with client.messages.stream(
        model="default", max_tokens=6, messages=[{"role": "user", "content": "Say hi"}]
    ) as s:
        text = "".join(s.text_stream)
    assert text


def test_auth_and_context_errors(server):
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        _oa(server).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi " * 9000}], max_tokens=4
        )
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        _oa(server).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], n=17
        )
    assert e.value.param == "n"  # 1..16 choices


# loadgen's seed-0 plan for 64 requests hangs up 19 of them after 1, 2, 3 and 4 chunks (10 / 4 / 3 / 2),
# for 24 requests 5 (after 1, 2, 2, 3, 3 chunks): on the reference backend README's run the 24, .ci/run's
# long step the 64 (tools/gpu_serve_check.sh runs both with cuda)
LOADS = [(24, 4), pytest.param(64, 15, marks=pytest.mark.long) if BACKEND == "reference" else (64, 15)]


@pytest.mark.parametrize("requests,hung_up", LOADS)
def test_load_with_disconnects_frees_every_block(server, requests, hung_up):
    # streaming requests, 16 at a time (the server's max_running: every wave fills the batch)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "loadgen.py"),
            "--url",
            server["base"],
            "--api-key",
            server["key"],
            "--requests",
            str(requests),
            "--concurrency",
            "16",
            "--disconnect-fraction",
            "0.25",
            "--max-tokens",
            "3",
            "--prompt-words",
            "2,6",
            "--timeout",
            "300",
            "--duration",
            "900",
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        timeout=1000,
    )
    summary = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert summary["requests"] == requests
    assert not any(str(k).startswith("5") or "50" in str(k) for k in summary["errors"]), summary["errors"]
    assert summary["disconnected"] >= hung_up, summary
    assert summary["ok"] == requests, summary  # loadgen counts a deliberate hang-up as ok
    deadline = time.time() + 30
    while True:
        status, kv = _get(server["base"] + "/admin/kv", server["key"])
        assert status == 200 and kv["invariants_ok"], kv
        if kv["kv_blocks_used"] == 0 and kv["running"] == 0 and kv["waiting"] == 0:
            break
        assert time.time() < deadline, kv
        time.sleep(0.2)
    assert kv["kv_blocks_free"] + kv["kv_blocks_cached"] == kv["kv_blocks_total"]
    status, _ = _get(server["base"] + "/health")
    assert status == 200
