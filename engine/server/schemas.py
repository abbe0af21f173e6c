"""Validate OpenAI and Anthropic request bodies into one internal request spec (typed, bounded, param-named 400s).

Both APIs map onto ChatSpec: template-ready messages, OpenAI function tools and a tool_choice kind,
SamplingParams. Each API's sampling fields and their ranges are a table (``OPENAI_SAMPLING``,
``ANTHROPIC_SAMPLING``) read by engine.server.fields; tool lists and tool choices are checked by one
path. Unknown top-level fields are accepted and ignored; a known field with a wrong type or value,
or an unsupported feature (best_of, echo, suffix ...), is a 400 naming the field.
``GenSpec.sampling_given`` names the sampling fields the body set, so the model's generation
defaults fill only the others. Must not import the engine loop or falcon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from engine.chat_template import reserved_template_kwarg
from engine.types import SamplingParams

from .errors import bad_request, type_error
from .fields import MISSING, TOKENS, Num, get_bool, get_object, get_stop, get_str
from .sampling_api import MAX_N, get_logit_bias, get_logprobs, get_response_format, given_fields

MAX_TOOLS = 128


@dataclass
class GenSpec:
    """What every endpoint extracts: sampling, limits, stop, streaming options."""

    model: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    cache_salt: str = ""
    n: int = 1  # choices; each is its own engine request sharing the prompt's KV through the prefix cache
    sampling_given: frozenset[str] = frozenset()  # SamplingParams fields the body set explicitly
    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", ...}
    speculative: bool = True  # false: this request opts out of speculative decoding


@dataclass
class ChatSpec(GenSpec):
    messages: list[dict] = field(default_factory=list)  # template-ready messages
    tools: list[dict] | None = None  # OpenAI function tools
    tool_choice: str = "auto"  # auto | none | required | named
    tool_name: str | None = None  # for tool_choice == "named"
    parallel_tool_calls: bool = True  # forced tool calls: several blocks allowed
    template_kwargs: dict = field(default_factory=dict)
    prompt_text: str = ""  # the rendered prompt (set by the resource; reasoning detection reads it)


@dataclass
class CompletionSpec(GenSpec):
    prompt: str | list[int] = ""


# OpenAI features this server does not have: (field, the values it accepts, what the others ask for)
_UNSUPPORTED = (("best_of", (None, 1), "other than 1"), ("suffix", (None, ""), "(insertion)"), ("echo", (None, False), "(prompt echo)"))


# The sampling fields each API reads (all of them taking the model's generation defaults when absent)
OPENAI_SAMPLING = {
    "temperature": Num(1.0, 0.0, 2.0),
    "top_p": Num(1.0, 0.0, 1.0, lo_open=True),
    "top_k": Num(0, 0, 1 << 31, integer=True),
    "min_p": Num(0.0, 0.0, 1.0),
    "presence_penalty": Num(0.0, -2.0, 2.0),
    "frequency_penalty": Num(0.0, -2.0, 2.0),
    "repetition_penalty": Num(1.0, 0.0, 10.0, lo_open=True),
}
ANTHROPIC_SAMPLING = {"temperature": Num(1.0, 0.0, 1.0), "top_p": OPENAI_SAMPLING["top_p"], "top_k": OPENAI_SAMPLING["top_k"]}
SEED = Num(None, -(1 << 63), (1 << 64) - 1, integer=True)


def _sampling(body: dict, table: dict[str, Num]) -> SamplingParams:
    return SamplingParams(**{name: num.read(body, name) for name, num in table.items()})


def _common_openai(body: dict, spec: GenSpec, max_tokens_default: int | None, chat: bool = True) -> None:
    for name, accepted, what in _UNSUPPORTED:
        if body.get(name) not in accepted:
            raise bad_request(f"`{name}` {what} is not supported by this server", name, "unsupported_parameter")
    spec.model = get_str(body, "model", None, max_len=256)
    b = {**body, "top_k": 0} if body.get("top_k") == -1 else body  # vLLM's "off"
    spec.sampling = replace(
        _sampling(b, OPENAI_SAMPLING),
        seed=SEED.read(body, "seed"),
        logit_bias=get_logit_bias(body),
        logprobs=get_logprobs(body, chat),
    )
    spec.sampling_given = given_fields(body, OPENAI_SAMPLING)
    spec.n = Num(1, 1, MAX_N, integer=True).read(body, "n")
    spec.response_format = get_response_format(body)
    mt = TOKENS.read(body, "max_completion_tokens")
    mt = mt if mt is not None else TOKENS.read(body, "max_tokens")
    spec.max_tokens = mt if mt is not None else max_tokens_default
    spec.stop = get_stop(body, "stop")
    spec.stream = get_bool(body, "stream", False)
    so = get_object(body, "stream_options")
    if so is not None:
        spec.include_usage = get_bool(so, "include_usage", False, prefix="stream_options.")
    spec.ignore_eos = get_bool(body, "ignore_eos", False)
    spec.cache_salt = get_str(body, "cache_salt", "", max_len=256) or ""
    spec.speculative = get_bool(body, "speculative", True)
    get_str(body, "user", None, max_len=4096)  # accepted, ignored


# ---------------------------------------------------------------- chat messages


def _text_of(content: Any, param: str, *, allow_none: bool = False) -> str:
    """OpenAI message content: a string or a list of text parts -> one string."""
    if content is None:
        if allow_none:
            return ""
        raise bad_request(f"`{param}` is required", param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            p = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise type_error(p, "a content part object", part)
            ptype = part.get("type")
            if ptype != "text":
                raise bad_request(
                    f'`{p}.type` {json.dumps(ptype)[:40]} is not supported (only "text")',
                    f"{p}.type", "unsupported_parameter"
                )
            t = part.get("text")
            if not isinstance(t, str):
                raise type_error(f"{p}.text", "a string", t)
            out.append(t)
        return "".join(out)
    raise type_error(param, "a string or a list of content parts", content)


def _tool_calls_in(tcs: Any, param: str) -> list[dict]:
    if not isinstance(tcs, list):
        raise type_error(param, "a list", tcs)
    out = []
    for j, tc in enumerate(tcs):
        p = f"{param}[{j}]"
        if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
            raise type_error(p, "a tool call object with `function`", tc)
        fn = tc["function"]
        name = fn.get("name")
        if not isinstance(name, str):
            raise type_error(f"{p}.function.name", "a string", name)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # keep the string; templates that need a mapping will say so
        out.append(_call(tc.get("id", ""), name, args))
    return out


def _call(call_id: Any, name: str, arguments: Any) -> dict:
    """A tool call of an assistant message, as the chat templates read it (both APIs)."""
    return {"id": str(call_id), "type": "function", "function": {"name": name, "arguments": arguments}}


def _message_list(raw: Any) -> list:
    if not isinstance(raw, list) or not raw:
        raise bad_request("`messages` must be a non-empty list", "messages")
    return raw


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_openai_messages(raw: Any) -> list[dict]:
    msgs = []
    for i, m in enumerate(_message_list(raw)):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise type_error(p, "a message object", m)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"`{p}.role` must be one of {', '.join(_ROLES)}, got {json.dumps(role)[:40]}",
                f"{p}.role", "invalid_value"
            )
        if role == "developer":
            role = "system"
        msg: dict = {"role": role}
        if role == "assistant":
            msg["content"] = _text_of(m.get("content"), f"{p}.content", allow_none=True)
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls_in(m["tool_calls"], f"{p}.tool_calls")
        else:
            msg["content"] = _text_of(m.get("content"), f"{p}.content")
        if role == "tool":
            tcid = m.get("tool_call_id", "")
            if not isinstance(tcid, str):
                raise type_error(f"{p}.tool_call_id", "a string", tcid)
            msg["tool_call_id"] = tcid
        name = m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        msgs.append(msg)
    return msgs


def _tool_list(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
        raise type_error("tools", f"a list of at most {MAX_TOOLS} tools", tools)
    return tools


def _choose(tools: list[dict] | None, kind: str, name=None, *, needs: str = "", name_param: str = ""):
    """(tools, tool_choice kind, named tool) once the choice is checked against the tools: ``needs``
    is the error when a choice other than none comes without tools; a named tool must be one of them."""
    if needs and kind != "none" and not tools:
        raise bad_request(needs, "tool_choice")
    if kind != "named":
        return tools, kind, None
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools or []}:
        raise bad_request(f"`{name_param}` must name one of `tools`", name_param)
    return tools, kind, name


def parse_openai_tools(body: dict) -> tuple[list[dict] | None, str, str | None]:
    """Returns (tools, tool_choice kind, named tool)."""
    tools = _tool_list(body)
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request(
                f'`tools[{i}]` must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]", "invalid_value"
            )
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"`tools[{i}].function.name` must be a non-empty string", f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise type_error(f"tools[{i}].function.parameters", "an object", fn["parameters"])
    tools = tools or None
    tc = body.get("tool_choice")
    if tc is None:
        return tools, ("auto" if tools else "none"), None
    if isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise bad_request(
                "`tool_choice` must be auto, none, required or a named function", "tool_choice", "invalid_value"
            )
        return _choose(tools, tc, needs=f"`tool_choice` {tc!r} needs `tools`")
    if isinstance(tc, dict):
        fn = tc.get("function")
        return _choose(tools, "named", fn.get("name") if isinstance(fn, dict) else None, name_param="tool_choice.function.name")
    raise type_error("tool_choice", "a string or an object", tc)


def parse_chat(body: dict) -> ChatSpec:
    spec = ChatSpec()
    _common_openai(body, spec, None)
    spec.messages = parse_openai_messages(body.get("messages"))
    spec.tools, spec.tool_choice, spec.tool_name = parse_openai_tools(body)
    spec.parallel_tool_calls = get_bool(body, "parallel_tool_calls", True)
    kw = get_object(body, "chat_template_kwargs")
    if kw is not None:
        for k in kw:  # the conversation, special tokens and template helpers are not the client's
            if reserved_template_kwarg(k):
                raise bad_request(
                    f"`chat_template_kwargs.{k}` cannot be set by a request", f"chat_template_kwargs.{k}"
                )
        spec.template_kwargs = kw
    return spec


def parse_completion(body: dict) -> CompletionSpec:
    spec = CompletionSpec()
    _common_openai(body, spec, 16, chat=False)
    prompt = body.get("prompt", MISSING)
    if prompt is MISSING or prompt is None:
        raise bad_request("`prompt` is required", "prompt")
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        elif prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            pass
        else:
            raise bad_request(
                "`prompt` must be a string, a list of token ids, or a list of exactly one of those "
                "(batched prompts are not supported)",
                "prompt", "unsupported_parameter"
            )
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in prompt):
            raise type_error("prompt", "a non-empty list of non-negative token ids", prompt)
    elif not isinstance(prompt, str):
        raise type_error("prompt", "a string or a list of token ids", prompt)
    spec.prompt = prompt
    return spec


# ---------------------------------------------------------------- Anthropic


def _anthropic_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise bad_request(f"`{param}[{j}]` must be a text block", f"{param}[{j}]", "invalid_value")
            out.append(b["text"])
        return "".join(out)
    raise type_error(param, "a string or a list of text blocks", content)


def parse_anthropic_messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _anthropic_text(system, "system")})
    for i, m in enumerate(_message_list(body.get("messages"))):
        p = f"messages.{i}"
        if not isinstance(m, dict):
            raise type_error(p, "a message object", m)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"`{p}.role` must be user or assistant", f"{p}.role", "invalid_value")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise type_error(f"{p}.content", "a string or a list of content blocks", content)
        texts: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            bp = f"{p}.content.{j}"
            if not isinstance(b, dict):
                raise type_error(bp, "a content block", b)
            bt = b.get("type")
            if bt == "text":
                if not isinstance(b.get("text"), str):
                    raise type_error(f"{bp}.text", "a string", b.get("text"))
                texts.append(b["text"])
            elif bt == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"`{bp}` needs a string `name` and an object `input`", bp)
                calls.append(_call(b.get("id", ""), b["name"], b.get("input", {})))
            elif bt == "tool_result" and role == "user":
                if texts:
                    msgs.append({"role": "user", "content": "".join(texts)})
                    texts = []
                rc = b.get("content", "")
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(b.get("tool_use_id", "")),
                        "content": _anthropic_text(rc, f"{bp}.content"),
                    }
                )
            else:
                raise bad_request(
                    f"`{bp}.type` {json.dumps(bt)[:40]} is not supported here",
                    f"{bp}.type", "unsupported_parameter"
                )
        if role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
        elif texts:
            msgs.append({"role": "user", "content": "".join(texts)})
    return msgs


def parse_anthropic_tools(body: dict) -> tuple[list[dict] | None, str, str | None]:
    """Anthropic tools as OpenAI function tools; returns (tools, tool_choice kind, named tool)."""
    out = []
    for i, t in enumerate(_tool_list(body) or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"`tools.{i}.name` must be a non-empty string", f"tools.{i}.name")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise type_error(f"tools.{i}.input_schema", "an object", schema)
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    tools = out or None
    tc = body.get("tool_choice")
    if tc is None:
        return tools, ("auto" if tools else "none"), None
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("`tool_choice.type` must be auto, any, tool or none", "tool_choice", "invalid_value")
    kind = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[tc["type"]]
    return _choose(tools, kind, tc.get("name"), needs="`tool_choice` needs `tools`", name_param="tool_choice.name")


def parse_anthropic(body: dict, *, count_only: bool = False) -> ChatSpec:
    spec = ChatSpec()
    spec.model = get_str(body, "model", None, max_len=256)
    spec.messages = parse_anthropic_messages(body)
    spec.tools, spec.tool_choice, spec.tool_name = parse_anthropic_tools(body)
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        spec.parallel_tool_calls = not get_bool(tc, "disable_parallel_tool_use", False, prefix="tool_choice.")
    th = body.get("thinking")
    if th is not None:  # extended thinking -> the template's enable_thinking switch
        if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled"):
            raise bad_request("`thinking.type` must be enabled or disabled", "thinking.type", "invalid_value")
        spec.template_kwargs = {"enable_thinking": th["type"] == "enabled"}
    if count_only:
        return spec
    spec.max_tokens = TOKENS.read(body, "max_tokens")
    if spec.max_tokens is None:
        raise bad_request("`max_tokens` is required", "max_tokens")
    spec.sampling = _sampling(body, ANTHROPIC_SAMPLING)
    spec.sampling_given = given_fields(body, ANTHROPIC_SAMPLING)
    spec.stop = get_stop(body, "stop_sequences")
    spec.stream = get_bool(body, "stream", False)
    spec.speculative = get_bool(body, "speculative", True)
    get_object(body, "metadata")  # accepted, ignored
    return spec
