"""A chat response's generated text as reasoning, text and tool calls: the reasoning split
(engine.server.reasoning), then the tool-call parser (engine.server.tool_calls) on what is not
reasoning; over the whole text or fed chunk by chunk. The OpenAI and Anthropic resources render its
output in their own shapes. Must not import falcon or the engine loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .reasoning import reasoning_parser_for, split_all
from .schemas import ChatSpec
from .tool_calls import Call, Text, ToolCallParser, new_call_id


def allowed_tools(spec: ChatSpec) -> set[str] | None:
    """Tool names a parsed call may use (None: tool calls are not parsed at all)."""
    if spec.tool_choice == "none" or not spec.tools:
        return None
    if spec.tool_choice == "named":
        return {spec.tool_name or ""}
    return {t["function"]["name"] for t in spec.tools}


class ChatOutput:
    """One choice's output parsers (a reasoning splitter when the model reasons, a tool-call parser
    when the request has tools); ``id_factory`` names the calls."""

    def __init__(self, tokenizer: Any, spec: ChatSpec, id_factory: Callable[[], str] = new_call_id):
        self.splitter = reasoning_parser_for(tokenizer, spec.prompt_text)
        allowed = allowed_tools(spec)
        self.parser = None if allowed is None else ToolCallParser(allowed, id_factory=id_factory)

    def feed(self, text: str, final: bool) -> tuple[str, str, list[Text | Call]]:
        """One chunk (``final``: the last, flushing what was held back) -> (reasoning, the content
        text after the split, its Text and Call events)."""
        r, c = ("", text) if self.splitter is None else self.splitter.feed(text)
        if final and self.splitter is not None:
            r2, c2 = self.splitter.finish()
            r, c = r + r2, c + c2
        events = (self.parser.feed(c) if self.parser else [Text(c)]) if c else []
        if final and self.parser:
            events += self.parser.finish()
        return r, c, events

    def whole(self, text: str) -> tuple[str | None, list[Text | Call]]:
        """The whole text -> (reasoning, or None when the model did not reason; Text and Call events)."""
        reasoning, content = split_all(self.splitter, text)
        return reasoning, (self.parser.feed(content) + self.parser.finish() if self.parser else [Text(content)])
