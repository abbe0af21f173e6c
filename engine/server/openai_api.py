"""OpenAI-compatible resources: /v1/chat/completions, /v1/completions, /v1/models[/{id}].

Must not import the engine loop; generation goes through generation.Run.
"""

from __future__ import annotations

from collections.abc import Iterator

import falcon

from . import sse
from .errors import ApiError
from .generation import (
    Run,
    RunGroup,
    allowed_tools,
    chat_ids,
    check_model,
    constraint_factory,
    error_of,
    interleave,
    text_ids,
)
from .http_common import finished_text, read_json, respond, send_json, start_group, usage_openai
from .logprobs import chat_content, completion_logprobs
from .reasoning import reasoning_parser_for, split_all
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
        ids = chat_ids(st, spec)  # sets spec.prompt_text (reasoning split, grammar phases)
        group = start_group(
            st, req, spec, ids, param="messages", id_prefix="chatcmpl-", constraint=constraint_factory(st, spec)
        )
        respond(group, spec, resp, self._stream, self._complete, sse.openai_stream_error)

    def _base(self, run, obj: str) -> dict:
        return {
            "id": run.id,
            "object": obj,
            "created": run.created,
            "model": self.state.model_info.id,
            "system_fingerprint": self.state.config.system_fingerprint,
        }

    def _choice(self, run: Run, spec: ChatSpec) -> dict | None:
        """One finished choice's message (None when the client went away)."""
        done = finished_text(run)
        if done is None:
            return None
        full, last = done
        reasoning, text = split_all(reasoning_parser_for(self.state.tokenizer, spec.prompt_text), full)
        allowed = allowed_tools(spec)
        calls: list[Call] = []
        content = text
        if allowed is not None:
            p = ToolCallParser(allowed)
            evs = p.feed(text) + p.finish()
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

    def _complete(self, group: RunGroup, spec: ChatSpec, resp: falcon.Response) -> None:
        choices = []
        for run in group.runs:
            c = self._choice(run, spec)
            if c is None:  # client went away
                resp.status = falcon.code_to_http_status(499)
                return
            choices.append(c)
        body = self._base(group, "chat.completion")
        body["choices"] = choices
        body["usage"] = usage_openai(group.usage)
        send_json(resp, body)

    def _chunk(
        self, run: Run, delta: dict, finish: str | None = None, usage: bool = False, logprobs=None
    ) -> bytes:
        c = self._base(run, "chat.completion.chunk")
        c["choices"] = [{"index": run.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        if usage:
            c["usage"] = None
        return sse.data(c)

    def _stream(self, group: RunGroup, spec: ChatSpec) -> Iterator[bytes]:
        yield sse.OK_COMMENT
        ok = yield from interleave(group, lambda run, evs: self._stream_choice(run, spec, evs), sse.KEEPALIVE)
        if not ok:
            yield sse.DONE
            return
        if spec.include_usage:
            c = self._base(group, "chat.completion.chunk")
            c["choices"] = []
            c["usage"] = usage_openai(group.usage)
            yield sse.data(c)
        yield sse.DONE

    def _stream_choice(self, run: Run, spec: ChatSpec, events):
        """Yield one choice's chunks from ``events`` (None: yield a keep-alive); returns False when
        the stream must end (error, client gone)."""
        iu = spec.include_usage
        tok = self.state.tokenizer
        want_lp = spec.sampling.logprobs is not None
        yield self._chunk(run, {"role": "assistant", "content": ""}, usage=iu)
        allowed = allowed_tools(spec)
        parser = ToolCallParser(allowed) if allowed is not None else None
        splitter = reasoning_parser_for(tok, spec.prompt_text)
        n_calls = 0
        pending_lp: list[dict] = []  # logprob entries not yet attached to a chunk

        def lp_now():
            if not want_lp:
                return None
            out = {"content": list(pending_lp)}
            pending_lp.clear()
            return out

        def emit(evs) -> Iterator[bytes]:
            nonlocal n_calls
            for e in evs:
                if isinstance(e, Text):
                    if e.text:
                        yield self._chunk(run, {"content": e.text}, usage=iu, logprobs=lp_now())
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
                        logprobs=lp_now(),
                    )
                    n_calls += 1

        def text_out(text: str, final: bool) -> Iterator[bytes]:
            if splitter is not None:
                r, text = splitter.feed(text)
                if final:
                    r2, t2 = splitter.finish()
                    r, text = r + r2, text + t2
                if r:
                    yield self._chunk(
                        run, {"reasoning_content": r, "reasoning": r}, usage=iu, logprobs=lp_now()
                    )
            if text:
                yield from emit(parser.feed(text) if parser else [Text(text)])
            if final and parser:
                yield from emit(parser.finish())

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
            yield self._chunk(run, {}, _finish(ev.finish_reason, n_calls > 0), usage=iu, logprobs=lp)
            return True
        return False  # the client went away


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
            ids = text_ids(st, spec.prompt, "prompt", add_special_tokens=True)  # BOS, as `memra run` does
        group = start_group(
            st, req, spec, ids, param="prompt", id_prefix="cmpl-", constraint=constraint_factory(st, spec)
        )
        respond(group, spec, resp, self._stream, self._complete, sse.openai_stream_error)

    def _complete(self, group: RunGroup, spec, resp: falcon.Response) -> None:
        choices = []
        for run in group.runs:
            done = finished_text(run)
            if done is None:
                resp.status = falcon.code_to_http_status(499)
                return
            text, last = done
            lp = None
            if spec.sampling.logprobs is not None:
                lp = completion_logprobs(self.state.tokenizer, run.generated_ids, run.logprobs)
            choices.append(
                {
                    "index": run.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": _finish(last.finish_reason, False),
                }
            )
        body = self._base(group)
        body["choices"] = choices
        body["usage"] = usage_openai(group.usage)
        send_json(resp, body)

    def _base(self, run) -> dict:
        return {
            "id": run.id,
            "object": "text_completion",
            "created": run.created,
            "model": self.state.model_info.id,
            "system_fingerprint": self.state.config.system_fingerprint,
        }

    def _chunk(self, run: Run, text: str, finish: str | None, iu: bool, logprobs=None) -> bytes:
        c = self._base(run)
        c["choices"] = [{"index": run.index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
        if iu:
            c["usage"] = None
        return sse.data(c)

    def _stream(self, group: RunGroup, spec: CompletionSpec) -> Iterator[bytes]:
        yield sse.OK_COMMENT
        ok = yield from interleave(group, lambda run, evs: self._stream_choice(run, spec, evs), sse.KEEPALIVE)
        if not ok:
            yield sse.DONE
            return
        if spec.include_usage:
            c = self._base(group)
            c["choices"] = []
            c["usage"] = usage_openai(group.usage)
            yield sse.data(c)
        yield sse.DONE

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
                    yield self._chunk(run, ev.text, None, iu, lp)
                yield sse.data(error_of(ev).openai_body())
                return False
            if ev.text or ev.finish_reason or (want_lp and ev.token_ids):
                yield self._chunk(
                    run, ev.text, _finish(ev.finish_reason, False) if ev.finish_reason else None, iu, lp
                )
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


class Models:
    def __init__(self, state: AppState):
        self.state = state

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
