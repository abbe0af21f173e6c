"""engine.server.chat_output: the reasoning split then the tool-call parse that both APIs' resources
use, streamed in any split equal to the whole text at once."""

from __future__ import annotations

import itertools

import pytest

from engine.server.chat_output import ChatOutput, allowed_tools
from engine.server.schemas import ChatSpec
from engine.server.tool_calls import Call, Text

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f"}}]


class Tok:
    def __init__(self, reasoning: bool):
        self.reasoning = reasoning

    def token_to_id(self, t):
        return 1 if self.reasoning and t == "</think>" else None


def _ids():
    n = itertools.count()
    return lambda: f"id{next(n)}"


def streamed(tok, spec, chunks):
    out = ChatOutput(tok, spec, _ids())
    reasoning, events = "", []
    for i, c in enumerate(chunks):
        r, _, evs = out.feed(c, i == len(chunks) - 1)
        reasoning += r
        events += evs
    return reasoning, _merged(events)


def _merged(events):
    """Adjacent Text events joined (how text is split into events depends on the chunks)."""
    out = []
    for e in events:
        if isinstance(e, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + e.text)
        elif not (isinstance(e, Text) and not e.text):
            out.append(e)
    return out


@pytest.mark.parametrize("reasoning", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("text", ["<think>hm, 2+2</think>\n\nIt is 4. " + CALL, "plain " + CALL + " after", ""])
def test_stream_in_any_split_equals_whole(reasoning, tools, text):
    spec = ChatSpec(tools=tools, tool_choice="auto" if tools else "none")
    tok = Tok(reasoning)
    r_whole, ev_whole = ChatOutput(tok, spec, _ids()).whole(text)
    assert r_whole is None or reasoning
    for cut in range(len(text) + 1):
        chunks = [text[:cut], text[cut:]]
        r, evs = streamed(tok, spec, chunks)
        assert r == (r_whole or "") and evs == _merged(ev_whole), cut
    calls = [e for e in ev_whole if isinstance(e, Call)]
    assert len(calls) == (1 if tools and text else 0)
    if calls:
        assert (calls[0].id, calls[0].name, calls[0].arguments) == ("id0", "f", '{"a": 1}')


def test_allowed_tools_by_choice():
    assert allowed_tools(ChatSpec(tools=TOOLS, tool_choice="none")) is None
    assert allowed_tools(ChatSpec(tools=None, tool_choice="auto")) is None
    assert allowed_tools(ChatSpec(tools=TOOLS, tool_choice="required")) == {"f"}
    assert allowed_tools(ChatSpec(tools=TOOLS, tool_choice="named", tool_name="g")) == {"g"}


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ],
)
def test_whole_answer_is_499_when_the_client_left_first(path, body):
    """GenerateResource._complete, shared by the three generating endpoints: a client gone before
    any token came gets 499 and every choice is aborted."""
    import falcon.testing
    from server_fakes import FakeEngine, FakeTokenizer

    from engine.server.app import create_app
    from engine.server.model_info import ModelInfo
    from engine.server_config import ServerConfig

    eng = FakeEngine(delay_s=5.0)
    app = create_app(eng, FakeTokenizer(), ModelInfo("m", 4096, "fake", 1), ServerConfig(keepalive_s=5))
    extras = {"waitress.client_disconnected": lambda: True}
    if body.get("n"):  # choice 0 waits for its first event before the others are submitted
        extras = {"waitress.client_disconnected": lambda: len(eng.submitted) > 0}
    r = falcon.testing.TestClient(app).simulate_post(path, json=body, extras=extras)
    assert r.status_code == 499
    assert eng.aborted and set(eng.aborted) == {q.request_id for q in eng.submitted}
