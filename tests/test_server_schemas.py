"""The request parsers' shared paths (engine.server.schemas, engine.server.fields): the sampling tables
and the one tool-choice check, through both APIs, with the 400 each bad value gets."""

from __future__ import annotations

import pytest

from engine.server.errors import ApiError
from engine.server.schemas import ANTHROPIC_SAMPLING, OPENAI_SAMPLING, parse_anthropic, parse_chat

MSG = [{"role": "user", "content": "hi"}]
OAI_TOOLS = [{"type": "function", "function": {"name": "f"}}]
ANT_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]


def chat(**kw):
    return parse_chat({"messages": MSG, **kw})


def anth(**kw):
    return parse_anthropic({"messages": MSG, "max_tokens": 8, **kw})


def error(fn, **kw) -> tuple[str, str | None, str]:
    with pytest.raises(ApiError) as e:
        fn(**kw)
    assert e.value.status == 400
    return e.value.message, e.value.param, e.value.code


def test_sampling_tables_read_every_field_and_record_what_was_given():
    spec = chat(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, presence_penalty=1, frequency_penalty=-1,
                repetition_penalty=1.1, seed=3, logit_bias={"7": 2})
    s = spec.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.logit_bias) == (0.5, 0.9, 0, 0.1, 3, ((7, 2.0),))
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (1.0, -1.0, 1.1)
    assert spec.sampling_given == frozenset(OPENAI_SAMPLING)  # seed and logit_bias are not model defaults
    a = anth(temperature=0.25, top_k=4)
    assert (a.sampling.temperature, a.sampling.top_k, a.sampling.top_p) == (0.25, 4, 1.0)
    assert a.sampling_given == {"temperature", "top_k"} and set(ANTHROPIC_SAMPLING) == {"temperature", "top_p", "top_k"}


@pytest.mark.parametrize(
    "fn,field,value,message",
    [
        (chat, "temperature", 2.5, "`temperature` must be a number >= 0.0 and <= 2.0, got 2.5"),
        (anth, "temperature", 1.5, "`temperature` must be a number >= 0.0 and <= 1.0, got 1.5"),
        (chat, "top_p", 0, "`top_p` must be a number > 0.0 and <= 1.0, got 0"),
        (anth, "top_p", 0, "`top_p` must be a number > 0.0 and <= 1.0, got 0"),
        (anth, "top_k", -1, "`top_k` must be an integer >= 0 and <= 2147483648, got -1"),  # -1 is "off" in OpenAI only
        (chat, "seed", "x", '`seed` must be an integer, got "x"'),
        (chat, "logprobs", 3, "`logprobs` must be a boolean, got 3"),
        (chat, "top_logprobs", 21, None),
        (chat, "max_tokens", 0, "`max_tokens` must be an integer >= 1 and <= 2147483648, got 0"),
        (anth, "max_tokens", 0, "`max_tokens` must be an integer >= 1 and <= 2147483648, got 0"),
    ],
)
def test_sampling_ranges_name_the_field(fn, field, value, message):
    got, param, _ = error(fn, **{field: value})
    assert param == field and (message is None or got == message)


@pytest.mark.parametrize(
    "fn,kw,message,param",
    [
        (chat, {"tool_choice": "required"}, "`tool_choice` 'required' needs `tools`", "tool_choice"),
        (anth, {"tool_choice": {"type": "any"}}, "`tool_choice` needs `tools`", "tool_choice"),
        (chat, {"tools": OAI_TOOLS, "tool_choice": {"function": {"name": "g"}}},
         "`tool_choice.function.name` must name one of `tools`", "tool_choice.function.name"),
        (chat, {"tool_choice": {"function": {"name": "f"}}},
         "`tool_choice.function.name` must name one of `tools`", "tool_choice.function.name"),
        (anth, {"tools": ANT_TOOLS, "tool_choice": {"type": "tool", "name": "g"}},
         "`tool_choice.name` must name one of `tools`", "tool_choice.name"),
        (anth, {"tools": ANT_TOOLS, "tool_choice": {"type": "tool", "name": ["f"]}},  # unhashable: a 400, not a crash
         "`tool_choice.name` must name one of `tools`", "tool_choice.name"),
        (chat, {"tools": "x"}, '`tools` must be a list of at most 128 tools, got "x"', "tools"),
        (anth, {"tools": [{}] * 129}, "`tools` must be a list of at most 128 tools, got list", "tools"),
    ],
)
def test_tool_choice_errors(fn, kw, message, param):
    assert error(fn, **kw)[:2] == (message, param)


def test_tool_choice_kinds_map_onto_one_spec():
    for spec, kind, name in [
        (chat(tools=OAI_TOOLS), "auto", None),
        (chat(tools=OAI_TOOLS, tool_choice="required"), "required", None),
        (chat(tools=OAI_TOOLS, tool_choice={"function": {"name": "f"}}), "named", "f"),
        (chat(tool_choice="none"), "none", None),
        (anth(tools=ANT_TOOLS), "auto", None),
        (anth(tools=ANT_TOOLS, tool_choice={"type": "any"}), "required", None),
        (anth(tools=ANT_TOOLS, tool_choice={"type": "tool", "name": "f"}), "named", "f"),
        (anth(tool_choice={"type": "none"}), "none", None),
    ]:
        assert (spec.tool_choice, spec.tool_name) == (kind, name)
    assert anth(tools=ANT_TOOLS).tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_tool_calls_in_messages_take_one_shape():
    oai = chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]}])
    ant = anth(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]}])
    assert oai.messages[0]["tool_calls"] == ant.messages[0]["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]


@pytest.mark.parametrize("field,value,what", [("best_of", 2, "other than 1"), ("suffix", "x", "(insertion)"), ("echo", True, "(prompt echo)")])
def test_unsupported_openai_fields(field, value, what):
    assert error(chat, **{field: value}) == (
        f"`{field}` {what} is not supported by this server", field, "unsupported_parameter"
    )
