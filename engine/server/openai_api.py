"""OpenAI-compatible resources: /v1/chat/completions, /v1/completions, /v1/models[/{id}].

Must not import the engine loop; generation goes through generation.Run.
"""

from __future__ import annotations

from collections.abc import Iterator

import falcon

from engine.types import TokenEvent

from . import sse
from .auth import Tenant
from .chat_output import ChatOutput
from .errors import ApiError
from .generation import Run, RunGroup, cache_scope, error_of, interleave, text_ids
from .http_common import GenerateResource, Resource, send_json, usage_openai
from .logprobs import chat_content, completion_logprobs
from .schemas import ChatSpec, CompletionSpec, GenSpec, parse_chat, parse_completion
from .state import AppState
from .tool_calls import Call, Text


def _finish(reason: str, has_calls: bool) -> str:
    if has_calls and reason == "stop":
        return "tool_calls"
    return reason if reason in ("stop", "length") else "stop"


class _OpenAIGeneration(GenerateResource):
    """What chat and text completions share: the response envelope, the choices of a JSON answer
    (``_choice``), the SSE stream of the choices' chunks (``_stream_choice``) and its usage chunk."""

    obj = chunk_obj = ""  # the response's `object` when whole, and of each streamed chunk

    def _base(self, run, obj: str) -> dict:
        return {
            "id": run.id,
            "object": obj,
            "created": run.created,
            "model": self.state.model_info.id,
            "system_fingerprint": self.state.config.system_fingerprint,
        }

    def _chunk(self, run: Run, payload: dict, finish: str | None, usage: bool, logprobs=None) -> bytes:
        c = self._base(run, self.chunk_obj)
        c["choices"] = [{"index": run.index, **payload, "logprobs": logprobs, "finish_reason": finish}]
        if usage:
            c["usage"] = None
        return sse.data(c)

    def _choice(self, run: Run, spec, text: str, last: TokenEvent) -> dict:
        raise NotImplementedError

    def _stream_choice(self, run: Run, spec, events) -> Iterator[bytes]:
        raise NotImplementedError

    def _body(self, group: RunGroup, spec: GenSpec, done: list) -> dict:
        body = self._base(group, self.obj)
        body["choices"] = [self._choice(run, spec, text, last) for run, text, last in done]
        body["usage"] = usage_openai(group.usage)
        return body

    def _stream(self, group: RunGroup, spec: GenSpec) -> Iterator[bytes]:
        yield sse.OK_COMMENT
        ok = yield from interleave(group, lambda run, evs: self._stream_choice(run, spec, evs), sse.KEEPALIVE)
        if ok and spec.include_usage:
            c = self._base(group, self.chunk_obj)
            c["choices"] = []
            c["usage"] = usage_openai(group.usage)
            yield sse.data(c)
        yield sse.DONE


class ChatCompletions(_OpenAIGeneration):
    parse = staticmethod(parse_chat)
    id_prefix = "chatcmpl-"
    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def _choice(self, run: Run, spec: ChatSpec, full: str, last: TokenEvent) -> dict:
        """One finished choice's message."""
        reasoning, evs = ChatOutput(self.state.tokenizer, spec).whole(full)
        calls = [e for e in evs if isinstance(e, Call)]
        content = "".join(e.text for e in evs if isinstance(e, Text))
        msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
        if reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        lp = None
        if spec.sampling.logprobs is not None:
            lp = {"content": chat_content(self.state.tokenizer, run.generated_ids, run.logprobs)}
        return {
            "index": run.index,
            "message": msg,
            "logprobs": lp,
            "finish_reason": _finish(last.finish_reason, bool(calls)),
        }

    def _stream_choice(self, run: Run, spec: ChatSpec, events):
        """Yield one choice's chunks from ``events`` (None: yield a keep-alive); returns False when
        the stream must end (error, client gone)."""
        iu = spec.include_usage
        tok = self.state.tokenizer
        want_lp = spec.sampling.logprobs is not None
        yield self._chunk(run, {"delta": {"role": "assistant", "content": ""}}, None, iu)
        out = ChatOutput(tok, spec)
        n_calls = 0
        pending_lp: list[dict] = []  # logprob entries not yet attached to a chunk

        def lp_now():
            if not want_lp:
                return None
            lp = {"content": list(pending_lp)}
            pending_lp.clear()
            return lp

        def delta(d: dict, logprobs=None) -> bytes:
            return self._chunk(run, {"delta": d}, None, iu, logprobs)

        def text_out(text: str, final: bool) -> Iterator[bytes]:
            nonlocal n_calls
            r, _, evs = out.feed(text, final)
            if r:
                yield delta({"reasoning_content": r, "reasoning": r}, lp_now())
            for e in evs:
                if isinstance(e, Text):
                    if e.text:
                        yield delta({"content": e.text}, lp_now())
                    continue
                call = {"index": n_calls, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
                yield delta({"tool_calls": [call]})
                yield delta({"tool_calls": [{"index": n_calls, "function": {"arguments": e.arguments}}]}, lp_now())
                n_calls += 1

        for ev in events:
            if ev is None:
                yield sse.KEEPALIVE
                continue
            if want_lp and ev.logprobs:
                pending_lp.extend(chat_content(tok, ev.token_ids, ev.logprobs))
            final = ev.finish_reason is not None
            if ev.text or final:
                yield from text_out(ev.text, final)
            if not final:
                continue
            if ev.finish_reason in ("error", "abort"):
                yield sse.data(error_of(ev).openai_body())
                return False
            lp = lp_now() if pending_lp else None
            yield self._chunk(run, {"delta": {}}, _finish(ev.finish_reason, n_calls > 0), iu, lp)
            return True
        return False  # the client went away


class Completions(_OpenAIGeneration):
    parse = staticmethod(parse_completion)
    param, id_prefix = "prompt", "cmpl-"
    obj = chunk_obj = "text_completion"

    def prompt_ids(self, spec: CompletionSpec, tenant: Tenant) -> list[int]:
        if isinstance(spec.prompt, str):  # BOS, as `memra run` does
            scope = cache_scope(tenant, spec.cache_salt)
            return text_ids(self.state, spec.prompt, scope, "prompt", add_special_tokens=True)
        vocab = int(getattr(self.state.tokenizer, "vocab_size", 1 << 31))
        if max(spec.prompt) >= vocab:
            raise ApiError(
                400, f"`prompt` has a token id >= vocab size {vocab}", code="invalid_value", param="prompt"
            )
        return list(spec.prompt)

    def _choice(self, run: Run, spec: CompletionSpec, text: str, last: TokenEvent) -> dict:
        lp = None
        if spec.sampling.logprobs is not None:
            lp = completion_logprobs(self.state.tokenizer, run.generated_ids, run.logprobs)
        return {"index": run.index, "text": text, "logprobs": lp, "finish_reason": _finish(last.finish_reason, False)}

    def _stream_choice(self, run: Run, spec: CompletionSpec, events):
        """One choice's chunks from ``events`` (None: a keep-alive); False when the stream must end."""
        iu = spec.include_usage
        want_lp = spec.sampling.logprobs is not None
        sent = 0
        for ev in events:
            if ev is None:
                yield sse.KEEPALIVE
                continue
            lp = None
            if want_lp:
                lp = completion_logprobs(self.state.tokenizer, ev.token_ids, ev.logprobs or [], sent)
            if ev.finish_reason in ("error", "abort"):
                if ev.text:
                    yield self._chunk(run, {"text": ev.text}, None, iu, lp)
                yield sse.data(error_of(ev).openai_body())
                return False
            if ev.text or ev.finish_reason or (want_lp and ev.token_ids):
                finish = _finish(ev.finish_reason, False) if ev.finish_reason else None
                yield self._chunk(run, {"text": ev.text}, finish, iu, lp)
            sent += len(ev.text)
            if ev.finish_reason:
                return True
        return False  # the client went away


def _model_obj(state: AppState, name: str) -> dict:
    mi = state.model_info
    return {
        "id": name,
        "object": "model",
        "created": mi.created,
        "owned_by": "memra",
        "context_length": mi.context_length,
        "max_model_len": mi.context_length,
        "backend": mi.backend,
        "root": mi.id,
    }


class Models(Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.state.require_ready(admit=False)
        mi = self.state.model_info
        send_json(resp, {"object": "list", "data": [_model_obj(self.state, n) for n in (mi.id, *mi.aliases)]})

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        self.state.require_ready(admit=False)
        if not self.state.model_info.matches(model_id):
            raise ApiError(
                404,
                f"The model `{model_id}` does not exist",
                code="model_not_found",
                param="model",
                anthropic_type="not_found_error",
            )
        send_json(resp, _model_obj(self.state, model_id))
