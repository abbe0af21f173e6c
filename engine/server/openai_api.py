"""OpenAI-compatible resources: /v1/chat/completions, /v1/completions, /v1/models[/{id}].

Must not import the engine loop; generation goes through generation.Run.
"""

from __future__ import annotations

from collections.abc import Iterator

import falcon

from . import sse
from .errors import ApiError
from .generation import Run, allowed_tools, chat_prompt, check_model, encode, error_of
from .http_common import read_json, respond, send_json, start_run, usage_openai
from .schemas import ChatSpec, CompletionSpec, parse_chat, parse_completion
from .state import AppState
from .tool_calls import Call, Text, ToolCallParser


def _finish(reason: str, has_calls: bool) -> str:
    if has_calls and reason == "stop":
        return "tool_calls"
    return reason if reason in ("stop", "length") else "stop"


class ChatCompletions:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        spec = parse_chat(read_json(req, st))
        check_model(st, spec.model)
        ids = encode(st, chat_prompt(st, spec))
        run = start_run(st, req, spec, ids, param="messages", id_prefix="chatcmpl-")
        respond(run, spec, resp, self._stream, self._complete, sse.openai_stream_error)

    def _base(self, run: Run, obj: str) -> dict:
        return {
            "id": run.id,
            "object": obj,
            "created": run.created,
            "model": self.state.model_info.id,
            "system_fingerprint": self.state.config.system_fingerprint,
        }

    def _complete(self, run: Run, spec: ChatSpec, resp: falcon.Response) -> None:
        parts: list[str] = []
        last = None
        for ev in run.events():
            if ev is None:
                continue
            parts.append(ev.text)
            last = ev
        if last is None:  # client went away
            resp.status = falcon.code_to_http_status(499)
            return
        if last.finish_reason in ("error", "abort"):
            raise error_of(last)
        text = "".join(parts)
        allowed = allowed_tools(spec)
        calls: list[Call] = []
        content = text
        if allowed is not None:
            p = ToolCallParser(allowed)
            evs = p.feed(text) + p.finish()
            calls = [e for e in evs if isinstance(e, Call)]
            content = "".join(e.text for e in evs if isinstance(e, Text))
        msg: dict = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        body = self._base(run, "chat.completion")
        body["choices"] = [
            {
                "index": 0,
                "message": msg,
                "logprobs": None,
                "finish_reason": _finish(last.finish_reason, bool(calls)),
            }
        ]
        body["usage"] = usage_openai(run.usage)
        send_json(resp, body)

    def _chunk(self, run: Run, delta: dict, finish: str | None = None, usage: bool = False) -> bytes:
        c = self._base(run, "chat.completion.chunk")
        c["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if usage:
            c["usage"] = None
        return sse.data(c)

    def _stream(self, run: Run, spec: ChatSpec) -> Iterator[bytes]:
        iu = spec.include_usage
        yield sse.OK_COMMENT
        yield self._chunk(run, {"role": "assistant", "content": ""}, usage=iu)
        allowed = allowed_tools(spec)
        parser = ToolCallParser(allowed) if allowed is not None else None
        n_calls = 0

        def emit(evs) -> Iterator[bytes]:
            nonlocal n_calls
            for e in evs:
                if isinstance(e, Text):
                    if e.text:
                        yield self._chunk(run, {"content": e.text}, usage=iu)
                else:
                    yield self._chunk(
                        run,
                        {
                            "tool_calls": [
                                {
                                    "index": n_calls,
                                    "id": e.id,
                                    "type": "function",
                                    "function": {"name": e.name, "arguments": ""},
                                }
                            ]
                        },
                        usage=iu,
                    )
                    yield self._chunk(
                        run,
                        {"tool_calls": [{"index": n_calls, "function": {"arguments": e.arguments}}]},
                        usage=iu,
                    )
                    n_calls += 1

        for ev in run.events():
            if ev is None:
                yield sse.KEEPALIVE
                continue
            if ev.text:
                yield from emit(parser.feed(ev.text) if parser else [Text(ev.text)])
            if ev.finish_reason is None:
                continue
            if parser:
                yield from emit(parser.finish())
            if ev.finish_reason in ("error", "abort"):
                yield sse.data(error_of(ev).openai_body())
                yield sse.DONE
                return
            yield self._chunk(run, {}, _finish(ev.finish_reason, n_calls > 0), usage=iu)
            if iu:
                c = self._base(run, "chat.completion.chunk")
                c["choices"] = []
                c["usage"] = usage_openai(run.usage)
                yield sse.data(c)
            yield sse.DONE


class Completions:
    def __init__(self, state: AppState):
        self.state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        spec = parse_completion(read_json(req, st))
        check_model(st, spec.model)
        if isinstance(spec.prompt, list):
            vocab = int(getattr(st.tokenizer, "vocab_size", 1 << 31))
            if max(spec.prompt) >= vocab:
                raise ApiError(
                    400,
                    f"`prompt` has a token id >= vocab size {vocab}",
                    code="invalid_value",
                    param="prompt",
                )
            ids = list(spec.prompt)
        else:
            ids = encode(st, spec.prompt, "prompt", add_special_tokens=True)  # BOS, as `memra run` does
        run = start_run(st, req, spec, ids, param="prompt", id_prefix="cmpl-")
        respond(run, spec, resp, self._stream, self._complete, sse.openai_stream_error)

    def _complete(self, run: Run, spec, resp: falcon.Response) -> None:
        parts, last = [], None
        for ev in run.events():
            if ev is not None:
                parts.append(ev.text)
                last = ev
        if last is None:
            resp.status = falcon.code_to_http_status(499)
            return
        if last.finish_reason in ("error", "abort"):
            raise error_of(last)
        body = self._base(run)
        body["choices"] = [
            {
                "index": 0,
                "text": "".join(parts),
                "logprobs": None,
                "finish_reason": _finish(last.finish_reason, False),
            }
        ]
        body["usage"] = usage_openai(run.usage)
        send_json(resp, body)

    def _base(self, run: Run) -> dict:
        return {
            "id": run.id,
            "object": "text_completion",
            "created": run.created,
            "model": self.state.model_info.id,
            "system_fingerprint": self.state.config.system_fingerprint,
        }

    def _chunk(self, run: Run, text: str, finish: str | None, iu: bool) -> bytes:
        c = self._base(run)
        c["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        if iu:
            c["usage"] = None
        return sse.data(c)

    def _stream(self, run: Run, spec: CompletionSpec) -> Iterator[bytes]:
        iu = spec.include_usage
        yield sse.OK_COMMENT
        for ev in run.events():
            if ev is None:
                yield sse.KEEPALIVE
                continue
            if ev.finish_reason in ("error", "abort"):
                if ev.text:
                    yield self._chunk(run, ev.text, None, iu)
                yield sse.data(error_of(ev).openai_body())
                yield sse.DONE
                return
            if ev.text or ev.finish_reason:
                yield self._chunk(
                    run, ev.text, _finish(ev.finish_reason, False) if ev.finish_reason else None, iu
                )
            if ev.finish_reason:
                if iu:
                    c = self._base(run)
                    c["choices"] = []
                    c["usage"] = usage_openai(run.usage)
                    yield sse.data(c)
                yield sse.DONE


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


class Models:
    def __init__(self, state: AppState):
        self.state = state

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.state.require_ready()
        mi = self.state.model_info
        send_json(resp, {"object": "list", "data": [_model_obj(self.state, n) for n in (mi.id, *mi.aliases)]})

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        self.state.require_ready()
        if not self.state.model_info.matches(model_id):
            raise ApiError(
                404,
                f"The model `{model_id}` does not exist",
                code="model_not_found",
                param="model",
                anthropic_type="not_found_error",
            )
        send_json(resp, _model_obj(self.state, model_id))
