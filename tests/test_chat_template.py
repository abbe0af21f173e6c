"""engine.chat_template: sandboxed HF templates (SmolLM2's real one, a Qwen3-style tool template), errors."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import CHATML_TEMPLATE, render_chat_template
from engine.types import MemraError

# Written for this test with the structure of Qwen3's template: tools in a system block, <tool_call>
# JSON blocks for assistant tool_calls, tool results as <tool_response> in a user turn, and
# enable_thinking=False adding an empty <think> block to the generation prompt.
QWEN3_STYLE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}{{- raise_exception('system message must come first') }}{%- endif %}
        {%- continue %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_qwen3_style_tools_and_thinking() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"wind": 3}'},
    ]
    out = render_chat_template(QWEN3_STYLE, messages, tools=[WEATHER], enable_thinking=False)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in out and "Météo" in out
    assert (
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        in out
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"wind": 3}\n</tool_response><|im_end|>\n'
        in out
    )
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = render_chat_template(QWEN3_STYLE, messages[:2], add_generation_prompt=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"


def test_raise_exception_becomes_memra_error() -> None:
    with pytest.raises(MemraError, match="chat template rejected the conversation: unknown role robot"):
        render_chat_template(QWEN3_STYLE, [{"role": "robot", "content": "x"}])


def test_syntax_and_runtime_errors() -> None:
    with pytest.raises(MemraError, match="chat template syntax error at line 1"):
        render_chat_template("{% for m in messages %}", [])
    with pytest.raises(MemraError, match="chat template failed"):
        render_chat_template("{{ messages[0].content.upper() + 1 }}", [{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escape() -> None:
    with pytest.raises(MemraError, match="chat template failed: SecurityError"):
        render_chat_template(
            "{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}]
        )
    with pytest.raises(MemraError, match="chat template failed: SecurityError"):
        render_chat_template("{{ messages.append(1) }}", [])


def test_globals_and_filters() -> None:
    out = render_chat_template(
        "{{ strftime_now('%Y') | length }}|{{ {'a': 'é', 'b': [1]} | tojson(indent=2) }}|{{ bos_token }}{{ extra }}",
        [],
        bos_token="<s>",
        extra="!",
    )
    assert out == '4|{\n  "a": "é",\n  "b": [\n    1\n  ]\n}|<s>!'


def test_chatml_fallback() -> None:
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": None},
    ]
    assert render_chat_template(None, msgs, add_generation_prompt=False) == render_chat_template(
        CHATML_TEMPLATE, msgs, add_generation_prompt=False
    )
    assert (
        render_chat_template(None, msgs[:2])
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_real_template(smollm2_source) -> None:
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_source)
    out = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    own_system = tok.apply_chat_template(
        [{"role": "system", "content": "Pirate."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert own_system == "<|im_start|>system\nPirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(out)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
