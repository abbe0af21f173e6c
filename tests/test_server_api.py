"""Falcon TestClient tests of every endpoint, validation, auth, SSE framing and Anthropic events (fake engine)."""

from __future__ import annotations

import json

import falcon.testing
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeEngine, FakeTokenizer

from engine.server.app import app_state, create_app
from engine.server.model_info import ModelInfo
from engine.server_config import ApiKey, ServerConfig, hash_key
from engine.types import MemraError

INFO = ModelInfo("smol", context_length=2048, backend="fake", created=1, aliases=("smol-alias",))


def make(engine=None, config=None):
    engine = engine or FakeEngine()
    app = create_app(engine, FakeTokenizer(), INFO, config or ServerConfig(keepalive_s=0.3))
    return falcon.testing.TestClient(app), engine


def chat(client, **kw):
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], **kw}
    return client.simulate_post("/v1/chat/completions", json=body)


def sse_data(text: str) -> list:
    out = []
    for frame in text.split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_chat_nonstream_shape_and_usage():
    c, eng = make()
    r = chat(c, temperature=0.5, top_k=5, seed=7, stop=["zz"], max_tokens=50)
    assert r.status_code == 200, r.text
    b = r.json
    assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion"
    assert b["model"] == "smol" and b["system_fingerprint"]
    assert b["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world!"}
    assert b["choices"][0]["finish_reason"] == "stop"
    assert b["usage"]["completion_tokens"] == 4 and b["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    req = eng.submitted[0]
    assert req.sampling.temperature == 0.5 and req.sampling.top_k == 5 and req.sampling.seed == 7
    assert req.stop == ["zz"] and req.max_tokens == 50
    assert r.headers["x-request-id"]


def test_request_id_echoed_and_defaults():
    c, eng = make()
    r = c.simulate_post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"x-request-id": "abc-123"},
    )
    assert r.headers["x-request-id"] == "abc-123"
    req = eng.submitted[0]
    assert req.sampling.temperature == 1.0 and req.sampling.seed is None
    assert req.max_tokens == INFO.context_length - len(req.prompt_ids)


def test_chat_stream_framing():
    c, _ = make()
    r = chat(c, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith(": ok\n\n")
    ev = sse_data(r.text)
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in ev[:-2] if e["choices"])
    assert text == "Hello, world!"
    assert ev[-3]["choices"][0]["finish_reason"] == "stop"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 4
    assert all(e["object"] == "chat.completion.chunk" for e in ev[:-1])


def test_keepalive_comments_while_waiting():
    eng = FakeEngine(script=lambda r: ["a", "b"], delay_s=0.45)
    c, _ = make(eng, ServerConfig(keepalive_s=0.2))
    r = chat(c, stream=True)
    assert ": keep-alive\n\n" in r.text and sse_data(r.text)[-1] == "[DONE]"


def test_midstream_error_is_data_chunk_then_done():
    eng = FakeEngine()
    eng.finish_reason = "error"
    c, _ = make(eng)
    r = chat(c, stream=True)
    ev = sse_data(r.text)
    assert ev[-1] == "[DONE]" and "error" in ev[-2]
    r2 = chat(c)
    assert r2.status_code == 500 and r2.json["error"]["code"] == "engine_error"


def test_engine_errors_have_one_body_per_api():
    """A request the engine fails, and a bug in a resource, are 500 engine_error bodies in the
    endpoint's API shape (engine.server.errors.engine_error)."""
    eng = FakeEngine()
    eng.finish_reason = "error"
    c, _ = make(eng)
    r = chat(c)
    assert r.status_code == 500 and r.json == {
        "error": {"message": "the engine failed this request", "type": "server_error", "param": None, "code": "engine_error"}
    }
    r = c.simulate_post("/v1/messages", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 500
    assert r.json == {"type": "error", "error": {"type": "api_error", "message": "the engine failed this request"}}

    class Broken(FakeTokenizer):
        def apply_chat_template(self, *a, **kw):
            raise RuntimeError("a bug")

    app = create_app(FakeEngine(), Broken(), INFO, ServerConfig(keepalive_s=0.3))
    r = chat(falcon.testing.TestClient(app))
    assert r.status_code == 500 and r.json["error"] == {
        "message": "internal server error (RuntimeError)", "type": "server_error", "param": None, "code": "engine_error"
    }


def test_completions_and_prompt_forms():
    c, eng = make()
    r = c.simulate_post("/v1/completions", json={"model": "smol", "prompt": "abc"})
    assert r.status_code == 200 and r.json["object"] == "text_completion"
    assert r.json["choices"][0]["text"] == "Hello, world!" and r.json["id"].startswith("cmpl-")
    assert eng.submitted[-1].prompt_ids == [97, 98, 99] and eng.submitted[-1].max_tokens == 16
    r = c.simulate_post("/v1/completions", json={"prompt": ["abc"], "max_tokens": 2})
    assert r.status_code == 200 and r.json["choices"][0]["finish_reason"] == "length"
    r = c.simulate_post("/v1/completions", json={"prompt": [5, 6, 7]})
    assert r.status_code == 200 and eng.submitted[-1].prompt_ids == [5, 6, 7]
    r = c.simulate_post("/v1/completions", json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json["error"]["param"] == "prompt"
    r = c.simulate_post("/v1/completions", json={"prompt": "abc", "stream": True})
    ev = sse_data(r.text)
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == "Hello, world!" and ev[-1] == "[DONE]"


@pytest.mark.parametrize(
    "field,value",
    [("best_of", 2), ("suffix", "x"), ("echo", True)],
)
def test_unsupported_fields_named(field, value):
    c, _ = make()
    body = {"prompt": "a", field: value}
    r = c.simulate_post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json["error"]["param"] == field, r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema.schema"),
    ],
)
def test_sampling_api_fields_validated(body, param):
    c, _ = make()
    r = chat(c, **body)
    assert r.status_code == 400 and r.json["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", "hot"),
        ("temperature", 3),
        ("top_p", 0),
        ("top_k", 1.5),
        ("max_tokens", 0),
        ("max_tokens", "5"),
        ("stop", 5),
        ("stop", ["x"] * 17),
        ("seed", 1.5),
        ("stream", "yes"),
        ("presence_penalty", 9),
        ("repetition_penalty", 0),
        ("min_p", 2),
        ("stream_options", 3),
        ("ignore_eos", 1),
        ("cache_salt", 5),
        ("tools", "x"),
        ("tool_choice", "maybe"),
    ],
)
def test_wrong_types_named(field, value):
    c, _ = make()
    r = chat(c, **{field: value})
    assert r.status_code == 400, (field, value, r.text)
    assert r.json["error"]["param"].startswith(field)


def test_unknown_fields_ignored_and_passthrough_options():
    c, eng = make()
    r = chat(
        c,
        some_future_field={"a": 1},
        user="u1",
        ignore_eos=True,
        cache_salt="s1",
        min_p=0.1,
        repetition_penalty=1.2,
        response_format={"type": "text"},
        n=1,
        logprobs=False,
    )
    assert r.status_code == 200, r.text
    req = eng.submitted[0]
    assert req.ignore_eos and req.cache_salt.endswith("s1") and req.sampling.repetition_penalty == 1.2


def test_message_validation():
    c, _ = make()
    for msgs, param in [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        ([{"role": "user"}], "messages[0].content"),
        (["x"], "messages[0]"),
    ]:
        r = c.simulate_post("/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 400 and r.json["error"]["param"] == param, (msgs, r.text)


def test_context_length_exceeded():
    c, _ = make()
    r = chat(c, messages=[{"role": "user", "content": "x" * 3000}])
    assert r.status_code == 400
    e = r.json["error"]
    assert e["code"] == "context_length_exceeded" and e["type"] == "invalid_request_error" and e["param"]


def test_max_tokens_clamped_to_context():
    c, eng = make()
    assert chat(c, max_tokens=10**6).status_code == 200
    req = eng.submitted[0]
    assert req.max_tokens == INFO.context_length - len(req.prompt_ids)


@pytest.mark.parametrize(
    "code,status",
    [("overloaded", 429), ("tenant_limit", 429), ("draining", 503), ("context_length_exceeded", 400)],
)
def test_engine_submit_errors(code, status):
    eng = FakeEngine()
    eng.submit_error = MemraError("nope", code=code)
    c, _ = make(eng)
    r = chat(c)
    assert r.status_code == status and r.json["error"]["code"] == code
    if status in (429, 503):
        assert r.headers["retry-after"]


def test_model_not_found_and_models():
    c, _ = make()
    r = chat(c, model="gpt-4")
    assert r.status_code == 404 and r.json["error"]["code"] == "model_not_found"
    assert chat(c, model="smol-alias").status_code == 200
    r = c.simulate_get("/v1/models")
    assert [m["id"] for m in r.json["data"]] == ["smol", "smol-alias"]
    assert r.json["data"][0]["context_length"] == 2048
    assert c.simulate_get("/v1/models/smol").json["id"] == "smol"
    assert c.simulate_get("/v1/models/nope").status_code == 404


def test_unknown_route_is_json_404():
    c, _ = make()
    r = c.simulate_get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json


def _keys_config(**kw):
    keys = (
        ApiKey("key_a", hash_key("secret-a"), "acme", max_concurrency=1, cache_salt="acme-salt"),
        ApiKey("key_b", hash_key("secret-b"), "beta"),
    )
    return ServerConfig(keys=keys, keepalive_s=0.3, **kw)


def test_auth_bearer_and_x_api_key_and_tenant():
    c, eng = make(config=_keys_config())
    r = chat(c)
    assert r.status_code == 401 and r.json["error"]["code"] == "invalid_api_key"
    r = c.simulate_post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401
    r = c.simulate_post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": "Bearer secret-a"},
    )
    assert r.status_code == 200
    assert eng.submitted[-1].tenant == "acme" and eng.submitted[-1].cache_salt == "acme-salt"
    r = c.simulate_post(
        "/v1/messages",
        json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "secret-b"},
    )
    assert r.status_code == 200 and eng.submitted[-1].tenant == "beta"
    r = c.simulate_post(
        "/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    )
    assert (
        r.status_code == 401
        and r.json["type"] == "error"
        and r.json["error"]["type"] == "authentication_error"
    )
    assert c.simulate_get("/health").status_code == 200
    assert c.simulate_get("/admin/kv").status_code == 401
    assert c.simulate_get("/admin/kv", headers={"Authorization": "Bearer secret-b"}).status_code == 200


def test_tenant_concurrency_limit():
    eng = FakeEngine(delay_s=0.05)
    eng.forever = True
    c, _ = make(eng, _keys_config())
    hdr = {"Authorization": "Bearer secret-a"}
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    app = c.app
    from engine.server.auth import Tenant

    state = app_state(app)
    state.acquire(Tenant("acme", 1))
    r = c.simulate_post("/v1/chat/completions", json=body, headers=hdr)
    assert r.status_code == 429 and r.json["error"]["code"] == "tenant_limit" and r.headers["retry-after"]
    state.release(Tenant("acme", 1))
    eng.forever = False
    assert (
        c.simulate_post("/v1/chat/completions", json={**body, "stream": False}, headers=hdr).status_code
        == 200
    )


def test_body_limits():
    c, _ = make(config=ServerConfig(max_body_bytes=1000))
    r = c.simulate_post("/v1/chat/completions", body=b"{" + b" " * 2000 + b"}")
    assert r.status_code == 413
    for raw in [
        b"\xff\xfe{}",
        b"{bad",
        b'{"a": NaN}',
        b'{"a": 1' + b"0" * 60 + b"}",
        b"[1]",
        b"[" * 500 + b"]" * 500,
        b'{"messages": "\\ud800"}',
        b"",
        b'{"a": 1e999}',
    ]:
        r = c.simulate_post("/v1/chat/completions", body=raw)
        assert r.status_code == 400, (raw[:20], r.status_code, r.text)
        assert r.json["error"]["code"] == "invalid_json"


def test_tokenize_detokenize():
    c, _ = make()
    r = c.simulate_post("/tokenize", json={"prompt": "hi"})
    assert r.json["tokens"] == [104, 105] and r.json["count"] == 2 and r.json["max_model_len"] == 2048
    r = c.simulate_post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json["count"] > 2
    assert c.simulate_post("/detokenize", json={"tokens": [104, 105]}).json["prompt"] == "hi"
    assert c.simulate_post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert c.simulate_post("/detokenize", json={"tokens": "x"}).json["error"]["param"] == "tokens"


def test_health_ready_metrics_admin():
    c, eng = make()
    assert c.simulate_get("/health").json == {"status": "ok"}
    assert c.simulate_get("/ready").status_code == 200
    chat(c)
    chat(c, stream=True)
    m = c.simulate_get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(m)}  # prometheus_client's own parser

    def val(name, **labels):
        fam = fams[name.removesuffix("_total").removesuffix("_count")]
        return next(s.value for s in fam.samples if s.name == name and labels.items() <= s.labels.items())

    assert val("memra_requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert val("memra_generation_tokens_total") == 8
    assert val("memra_time_to_first_token_seconds_count") == 2
    assert val("memra_inter_token_latency_seconds_count") == 8
    assert val("memra_prefix_cache_hit_ratio") == 0.4 and val("memra_kv_cache_usage_ratio") == 0.1
    # the vLLM names (FakeStats: 100 blocks, 90 free, 5 cached -> 5 held by live sequences)
    assert val("vllm:kv_cache_usage_perc", model_name="smol") == 0.05
    assert val("vllm:num_requests_running") == 0 and val("vllm:num_requests_waiting") == 0
    assert val("vllm:prefix_cache_queries_total") == 10 and val("vllm:prefix_cache_hits_total") == 4
    assert val("vllm:generation_tokens_total", model_name="smol") == 8
    assert val("vllm:time_to_first_token_seconds_count") == 2
    assert val("vllm:e2e_request_latency_seconds_count") == 2
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["num_gpu_blocks"] == "100"
    kv = c.simulate_get("/admin/kv")
    assert (
        kv.status_code == 200 and kv.json["invariants_ok"] and kv.json["kv_blocks_used"] == 5
    )  # total - free - cached (cached prefix blocks are not in use)
    eng.invariant_error = "block 3 double-owned"
    kv = c.simulate_get("/admin/kv")
    assert kv.status_code == 500 and kv.json["invariant_error"] == "block 3 double-owned"
    eng.alive = False
    assert c.simulate_get("/health").status_code == 503
    assert chat(c).status_code == 503


def test_loading_state_health_503():
    from engine.server.app import build_app
    from engine.server.state import AppState

    state = AppState(ServerConfig())
    c = falcon.testing.TestClient(build_app(state))
    assert c.simulate_get("/health").json == {"status": "loading"}
    assert c.simulate_get("/health").status_code == 503
    r = chat(c)
    assert r.status_code == 503 and r.json["error"]["code"] == "loading"
    state.attach(FakeEngine(), FakeTokenizer(), INFO)
    assert c.simulate_get("/health").status_code == 200


def test_draining_refuses_new_requests():
    c, _ = make()
    app_state(c.app).draining = True
    r = chat(c)
    assert r.status_code == 503 and r.json["error"]["code"] == "draining" and r.headers["retry-after"]
    assert c.simulate_get("/ready").status_code == 503


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _split(text, n=3):
    return lambda req: [text[i : i + n] for i in range(0, len(text), n)]


def test_chat_tool_call_nonstream_and_stream():
    c, eng = make(FakeEngine(script=_split(CALL_TEXT)))
    r = chat(c, tools=TOOLS)
    msg = r.json["choices"][0]["message"]
    assert r.json["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["content"] == "Let me check."
    tc = msg["tool_calls"][0]
    assert tc["id"].startswith("call_") and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    assert "get_weather" in "".join(chr(i) for i in eng.submitted[0].prompt_ids)  # tools rendered
    ev = sse_data(chat(c, tools=TOOLS, stream=True).text)
    deltas = [e["choices"][0]["delta"] for e in ev[:-1]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert ev[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."


def test_tool_choice_none_and_named_mismatch():
    c, eng = make(FakeEngine(script=_split(CALL_TEXT)))
    r = chat(c, tools=TOOLS, tool_choice="none")
    assert r.json["choices"][0]["message"]["content"] == CALL_TEXT
    assert "get_weather" not in "".join(chr(i) for i in eng.submitted[0].prompt_ids)
    tools2 = TOOLS + [{"type": "function", "function": {"name": "other"}}]
    r = chat(c, tools=tools2, tool_choice={"type": "function", "function": {"name": "other"}})
    ch = r.json["choices"][0]
    assert (
        ch["finish_reason"] == "stop"
        and ch["message"]["content"] == CALL_TEXT
        and "tool_calls" not in ch["message"]
    )
    assert "You must call the tool `other`" in "".join(chr(i) for i in eng.submitted[1].prompt_ids)
    r = chat(c, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and r.json["error"]["param"] == "tool_choice.function.name"


def test_malformed_tool_call_is_content():
    bad = 'x <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> y'
    c, _ = make(FakeEngine(script=_split(bad)))
    r = chat(c, tools=TOOLS)
    assert (
        r.json["choices"][0]["message"]["content"] == bad and r.json["choices"][0]["finish_reason"] == "stop"
    )


def test_assistant_tool_history_accepted():
    c, eng = make()
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"P"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = c.simulate_post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert '"city": "P"' in "".join(chr(i) for i in eng.submitted[0].prompt_ids)


def anth(client, **kw):
    body = {"model": "smol", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **kw}
    return client.simulate_post("/v1/messages", json=body)


def anth_events(text):
    out = []
    for frame in text.split("\n\n"):
        lines = frame.splitlines()
        if lines and lines[0].startswith("event: "):
            out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def test_anthropic_nonstream_and_validation():
    c, eng = make()
    r = anth(
        c, system=[{"type": "text", "text": "be brief"}], stop_sequences=["END"], top_k=3, temperature=0.2
    )
    b = r.json
    assert b["type"] == "message" and b["id"].startswith("msg_") and b["role"] == "assistant"
    assert b["content"] == [{"type": "text", "text": "Hello, world!"}]
    assert b["stop_reason"] == "end_turn" and b["usage"]["output_tokens"] == 4
    assert eng.submitted[0].stop == ["END"] and eng.submitted[0].sampling.top_k == 3
    r = c.simulate_post("/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert (
        r.status_code == 400
        and r.json["type"] == "error"
        and r.json["error"]["type"] == "invalid_request_error"
    )
    assert "max_tokens" in r.json["error"]["message"]
    r = anth(c, max_tokens=2)
    assert r.json["stop_reason"] == "max_tokens"


def test_anthropic_stream_event_sequence_with_tool_use():
    c, _ = make(FakeEngine(script=_split(CALL_TEXT)))
    tools = [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}]
    r = anth(c, stream=True, tools=tools)
    evs = anth_events(r.text)
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1] or n != "content_block_delta"]
    assert collapsed[2:-2] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    text = "".join(e["delta"]["text"] for n, e in evs if n == "content_block_delta" and e["index"] == 0)
    assert text == "Let me check."
    start = next(e for n, e in evs if n == "content_block_start" and e["index"] == 1)
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    pj = "".join(e["delta"]["partial_json"] for n, e in evs if n == "content_block_delta" and e["index"] == 1)
    assert json.loads(pj) == {"city": "Paris"}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    nr = anth(c, tools=tools).json
    assert [b["type"] for b in nr["content"]] == ["text", "tool_use"] and nr["stop_reason"] == "tool_use"
    assert nr["content"][1]["input"] == {"city": "Paris"} and nr["content"][1]["id"].startswith("toolu_")


def test_anthropic_tool_result_history_and_count_tokens():
    c, eng = make()
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": 1}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    r = anth(c, messages=msgs)
    assert r.status_code == 200, r.text
    prompt = "".join(chr(i) for i in eng.submitted[0].prompt_ids)
    assert "<tool>sunny" in prompt
    r = c.simulate_post("/v1/messages/count_tokens", json={"model": "smol", "messages": msgs})
    assert r.json["input_tokens"] == len(eng.submitted[0].prompt_ids)
    r = anth(c, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert r.status_code == 400 and r.json["type"] == "error"


def test_anthropic_stop_sequence_reason():
    eng = FakeEngine(script=lambda r: ["ab", "c"])
    c, _ = make(eng)
    # the fake's tokens are the first char of each chunk; last token 'c' is not EOS, "c" was held back
    orig = eng._produce

    def produce(req, h):
        from engine.types import TokenEvent, Usage

        h.q.put(TokenEvent(req.request_id, [97], "a"))
        h.q.put(TokenEvent(req.request_id, [69, 78, 68], "", "stop", Usage(3, 4, 0)))
        eng.finished.append(req.request_id)

    eng._produce = produce
    r = anth(c, stop_sequences=["END"])
    assert r.json["stop_reason"] == "stop_sequence" and r.json["stop_sequence"] == "END"
    eng._produce = orig


def test_exception_midstream_becomes_error_chunk():
    eng = FakeEngine()
    c, _ = make(eng)
    orig = eng._produce

    def produce(req, h):
        from engine.types import TokenEvent

        h.q.put(TokenEvent(req.request_id, [65], "A"))
        h.q.put("not an event")  # makes the stream code raise

    eng._produce = produce
    ev = sse_data(chat(c, stream=True).text)
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "engine_error"
    assert app_state(c.app).in_flight == 0 and eng.aborted  # the request was cancelled
    eng._produce = orig


def test_engine_metric_families_are_extensible():
    """Another subsystem adds an engine series with one call (as the speculative-decoding counters do);
    a name registered twice (here one of those) is refused."""
    from engine.server import metrics

    n = len(metrics.ENGINE_FAMILIES)
    try:
        metrics.add_engine_family("vllm:test_widgets", "widgets proposed", "counter", "test_widgets")
        metrics.add_engine_family("vllm:test_gadgets", "gadgets accepted", "counter", lambda s: 7)
        with pytest.raises(ValueError):
            metrics.add_engine_family("vllm:spec_decode_num_draft_tokens", "again", "counter", "x")
        m = metrics.Metrics()
        m.model_name = "smol"

        class S:
            test_widgets = 12
            spec_draft_tokens = 5

        fams = {f.name: f for f in text_string_to_metric_families(m.render(S(), alive=True, draining=False))}
        assert fams["vllm:test_widgets"].samples[0].value == 12
        assert fams["vllm:test_gadgets"].samples[0].labels == {"model_name": "smol"}
        assert fams["vllm:test_gadgets"].samples[0].value == 7
        assert fams["vllm:spec_decode_num_draft_tokens"].samples[0].value == 5
    finally:
        del metrics.ENGINE_FAMILIES[n:]


def test_chat_page_is_served_without_a_key_and_fetches_nothing_external():
    c, _ = make()
    r = c.simulate_get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/chat.js">' in r.text and 'href="/ui/chat.css"' in r.text
    js = c.simulate_get("/ui/chat.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert c.simulate_get("/ui/chat.css").status_code == 200
    assert c.simulate_get("/ui/../app.py").status_code == 404
    assert c.simulate_get("/ui/nope.js").status_code == 404
    for body in (r.text, js.text):
        assert 'src="http' not in body and 'href="http' not in body and "import " not in body
    assert "default-src 'self'" in r.headers["content-security-policy"]
