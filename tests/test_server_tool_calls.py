"""Streaming tool-call parser: every split point gives the same result; partial and malformed blocks."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.server.tool_calls import Call, Text, ToolCallParser


def run(chunks, allowed=None):
    ids = (f"call_{i}" for i in itertools.count())
    p = ToolCallParser(allowed, id_factory=lambda: next(ids))
    evs = []
    for c in chunks:
        evs += p.feed(c)
    evs += p.finish()
    text = "".join(e.text for e in evs if isinstance(e, Text))
    calls = [(e.name, json.loads(e.arguments)) for e in evs if isinstance(e, Call)]
    return text, calls, evs


ONE = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n</tool_call>'
TWO = (
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
)
MALFORMED = 'pre <tool_call>{"name": "a", "arguments": {"x": </tool_call> post'


@pytest.mark.parametrize(
    "text,expect_text,expect_calls",
    [
        (ONE, "Sure.", [("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]})]),
        (TWO, "", [("a", {}), ("b", {"x": 1})]),
        (MALFORMED, MALFORMED, []),
        ("no calls here < tool_call <tool", "no calls here < tool_call <tool", []),
        (
            '<tool_call>{"name": "a", "arguments": {"k": 1}}',
            "",
            [("a", {"k": 1})],
        ),  # unclosed but complete JSON
        ('x<tool_call>{"name": "a", "argu', 'x<tool_call>{"name": "a", "argu', []),  # truncated: verbatim
        ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),  # not an object
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),  # no name
        (
            '<tool_call>{"name": "a", "arguments": 5}</tool_call>',
            '<tool_call>{"name": "a", "arguments": 5}</tool_call>',
            [],
        ),
    ],
)
def test_every_split_point(text, expect_text, expect_calls):
    whole = run([text])
    assert whole[0] == expect_text and whole[1] == expect_calls
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            got = run([text[:i], text[i:j], text[j:]])
            assert got[:2] == whole[:2], (i, j)
    chars = run(list(text))
    assert chars[:2] == whole[:2]


def test_text_released_early_and_tag_prefix_held():
    p = ToolCallParser()
    assert p.feed("Hello <tool") == [Text("Hello")]  # trailing space and tag prefix held
    assert p.feed("s are fun") == [Text(" <tools are fun")]


def test_disallowed_name_is_text():
    text, calls, _ = run([ONE], allowed={"other"})
    assert calls == [] and "<tool_call>" in text


def test_order_preserved_between_text_and_calls():
    _, _, evs = run(['A <tool_call>{"name": "a", "arguments": {}}</tool_call> B'])
    assert [type(e).__name__ for e in evs] == ["Text", "Call", "Text"]
    assert evs[0].text == "A" and evs[2].text == " B"


def test_runaway_block_bounded():
    from engine.server import tool_calls

    text, calls, _ = run(["<tool_call>{" + "x" * (tool_calls.MAX_BLOCK_CHARS + 10)])
    assert calls == [] and text.startswith("<tool_call>{x")
