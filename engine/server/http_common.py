"""Helpers shared by the resources: body reading under limits, disconnect probe, JSON responses, and
GenerateResource (the POST of every generating endpoint: parse, prompt, submit the choices, answer).

Must not import the engine loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import falcon

from engine.types import TokenEvent

from . import sse
from .auth import Tenant
from .body import parse_json_body, too_large
from .generation import Run, RunGroup, chat_ids, check_model, constraint_factory, error_of
from .state import AppState


def read_json(req: falcon.Request, state: AppState) -> dict:
    limit = state.config.max_body_bytes
    if req.content_length is not None and req.content_length > limit:
        raise too_large(limit)
    raw = req.bounded_stream.read(limit + 1)
    return parse_json_body(raw, max_bytes=limit, max_depth=state.config.max_json_depth)


def disconnect_probe(req: falcon.Request) -> Callable[[], bool] | None:
    """waitress (with channel_request_lookahead > 0) exposes a client-disconnected check."""
    fn = req.env.get("waitress.client_disconnected")
    return fn if callable(fn) else None


def send_json(resp: falcon.Response, obj: dict, status: int = 200) -> None:
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json.dumps(obj, ensure_ascii=False).encode()


def start_sse(resp: falcon.Response) -> None:
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")


def finished_text(run: Run) -> tuple[str, TokenEvent] | None:
    """A finished run's whole text and its last event; None when the client went away before any
    event came. A run that ended in an error or abort raises that run's ApiError."""
    parts: list[str] = []
    last = None
    for ev in run.events():
        if ev is not None:
            parts.append(ev.text)
            last = ev
    if last is None:
        return None
    if last.finish_reason in ("error", "abort"):
        raise error_of(last)
    return "".join(parts), last


def usage_openai(u) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def start_group(
    state: AppState,
    req: falcon.Request,
    spec,
    ids: list[int],
    *,
    param: str,
    id_prefix: str,
    constraint: Callable | None = None,
) -> RunGroup:
    """Submit ``spec.n`` choices of ``ids`` on behalf of the request's tenant: choice 0 first, the
    others once its prompt is prefilled (they then share its KV blocks through the prefix cache).
    ``constraint()`` makes each choice's TokenConstraint (engine.grammar). The caller must close()
    the group; a failed submit closes what was started."""
    if spec.n > 1:  # every choice holds a slot: refuse now rather than after choice 0's prefill
        state.admission.check_room(req.context.tenant, spec.n)
    runs: list[Run] = []
    try:
        for i in range(max(1, spec.n)):
            run = Run(
                state,
                req.context.tenant,
                spec,
                ids,
                param=param,
                disconnected=disconnect_probe(req),
                id_prefix=id_prefix,
                index=i,
                response_id=runs[0].id if runs else None,
            )
            if constraint is not None:
                run.constraint = constraint()
            run.submit()  # a run is closed (its slot released) only once it was submitted
            runs.append(run)
            if i == 0 and spec.n > 1:
                run.wait_first()
    except BaseException:
        for r in runs:
            r.close()
        raise
    return RunGroup(runs)


class Resource:
    """A resource (or middleware) of the server app: it holds the shared AppState."""

    def __init__(self, state: AppState):
        self.state = state


class GenerateResource(Resource):
    """A generating endpoint's POST: the body parsed (``parse``), the model checked, the prompt's
    token ids (``prompt_ids``), the choices submitted, then an SSE answer (``_stream(group, spec)``,
    mid-stream errors rendered by ``stream_error``) or a JSON one (``_body``) once every choice finished."""

    parse: Callable[[dict], Any]
    param = "messages"  # the field a prompt error names
    id_prefix = ""
    stream_error: Callable[[BaseException], bytes] = staticmethod(sse.openai_stream_error)

    def prompt_ids(self, spec, tenant: Tenant) -> list[int]:
        """``spec``'s prompt ids, tokenised in ``tenant``'s cache scope."""
        return chat_ids(self.state, spec, tenant)  # sets spec.prompt_text (reasoning split, grammar phases)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        spec = self.parse(read_json(req, st))
        check_model(st, spec.model)
        ids = self.prompt_ids(spec, req.context.tenant)
        constraint = constraint_factory(st, spec)
        group = start_group(st, req, spec, ids, param=self.param, id_prefix=self.id_prefix, constraint=constraint)
        if spec.stream:  # the group is closed when the stream ends or the client goes away
            start_sse(resp)
            resp.stream = sse.ClosingStream(self._stream(group, spec), group.close, self.stream_error)
            return
        try:
            self._complete(group, spec, resp)
        finally:
            group.close()

    def _stream(self, group: RunGroup, spec) -> Iterator[bytes]:
        raise NotImplementedError

    def _body(self, group: RunGroup, spec, done: list[tuple[Run, str, TokenEvent]]) -> dict:
        """The JSON answer from each choice's (run, whole text, last event)."""
        raise NotImplementedError

    def _complete(self, group: RunGroup, spec, resp: falcon.Response) -> None:
        done = []
        for run in group.runs:
            text = finished_text(run)
            if text is None:  # the client went away
                resp.status = falcon.code_to_http_status(499)
                return
            done.append((run, *text))
        send_json(resp, self._body(group, spec, done))
