"""Anthropic-compatible resources: /v1/messages (streaming event sequence) and /v1/messages/count_tokens.

Must not import the engine loop; generation goes through generation.Run.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import falcon

from . import sse
from .generation import Run, allowed_tools, chat_ids, check_model, constraint_factory, error_of
from .http_common import finished_text, read_json, respond, send_json, start_run
from .reasoning import reasoning_parser_for, split_all
from .schemas import ChatSpec, parse_anthropic
from .state import AppState
from .tool_calls import Call, Text, ToolCallParser


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


class Messages:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        spec = parse_anthropic(read_json(req, st))
        check_model(st, spec.model)
        ids = chat_ids(st, spec)  # sets spec.prompt_text (reasoning split, grammar phases)
        run = start_run(
            st, req, spec, ids, param="messages", id_prefix="msg_", constraint=constraint_factory(st, spec)
        )
        respond(run, spec, resp, self._stream, self._complete, sse.anthropic_stream_error)

    def _stop_reason(self, run: Run, spec: ChatSpec, reason: str, emitted: str, has_calls: bool):
        """Anthropic stop_reason and stop_sequence from the engine finish reason."""
        if has_calls and reason == "stop":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        eos = set(getattr(self.state.tokenizer, "eos_token_ids", ()) or ())
        if spec.stop and not (run.generated_ids and run.generated_ids[-1] in eos):
            try:
                full = self.state.tokenizer.decode(run.generated_ids)
            except Exception:
                full = ""
            tail = full[max(0, len(emitted) - 8) :]
            hits = [(tail.find(s), s) for s in spec.stop if s in tail]
            if hits:
                return "stop_sequence", min(hits)[1]
        return "end_turn", None

    def _usage(self, run: Run) -> dict:
        u = run.usage
        return {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0,
        }

    def _complete(self, run: Run, spec: ChatSpec, resp: falcon.Response) -> None:
        done = finished_text(run)
        if done is None:
            resp.status = falcon.code_to_http_status(499)
            return
        full, last = done
        reasoning, text = split_all(reasoning_parser_for(self.state.tokenizer, spec.prompt_text), full)
        allowed = allowed_tools(spec)
        evs = [Text(text)]
        if allowed is not None:
            p = ToolCallParser(allowed, id_factory=_tool_id)
            evs = p.feed(text) + p.finish()
        content = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        for e in evs:
            if isinstance(e, Text):
                if e.text:
                    content.append({"type": "text", "text": e.text})
            else:
                content.append(
                    {"type": "tool_use", "id": e.id, "name": e.name, "input": json.loads(e.arguments)}
                )
        has_calls = any(c["type"] == "tool_use" for c in content)
        reason, seq = self._stop_reason(run, spec, last.finish_reason, text, has_calls)
        send_json(
            resp,
            {
                "id": run.id,
                "type": "message",
                "role": "assistant",
                "model": self.state.model_info.id,
                "content": content,
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": self._usage(run),
            },
        )

    def _stream(self, run: Run, spec: ChatSpec) -> Iterator[bytes]:
        yield sse.OK_COMMENT
        u0 = self._usage(run)
        u0["output_tokens"] = 0
        yield sse.event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": run.id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": self.state.model_info.id,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": u0,
                },
            },
        )
        yield sse.event("ping", {"type": "ping"})
        allowed = allowed_tools(spec)
        parser = ToolCallParser(allowed, id_factory=_tool_id) if allowed is not None else None
        index = -1
        text_open = False
        think_open = False
        has_calls = False
        emitted: list[str] = []
        splitter = reasoning_parser_for(self.state.tokenizer, spec.prompt_text)

        def think(r: str, close: bool) -> Iterator[bytes]:
            nonlocal index, think_open
            if r and not think_open:
                index += 1
                think_open = True
                yield sse.event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                    },
                )
            if r:
                yield sse.event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": r}},
                )
            if close and think_open:
                think_open = False
                yield sse.event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": ""}},
                )
                yield sse.event("content_block_stop", {"type": "content_block_stop", "index": index})

        def split(text: str, final: bool) -> Iterator[bytes]:
            if splitter is None:
                if text:
                    yield from emit(parser.feed(text) if parser else [Text(text)])
                return
            r, c = splitter.feed(text)
            if final:
                r2, c2 = splitter.finish()
                r, c = r + r2, c + c2
            yield from think(r, bool(c) or final)
            if c:
                yield from emit(parser.feed(c) if parser else [Text(c)])

        def emit(evs) -> Iterator[bytes]:
            nonlocal index, text_open, has_calls
            for e in evs:
                if isinstance(e, Text):
                    if not e.text:
                        continue
                    emitted.append(e.text)
                    if not text_open:
                        index += 1
                        text_open = True
                        yield sse.event(
                            "content_block_start",
                            {
                                "type": "content_block_start",
                                "index": index,
                                "content_block": {"type": "text", "text": ""},
                            },
                        )
                    yield sse.event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "text_delta", "text": e.text},
                        },
                    )
                elif isinstance(e, Call):
                    if text_open:
                        yield sse.event("content_block_stop", {"type": "content_block_stop", "index": index})
                        text_open = False
                    index += 1
                    has_calls = True
                    yield sse.event(
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": index,
                            "content_block": {"type": "tool_use", "id": e.id, "name": e.name, "input": {}},
                        },
                    )
                    yield sse.event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": e.arguments},
                        },
                    )
                    yield sse.event("content_block_stop", {"type": "content_block_stop", "index": index})

        for ev in run.events():
            if ev is None:
                yield sse.event("ping", {"type": "ping"})
                continue
            if ev.text or ev.finish_reason is not None:
                yield from split(ev.text, ev.finish_reason is not None)
            if ev.finish_reason is None:
                continue
            if parser:
                yield from emit(parser.finish())
            if text_open:
                yield sse.event("content_block_stop", {"type": "content_block_stop", "index": index})
            if ev.finish_reason in ("error", "abort"):
                yield sse.event("error", error_of(ev).anthropic_body())
                yield sse.MESSAGE_STOP  # the stream always ends with its terminal event
                return
            reason, seq = self._stop_reason(run, spec, ev.finish_reason, "".join(emitted), has_calls)
            yield sse.event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {"output_tokens": run.usage.completion_tokens},
                },
            )
            yield sse.event("message_stop", {"type": "message_stop"})


class CountTokens:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        spec = parse_anthropic(read_json(req, st), count_only=True)
        check_model(st, spec.model)
        send_json(resp, {"input_tokens": len(chat_ids(st, spec))})
