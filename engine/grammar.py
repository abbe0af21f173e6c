"""Constrained decoding with llguidance: JSON (json_object / json_schema) and forced tool calls.

``build_constraint`` compiles a grammar into an ``llguidance.LLMatcher`` (in the caller's thread,
i.e. the HTTP thread, never the engine thread) and wraps it as an ``engine.types.TokenConstraint``:
before each sampled step the engine asks ``allowed()`` for the packed int32 token bitmask
(``llguidance.numpy``), applies it before sampling (engine.sampling.sample_item), then feeds the
sampled token to ``advance``. For a reasoning model the grammar starts after ``</think>``: while the
reasoning block is open nothing is masked. The llguidance tokenizer (built from the served
tokenizer's ``tokenizers`` JSON, about 0.3 s) is made once per tokenizer and cached.
Must not import CUDA, falcon or the engine loop.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from engine.types import MemraError

_LOCK = threading.Lock()
_LLTOK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def ll_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer of a served engine.tokenizer.Tokenizer (cached per tokenizer)."""
    from llguidance import LLTokenizer

    with _LOCK:
        lt = _LLTOK.get(tokenizer)
        if lt is None:
            eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
            lt = LLTokenizer(tokenizer.hf.to_str(), eos_token=eos or None)
            _LLTOK[tokenizer] = lt
        return lt


def json_grammar(schema: dict | None) -> str:
    """llguidance grammar text for one JSON value matching ``schema`` (None: any JSON object)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(tools: list[dict], name: str | None, parallel: bool = True) -> str:
    """Grammar for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (what
    engine.server.tool_calls parses): one block, or several separated by newlines when
    ``parallel``; each names one of ``tools`` (only ``name`` when given) with arguments valid
    against that tool's parameters schema."""
    from llguidance import LLMatcher

    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise MemraError(f"no tool named {name!r}", param="tool_choice")
    schemas = [_call_schema(t) for t in chosen]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lark = f'{start}\ncall: "<tool_call>" body "</tool_call>"\nbody: %json {json.dumps(body)}\n'
    return LLMatcher.grammar_from_lark(lark)


class GrammarConstraint:
    """A TokenConstraint over an LLMatcher. ``think``: (start id, end id) of a reasoning model's
    block; ``inside``: the prompt left the block open. Phases: ``think`` (unmasked until the end
    token), ``maybe`` (the first token may open a reasoning block instead of starting the grammar),
    ``on`` (every token masked by the grammar)."""

    def __init__(self, matcher: Any, vocab: int, think: tuple[int, int] | None = None, inside: bool = False):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = matcher
        self.mask = allocate_token_bitmask(1, vocab)
        self.think = think
        self.phase = "on" if think is None else ("think" if inside else "maybe")
        self.failed: str | None = None  # why the matcher cannot go on (advance raises it)

    def allowed(self) -> np.ndarray | None:
        """The step's mask. Never raises and never returns an empty mask (an exception or an empty
        mask in the runner would fail every request of the step): when the matcher cannot continue,
        the step is left unmasked and ``advance`` fails this request alone."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.phase == "think" or self.failed is not None:
            return None
        try:
            fill_next_token_bitmask(self.matcher, self.mask, 0)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            return None
        row = self.mask[0]
        if self.matcher.is_error() or not row.any():
            self.failed = self.matcher.get_error() or "no token can continue the grammar"
            return None
        if self.phase == "maybe":
            row = row.copy()
            t = self.think[0]
            row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        return row

    def advance(self, token: int) -> None:
        if self.failed is not None:
            raise MemraError(f"the output constraint failed: {self.failed}", code="engine_error")
        if self.phase == "think":
            if token == self.think[1]:
                self.phase = "on"
            return
        if self.phase == "maybe":
            self.phase = "on"
            if token == self.think[0]:
                self.phase = "think"
                return
        if self.matcher.is_stopped():  # the grammar is complete; only an end token can follow
            return
        if not self.matcher.consume_token(int(token)):
            raise MemraError(f"the output left its grammar: {self.matcher.get_error()}", code="engine_error")


def build_constraint(tokenizer: Any, grammar: str, reasoning: str | None = None) -> GrammarConstraint:
    """Compile ``grammar`` for ``tokenizer``. ``reasoning``: None for a model without a reasoning
    block, "inside" when the prompt leaves ``<think>`` open, "maybe" when the model may open one.
    MemraError (param response_format) when the grammar or schema is invalid."""
    from llguidance import LLMatcher

    lt = ll_tokenizer(tokenizer)
    matcher = LLMatcher(lt, grammar, log_level=0)
    if matcher.is_error():
        raise MemraError(f"invalid schema or grammar: {matcher.get_error()}", param="response_format")
    think = None
    if reasoning is not None:
        ids = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        if None not in ids:
            think = ids
    return GrammarConstraint(matcher, lt.vocab_size, think, inside=reasoning == "inside")
