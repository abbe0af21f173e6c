"""Streaming parser for Qwen3/Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Feed it the generated text in any split; it returns ``Text`` and ``Call`` events. Text is released
as soon as it cannot be the start of a ``<tool_call>`` tag. A block is held until its closing tag
(or the end of generation), then validated as a whole: a valid block becomes one ``Call`` (whose
name and arguments the SSE layer sends as separate deltas), anything else (bad JSON, missing name,
a tool the request did not declare) is released verbatim as ``Text``. The output never depends on
how the input was split. Must not import the engine or falcon.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MAX_BLOCK_CHARS = 1 << 20


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON object text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held_prefix_len(s: str, tag: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:n]):
            return n
    return 0


def parse_block(body: str, allowed: set[str] | None) -> tuple[str, str] | None:
    """Return (name, arguments JSON) for a valid block body, else None."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (allowed is not None and name not in allowed):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Incremental splitter of generated text into Text and Call events (see module docstring)."""

    def __init__(self, allowed_names: set[str] | None = None, id_factory: Callable[[], str] = new_call_id):
        self.allowed = allowed_names
        self._id = id_factory
        self._buf = ""  # text not yet released (text mode) or the block body (block mode)
        self._in_block = False
        self._ws = ""  # trailing whitespace held back: dropped if a tool call follows
        self.calls: list[Call] = []

    def _text(self, out: list, s: str) -> None:
        if not s:
            return
        stripped = s.rstrip()
        if not stripped:
            self._ws += s
            return
        out.append(Text(self._ws + stripped))
        self._ws = s[len(stripped) :]

    def _close_block(self, out: list, body: str, closed: bool) -> None:
        parsed = parse_block(body, self.allowed)
        if parsed is None:
            raw = OPEN + body + (CLOSE if closed else "")
            out.append(Text(self._ws + raw))
            self._ws = ""
        else:
            self._ws = ""
            call = Call(self._id(), parsed[0], parsed[1])
            self.calls.append(call)
            out.append(call)

    def feed(self, text: str) -> list[Text | Call]:
        out: list[Text | Call] = []
        self._buf += text
        while True:
            if self._in_block:
                i = self._buf.find(CLOSE)
                if i < 0:
                    if len(self._buf) > MAX_BLOCK_CHARS:  # runaway block: give it back as text
                        self._in_block = False
                        self._text(out, OPEN + self._buf)
                        self._buf = ""
                    break
                body, self._buf = self._buf[:i], self._buf[i + len(CLOSE) :]
                self._in_block = False
                self._close_block(out, body, True)
                continue
            i = self._buf.find(OPEN)
            if i >= 0:
                self._text(out, self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._in_block = True
                continue
            keep = _held_prefix_len(self._buf, OPEN)
            self._text(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return _merge(out)

    def finish(self) -> list[Text | Call]:
        """End of generation: resolve an unclosed block and release held text."""
        out: list[Text | Call] = []
        if self._in_block:
            self._in_block = False
            self._close_block(out, self._buf, False)
        elif self._buf:
            self._text(out, self._buf)
        self._buf = ""
        if self._ws and not self.calls:
            out.append(Text(self._ws))
        self._ws = ""
        return _merge(out)


def _merge(events: list[Text | Call]) -> list[Text | Call]:
    out: list[Text | Call] = []
    for e in events:
        if isinstance(e, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def tool_instruction(kind: str, name: str | None) -> str:
    """System text added for tool_choice ``required`` / named."""
    if kind == "named":
        return (
            f"You must call the tool `{name}` now. Reply with exactly one <tool_call></tool_call> block "
            f'containing a JSON object with "name": "{name}" and "arguments".'
        )
    return (
        "You must call one of the provided tools now. Reply with <tool_call></tool_call> blocks, each "
        'containing a JSON object with "name" and "arguments".'
    )
