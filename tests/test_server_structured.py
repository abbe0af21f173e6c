"""Issue #39's API features against the real SmolLM2-135M-Instruct GGUF on the numpy reference
backend, in process (one engine for the module), driven by the official openai and anthropic SDKs:
schema-valid JSON from response_format, forced tool calls that validate against the tool's schema
(OpenAI required/named, Anthropic any/tool, parallel), logprobs (plain and streamed), n > 1 sharing
the prompt's KV blocks, logit_bias, and the model's generation defaults.
"""

from __future__ import annotations

import json
import math

import pytest

from engine.server.app import create_app
from engine.server.serve import BackgroundServer
from engine.server_config import ApiKey, ServerConfig, hash_key

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the reference backend: minutes for the module

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

KEY = "sk-structured"
MSG = [{"role": "user", "content": "Give me a person: name and age."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 12}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def srv(smollm2_path):
    from engine.backend import StackFlags
    from engine.server.launch import build_engine

    cfg = ServerConfig(keys=(ApiKey("key_s", hash_key(KEY), "s1", cache_salt="s1"),), keepalive_s=5.0)
    engine, tok, info = build_engine(str(smollm2_path), ("default",), cfg, StackFlags("reference"))
    app = create_app(engine, tok, info, cfg)
    with BackgroundServer(app) as bg:
        yield bg.url, engine
    engine.check_invariants()
    engine.shutdown(5.0)


def _oa(srv):
    return openai.OpenAI(base_url=srv[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_json_schema_output_is_valid(srv):
    r = _oa(srv).chat.completions.create(
        model="default",
        messages=MSG,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    obj = json.loads(r.choices[0].message.content)
    jsonschema.validate(obj, PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_streamed(srv):
    chunks = _oa(srv).chat.completions.create(
        model="default", messages=MSG, max_tokens=40, temperature=0.7, seed=3,
        response_format={"type": "json_object"}, stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required"])
def test_openai_forced_tool_call_validates(srv, choice):
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    r = _oa(srv).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi there!"}],  # a prompt that invites prose, not a call
        tools=[WEATHER, TIME],
        tool_choice=tc,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    if choice == "named":
        assert call.function.name == "get_time"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_anthropic_forced_tool_use(srv):
    client = anthropic.Anthropic(base_url=srv[0], api_key=KEY, max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}
    m = client.messages.create(
        model="default", max_tokens=60, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hello!"}],
        tools=[tool], tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, tool["input_schema"])


def test_logprobs_and_streamed_logprobs(srv):
    c = _oa(srv)
    r = c.chat.completions.create(
        model="default", messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-6)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-6
    assert "".join(e.token for e in content) == r.choices[0].message.content
    s = c.chat.completions.create(
        model="default", messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for ch in s if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    cr = c.completions.create(model="default", prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    lp = cr.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == cr.usage.completion_tokens
    assert "".join(lp.tokens) == cr.choices[0].text


def test_n_choices_share_the_prompt_kv(srv):
    long_msg = [{"role": "user", "content": "Tell me a short story about a cat who sails the sea. " * 4}]
    r = _oa(srv).chat.completions.create(
        model="default", messages=long_msg, max_tokens=5, temperature=1.0, seed=11, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 15
    texts = {c.message.content for c in r.choices}
    assert len(texts) >= 2  # distinct seeds per choice
    # choices 1..n-1 were admitted after choice 0's prefill: their full prompt blocks were prefix-cache hits
    stats = srv[1].stats()
    assert stats.prefix_hit_tokens >= 2 * (r.usage.prompt_tokens // 16) * 16 > 0


def test_logit_bias_forces_and_bans(srv):
    c = _oa(srv)
    prompt = "The capital of France is"
    base = c.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    greedy = base.choices[0].logprobs.tokens[0]
    tok = srv[1].tokenizer
    greedy_id = next(i for i in tok.encode(greedy) if tok.decode([i]) == greedy)
    banned = c.completions.create(
        model="default", prompt=prompt, max_tokens=1, temperature=0, logprobs=0, logit_bias={str(greedy_id): -100}
    )
    assert banned.choices[0].logprobs.tokens[0] != greedy
    forced = c.completions.create(
        model="default", prompt=prompt, max_tokens=3, temperature=0, logprobs=0, logit_bias={"28": 100}
    )
    assert forced.choices[0].logprobs.tokens == [tok.decode([28])] * 3
