"""A real waitress server on a loopback port driven by the official openai and anthropic SDKs.

The ``served`` fixture is parametrized over APP_FACTORIES: each returns (app, engine, scripted, model).
The fake-engine factory is scripted (exact texts, tool calls); a real-engine factory (scripted=False)
gets the structural checks only. To run against the real engine, append a factory to APP_FACTORIES.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import anthropic
import openai
import pytest
from server_fakes import FakeEngine, FakeTokenizer

from engine.server.app import app_state, create_app
from engine.server.model_info import ModelInfo
from engine.server.serve import BackgroundServer, drain_and_stop
from engine.server_config import ApiKey, ServerConfig, hash_key

KEY = "sk-test-key"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _script(req):
    prompt = "".join(chr(i) for i in req.prompt_ids)
    if "get_weather" in prompt and "sunny" not in prompt:
        return [CALL[i : i + 5] for i in range(0, len(CALL), 5)]
    return ["Hello", ", ", "world", "!"]


def fake_factory():
    eng = FakeEngine(script=_script)
    cfg = ServerConfig(keys=(ApiKey("key_t", hash_key(KEY), "t1", cache_salt="t1"),), keepalive_s=0.5)
    app = create_app(eng, FakeTokenizer(), ModelInfo("smol", 4096, "fake", 1), cfg)
    return app, eng, True, "smol"


class _ChatTokenizer:
    """tests/fixtures/fake_runner.py's tokenizer plus a plain chat template (what the server needs)."""

    def __init__(self):
        from fixtures.fake_runner import FakeTokenizer as RunnerTokenizer

        self._t = RunnerTokenizer()
        self.eos_token_ids = self._t.eos_token_ids
        self.vocab_size = self._t.vocab_size

    def __getattr__(self, name):
        return getattr(self._t, name)

    def encode(self, text, add_special_tokens=False, scope=None):
        return self._t.encode(text)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, **kw):
        return (
            "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages).replace("\n", " | ")
            + "assistant: "
        )


def engine_loop_factory():
    """The real engine loop (scheduler, paged KV, stop strings) over tests/fixtures/fake_runner.py's FakeRunner."""
    from fixtures.fake_runner import FakeRunner

    from engine.loop import Engine, EngineConfig

    tok = _ChatTokenizer()
    runner = FakeRunner(num_blocks=512, block_size=16, max_model_len=2048, vocab_size=128, step_delay_s=0.01)
    eng = Engine(runner, tok, EngineConfig(max_running=8))
    eng.start()
    cfg = ServerConfig(keys=(ApiKey("key_t", hash_key(KEY), "t1", cache_salt="t1"),), keepalive_s=0.5)
    app = create_app(eng, tok, ModelInfo("fake-runner", 2048, "fake", 1), cfg)
    return app, eng, False, "fake-runner"


APP_FACTORIES = [fake_factory, engine_loop_factory]


@dataclass
class Served:
    url: str
    engine: object
    scripted: bool
    model: str
    app: object

    def openai(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=20)

    def anthropic(self, key=KEY):
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=20)


@pytest.fixture(params=APP_FACTORIES, ids=lambda f: f.__name__)
def served(request):
    app, eng, scripted, model = request.param()
    with BackgroundServer(app) as srv:
        yield Served(srv.url, eng, scripted, model, app)
    if not scripted:
        eng.check_invariants()
        eng.shutdown(timeout_s=5.0)


MSG = [{"role": "user", "content": "Say hello."}]


def test_chat_nonstream_and_stream(served):
    c = served.openai()
    r = c.chat.completions.create(model=served.model, messages=MSG, max_tokens=16, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens_details.cached_tokens >= 0
    if served.scripted:
        assert r.choices[0].message.content == "Hello, world!"
    chunks = list(
        c.chat.completions.create(
            model=served.model,
            messages=MSG,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content if served.scripted else isinstance(text, str)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_completions(served):
    c = served.openai()
    r = c.completions.create(model=served.model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=served.model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        if ch.choices
    )
    if served.scripted:
        assert r.choices[0].text == streamed == "Hello, world!"


def test_tool_call_round_trip(served):
    if not served.scripted:
        pytest.skip("needs a scripted engine")
    c = served.openai()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model=served.model, messages=msgs, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the SDK's accumulated deltas give the same call
    stream = c.chat.completions.create(model=served.model, messages=msgs, tools=TOOLS, stream=True)
    name, args, finish = "", "", None
    for ch in stream:
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"} and finish == "tool_calls"
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r2 = c.chat.completions.create(model=served.model, messages=msgs, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "Hello, world!"


def test_anthropic_messages(served):
    a = served.anthropic()
    m = a.messages.create(model=served.model, max_tokens=16, system="Be brief.", messages=MSG)
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    with a.messages.stream(model=served.model, max_tokens=16, messages=MSG) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.usage.output_tokens >= 1
    if served.scripted:
        assert m.content[0].text == text == "Hello, world!"
        tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
        tm = a.messages.create(
            model=served.model,
            max_tokens=64,
            tools=tools,
            messages=[{"role": "user", "content": "Weather? get_weather"}],
        )
        assert tm.stop_reason == "tool_use" and tm.content[-1].input == {"city": "Paris"}
        with a.messages.stream(
            model=served.model,
            max_tokens=64,
            tools=tools,
            messages=[{"role": "user", "content": "Weather? get_weather"}],
        ) as s:
            fm = s.get_final_message()
        assert fm.content[-1].type == "tool_use" and fm.content[-1].input == {"city": "Paris"}
    n = a.messages.count_tokens(model=served.model, messages=MSG)
    assert n.input_tokens > 0


def test_auth_failure(served):
    if not app_state(served.app).keyring.enabled:
        pytest.skip("server has no keys")
    with pytest.raises(openai.AuthenticationError):
        served.openai("wrong").chat.completions.create(model=served.model, messages=MSG)
    with pytest.raises(anthropic.AuthenticationError):
        served.anthropic("wrong").messages.create(model=served.model, max_tokens=4, messages=MSG)


def test_context_length_error(served):
    ctx = app_state(served.app).model_info.context_length
    with pytest.raises(openai.BadRequestError) as ei:
        served.openai().chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "hello " * ctx}]
        )
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError):
        served.anthropic().messages.create(
            model=served.model, max_tokens=4, messages=[{"role": "user", "content": "hello " * ctx}]
        )


def _raw_request(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def _wait(pred, timeout=5.0) -> bool:
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _idle(served) -> bool:
    st = app_state(served.app)
    running = getattr(served.engine.stats(), "running", 0)
    return st.in_flight == 0 and running == 0


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(served, stream, n):
    eng = served.engine
    if served.scripted:
        eng.forever, eng.delay_s = True, 0.02
    body = {
        "model": served.model,
        "messages": MSG,
        "stream": stream,
        "max_tokens": 100000,
        "ignore_eos": True,
        "n": n,
    }
    s = _raw_request(served.url, "/v1/chat/completions", body)
    if stream:
        got = b""
        while b"data:" not in got:
            got += s.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
    else:
        time.sleep(0.3)
    s.close()
    if served.scripted:
        assert _wait(lambda: len(eng.aborted) == n), "engine never saw the abort"
        assert {r.request_id for r in eng.submitted[-n:]} == set(eng.aborted)
        eng.forever = False
    assert _wait(lambda: _idle(served)), "request still in flight after the client left"
    m = served.openai().chat.completions.create(model=served.model, messages=MSG, max_tokens=4)
    assert m.choices  # the server still answers


def test_drain_finishes_in_flight_then_refuses(served):
    if not served.scripted:
        pytest.skip("needs a scripted engine")
    eng = served.engine
    eng.delay_s = 0.1
    c = served.openai()
    result = {}

    def long_request():
        result["r"] = c.chat.completions.create(model=served.model, messages=MSG)

    t = threading.Thread(target=long_request)
    t.start()
    assert _wait(lambda: app_state(served.app).in_flight == 1)
    d = threading.Thread(target=drain_and_stop, args=(app_state(served.app), 5.0))
    d.start()
    assert _wait(lambda: app_state(served.app).draining)
    with pytest.raises(openai.InternalServerError) as ei:
        c.chat.completions.create(model=served.model, messages=MSG)
    assert ei.value.status_code == 503 and ei.value.code == "draining"
    t.join(5)
    d.join(5)
    assert result["r"].choices[0].message.content == "Hello, world!"
    assert eng.drained and not eng.alive


def test_disconnect_while_engine_silent_is_noticed(served):
    """No tokens flow (long prefill): waitress's read-ahead still reveals the hang-up within ~POLL_S."""
    if not served.scripted:
        pytest.skip("needs a scripted engine")
    eng = served.engine
    eng.delay_s = 30.0  # first token would come after 30 s
    s = _raw_request(
        served.url, "/v1/chat/completions", {"model": served.model, "messages": MSG, "stream": True}
    )
    got = b""
    while b": ok" not in got:
        got += s.recv(4096)
    s.close()
    t0 = time.monotonic()
    assert _wait(lambda: len(eng.aborted) == 1, timeout=3.0)
    assert time.monotonic() - t0 < 2.0
    eng.delay_s = 0.0
