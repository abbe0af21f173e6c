"""Reasoning split (engine.server.reasoning) and the sampling-API plumbing of the server, against the
scripted fake engine: reasoning_content in chat responses and deltas, Anthropic thinking blocks,
chat_template_kwargs / thinking reaching the template, n > 1 choices, the model's generation
defaults filling omitted fields."""

from __future__ import annotations

import json

import falcon.testing
import pytest
from server_fakes import FakeEngine, FakeTokenizer

from engine.gen_defaults import model_generation_defaults, with_defaults
from engine.server.app import create_app
from engine.server.model_info import ModelInfo
from engine.server.reasoning import ReasoningSplitter, split_all
from engine.server_config import ServerConfig
from engine.types import SamplingParams

OUT = "<think>Let me see: 2+2.</think>\n\nIt is **4**."


class ThinkTokenizer(FakeTokenizer):
    """A reasoning model's tokenizer: knows <think>/</think> and records template kwargs."""

    def __init__(self, open_block: bool = False):
        self.open_block = open_block
        self.kwargs: list[dict] = []

    def token_to_id(self, token):
        return {"<think>": 1_000_001, "</think>": 1_000_002}.get(token)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, **kwargs):
        self.kwargs.append(kwargs)
        text = super().apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return text + ("<think>\n" if self.open_block else "")


def _client(script, tok=None, info=None):
    eng = FakeEngine(script=script)
    tok = tok or ThinkTokenizer()
    app = create_app(eng, tok, info or ModelInfo("smol", 4096, "fake", 1), ServerConfig(keepalive_s=0.3))
    return falcon.testing.TestClient(app), eng, tok


def _sse(text):
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _events(text):
    out = []
    for frame in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line and not line.startswith(":"))
        if "data" in lines:
            out.append(json.loads(lines["data"]))
    return out


@pytest.mark.parametrize("cut", range(len(OUT) + 1))
def test_splitter_is_independent_of_chunking(cut):
    s = ReasoningSplitter()
    parts = [s.feed(OUT[:cut]), s.feed(OUT[cut:]), s.finish()]
    assert "".join(p[0] for p in parts) == "Let me see: 2+2."
    assert "".join(p[1] for p in parts) == "It is **4**."


def test_splitter_cases():
    assert split_all(None, OUT) == (None, OUT)
    assert split_all(ReasoningSplitter(), "plain answer") == (None, "plain answer")
    assert split_all(ReasoningSplitter(inside=True), "thinking</think> done") == ("thinking", "done")
    assert split_all(ReasoningSplitter(inside=True), "cut off mid-thought") == ("cut off mid-thought", "")
    assert split_all(ReasoningSplitter(), "a <think> later is content") == (None, "a <think> later is content")


def test_chat_reasoning_content_and_template_kwargs():
    c, _, tok = _client(lambda req: [OUT[i : i + 3] for i in range(0, len(OUT), 3)])
    body = {"messages": [{"role": "user", "content": "2+2?"}], "chat_template_kwargs": {"enable_thinking": True}}
    r = c.simulate_post("/v1/chat/completions", json=body)
    msg = r.json["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "Let me see: 2+2."
    assert msg["content"] == "It is **4**."
    assert tok.kwargs[-1] == {"enable_thinking": True}
    r = c.simulate_post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [ch["choices"][0]["delta"] for ch in _sse(r.text) if ch["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see: 2+2."
    assert "".join(d.get("content", "") for d in deltas) == "It is **4**."


def test_prompt_that_opens_the_block():
    c, _, _ = _client(lambda req: ["still thinking", "</think>", "Done."], tok=ThinkTokenizer(open_block=True))
    r = c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
    msg = r.json["choices"][0]["message"]
    assert msg["reasoning_content"] == "still thinking" and msg["content"] == "Done."


def test_no_reasoning_fields_for_a_plain_model():
    c, _, _ = _client(lambda req: [OUT], tok=FakeTokenizer())
    msg = c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]}).json[
        "choices"
    ][0]["message"]
    assert "reasoning_content" not in msg and msg["content"] == OUT


def test_anthropic_thinking_blocks():
    c, _, tok = _client(lambda req: [OUT[i : i + 4] for i in range(0, len(OUT), 4)])
    body = {
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "2+2?"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    r = c.simulate_post("/v1/messages", json=body)
    assert [b["type"] for b in r.json["content"]] == ["thinking", "text"]
    assert r.json["content"][0]["thinking"] == "Let me see: 2+2." and r.json["content"][1]["text"] == "It is **4**."
    assert tok.kwargs[-1] == {"enable_thinking": True}
    r = c.simulate_post("/v1/messages", json={**body, "stream": True})
    evs = _events(r.text)
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(e["delta"]["thinking"] for e in evs if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    text = "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
    assert thinking == "Let me see: 2+2." and text == "It is **4**."
    stops = [e["index"] for e in evs if e["type"] == "content_block_stop"]
    assert stops == [0, 1]
    bad = c.simulate_post("/v1/messages", json={**body, "thinking": {"type": "maybe"}})
    assert bad.status_code == 400 and "thinking" in bad.json["error"]["message"]


def test_n_choices_and_seeds():
    c, eng, _ = _client(lambda req: ["a", "b"], tok=FakeTokenizer())
    r = c.simulate_post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "n": 3, "seed": 7}
    )
    assert [ch["index"] for ch in r.json["choices"]] == [0, 1, 2]
    assert [ch["message"]["content"] for ch in r.json["choices"]] == ["ab"] * 3
    assert r.json["usage"]["completion_tokens"] == 6
    assert [q.sampling.seed for q in eng.submitted] == [7, 8, 9]
    assert len({q.request_id for q in eng.submitted}) == 3
    r = c.simulate_post(
        "/v1/completions", json={"prompt": "q", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = _sse(r.text)
    text = {i: "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i) for i in (0, 1)}
    assert text == {0: "ab", 1: "ab"} and chunks[-1]["usage"]["completion_tokens"] == 4


def test_model_generation_defaults_fill_omitted_fields():
    gguf = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": "x"}
    assert model_generation_defaults(gguf) == {"temperature": 0.6, "top_k": 20}
    hf = {"_generation_config": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 0.0, "do_sample": True}}
    assert model_generation_defaults(hf) == {"temperature": 0.2, "top_p": 0.9}  # 0.0 is out of range: skipped
    p = with_defaults(SamplingParams(temperature=1.0), frozenset({"temperature"}), {"temperature": 0.2, "top_p": 0.9})
    assert (p.temperature, p.top_p) == (1.0, 0.9)
    info = ModelInfo("smol", 4096, "fake", 1, generation_defaults=(("temperature", 0.2), ("top_p", 0.9)))
    c, eng, _ = _client(lambda req: ["x"], tok=FakeTokenizer(), info=info)
    c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
    c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "temperature": 0})
    c.simulate_post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "q"}], "top_p": 0.5})
    got = [(q.sampling.temperature, q.sampling.top_p) for q in eng.submitted]
    assert got == [(0.2, 0.9), (0.0, 0.9), (0.2, 0.5)]


def test_streamed_choices_interleave():
    eng = FakeEngine(script=lambda req: ["a", "b", "c", "d", "e"], delay_s=0.03)
    app = create_app(eng, FakeTokenizer(), ModelInfo("smol", 4096, "fake", 1), ServerConfig(keepalive_s=0.3))
    c = falcon.testing.TestClient(app)
    r = c.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "n": 2, "stream": True})
    order = [ch["choices"][0]["index"] for ch in _sse(r.text) if ch["choices"] and ch["choices"][0]["delta"].get("content")]
    assert sorted(order) == [0] * 5 + [1] * 5
    assert order != sorted(order)  # choice 1's text arrives while choice 0 is still streaming
    texts = {i: "".join(ch["choices"][0]["delta"].get("content") or "" for ch in _sse(r.text) if ch["choices"] and ch["choices"][0]["index"] == i) for i in (0, 1)}
    assert texts == {0: "abcde", 1: "abcde"}
    assert r.text.rstrip().endswith("data: [DONE]")
