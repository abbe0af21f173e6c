"""Split a reasoning model's ``<think>…</think>`` block out of its generated text, incrementally.

Used for ``reasoning_content`` (OpenAI chat, also sent as ``reasoning``) and Anthropic ``thinking``
blocks. A model is a reasoning model when its tokenizer knows ``</think>`` as a token; the block is
open from the start when the rendered prompt ends inside ``<think>`` (templates that open it
themselves). Tags split across chunks are held back until they can be decided. Must not import
falcon or the engine loop.
"""

from __future__ import annotations

from typing import Any

START, END = "<think>", "</think>"


def reasoning_parser_for(tokenizer: Any, prompt: str) -> ReasoningSplitter | None:
    """A splitter when the served model has ``</think>`` in its vocabulary, else None."""
    to_id = getattr(tokenizer, "token_to_id", None)
    if to_id is None or to_id(END) is None:
        return None
    return ReasoningSplitter(inside=prompt.rfind(START) > prompt.rfind(END))


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """``feed(text) -> (reasoning, content)`` per chunk; ``finish()`` flushes what was held back.

    Before any tag the text is content unless ``inside``; a ``<think>`` at the very start of the
    output (leading whitespace allowed) opens the block, ``</think>`` closes it for good (one
    block, as every reasoning chat template emits). Whitespace right after ``</think>`` is dropped.
    """

    def __init__(self, inside: bool = False):
        self.state = "think" if inside else "start"  # start | think | content
        self.buf = ""
        self.saw_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf = stripped[len(START) :]
                    self.state = "think"
                elif START.startswith(stripped):  # maybe the tag, still arriving
                    break
                else:
                    self.state = "content"
            elif self.state == "think":
                at = self.buf.find(END)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf = self.buf[at + len(END) :].lstrip()
                    self.state = "after"
                    continue
                keep = _held(self.buf, END)
                reasoning.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            elif self.state == "after":  # drop the whitespace between </think> and the answer
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = "content"
            else:
                content.append(self.buf)
                self.buf = ""
        r = "".join(reasoning)
        self.saw_reasoning = self.saw_reasoning or bool(r)
        return r, "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self.buf = self.buf, ""
        if self.state == "think":
            self.saw_reasoning = self.saw_reasoning or bool(buf)
            return buf, ""
        return "", buf if self.state != "after" else ""


def split_all(splitter: ReasoningSplitter | None, text: str) -> tuple[str | None, str]:
    """Whole-text split: (reasoning or None, content)."""
    if splitter is None:
        return None, text
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    r = r1 + r2
    return (r if r or splitter.saw_reasoning else None), c1 + c2
