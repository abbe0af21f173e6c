"""Render HF-style Jinja2 chat templates in a sandbox, with HF's globals/filters and a ChatML fallback.

Must not import the tokenizer, the weights readers, CUDA or numpy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.types import MemraError

#: Used when a model ships no template (plain ChatML, as SmolLM2/Qwen use).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


#: Template variables a request's ``chat_template_kwargs`` may not set: the conversation itself, the
#: special tokens, and the helpers the template calls (a client could otherwise forge turns or
#: disable the template's own checks). Ordinary switches such as ``enable_thinking`` pass through.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "lipsum",
        "cycler",
        "joiner",
        "namespace",
    }
)


def reserved_template_kwarg(name: str) -> bool:
    """True for a template variable that request kwargs must not override (see RESERVED_TEMPLATE_KWARGS)."""
    return name in RESERVED_TEMPLATE_KWARGS or name.startswith("_") or name.endswith("_token")


class TemplateRaised(Exception):
    """raise_exception() called from inside a template."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # HF semantics: no HTML escaping, non-ASCII kept, optional indent.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` once; raises MemraError on a syntax error (with the line number)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise MemraError(
            f"chat template syntax error at line {e.lineno}: {e.message}", code="invalid_model"
        ) from None


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` (+ ``tools``) with ``template`` (None -> ChatML). Extra kwargs reach the template.

    Raises MemraError when the template fails to compile, calls raise_exception, or errors while rendering.
    """
    bad = sorted(k for k in template_kwargs if reserved_template_kwarg(k))
    if bad:
        raise MemraError(
            f"chat template variable {bad[0]!r} cannot be set by the request", param=f"chat_template_kwargs.{bad[0]}"
        )
    tpl = compile_template(template if template is not None else CHATML_TEMPLATE)
    ctx = dict(template_kwargs)
    ctx.update(
        messages=[dict(m) for m in messages],
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        return tpl.render(**ctx)
    except TemplateRaised as e:
        raise MemraError(f"chat template rejected the conversation: {e}") from None
    except jinja2.TemplateError as e:
        raise MemraError(f"chat template failed: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise MemraError(f"chat template failed: {type(e).__name__}: {e}") from None
