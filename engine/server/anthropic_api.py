"""Anthropic-compatible resources: /v1/messages (streaming event sequence) and /v1/messages/count_tokens.

Must not import the engine loop; generation goes through generation.Run.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import falcon

from . import sse
from .chat_output import ChatOutput
from .generation import Run, RunGroup, chat_ids, check_model, error_of
from .http_common import GenerateResource, Resource, read_json, send_json
from .schemas import ChatSpec, parse_anthropic
from .tool_calls import Call, Text


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _event(kind: str, **fields) -> bytes:
    """An SSE event whose data names its own type first, as every Anthropic stream event does."""
    return sse.event(kind, {"type": kind, **fields})


class Messages(GenerateResource):
    parse = staticmethod(parse_anthropic)  # one choice (no `n`)
    id_prefix = "msg_"
    stream_error = staticmethod(sse.anthropic_stream_error)

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

    def _body(self, group: RunGroup, spec: ChatSpec, done: list) -> dict:
        ((run, full, last),) = done
        reasoning, evs = ChatOutput(self.state.tokenizer, spec, _tool_id).whole(full)
        text = "".join(e.text for e in evs if isinstance(e, Text))  # all of it when there are no calls
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
        message = {"id": run.id, "type": "message", "role": "assistant", "model": self.state.model_info.id}
        return {**message, "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": self._usage(run)}

    def _stream(self, group: RunGroup, spec: ChatSpec) -> Iterator[bytes]:
        run = group.runs[0]
        yield sse.OK_COMMENT
        message = {"id": run.id, "type": "message", "role": "assistant", "content": [], "model": self.state.model_info.id}
        usage = {**self._usage(run), "output_tokens": 0}
        yield _event("message_start", message={**message, "stop_reason": None, "stop_sequence": None, "usage": usage})
        yield _event("ping")
        out = ChatOutput(self.state.tokenizer, spec, _tool_id)
        index = -1
        text_open = False
        think_open = False
        has_calls = False
        emitted: list[str] = []

        def start(block: dict) -> bytes:
            nonlocal index
            index += 1
            return _event("content_block_start", index=index, content_block=block)

        def delta(d: dict) -> bytes:
            return _event("content_block_delta", index=index, delta=d)

        def think(r: str, close: bool) -> Iterator[bytes]:
            nonlocal think_open
            if r and not think_open:
                think_open = True
                yield start({"type": "thinking", "thinking": "", "signature": ""})
            if r:
                yield delta({"type": "thinking_delta", "thinking": r})
            if close and think_open:
                think_open = False
                yield delta({"type": "signature_delta", "signature": ""})
                yield _event("content_block_stop", index=index)

        def emit(evs) -> Iterator[bytes]:
            nonlocal text_open, has_calls
            for e in evs:
                if isinstance(e, Text):
                    if not e.text:
                        continue
                    emitted.append(e.text)
                    if not text_open:
                        text_open = True
                        yield start({"type": "text", "text": ""})
                    yield delta({"type": "text_delta", "text": e.text})
                elif isinstance(e, Call):
                    if text_open:
                        yield _event("content_block_stop", index=index)
                        text_open = False
                    has_calls = True
                    yield start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                    yield delta({"type": "input_json_delta", "partial_json": e.arguments})
                    yield _event("content_block_stop", index=index)

        for ev in run.events():
            if ev is None:
                yield _event("ping")
                continue
            final = ev.finish_reason is not None
            if ev.text or final:
                r, c, evs = out.feed(ev.text, final)
                yield from think(r, bool(c) or final)
                yield from emit(evs)
            if not final:
                continue
            if text_open:
                yield _event("content_block_stop", index=index)
            if ev.finish_reason in ("error", "abort"):
                yield sse.event("error", error_of(ev).anthropic_body())
                yield sse.MESSAGE_STOP  # the stream always ends with its terminal event
                return
            reason, seq = self._stop_reason(run, spec, ev.finish_reason, "".join(emitted), has_calls)
            usage = {"output_tokens": run.usage.completion_tokens}
            yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq}, usage=usage)
            yield _event("message_stop")


class CountTokens(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        spec = parse_anthropic(read_json(req, st), count_only=True)
        check_model(st, spec.model)
        send_json(resp, {"input_tokens": len(chat_ids(st, spec, req.context.tenant))})
