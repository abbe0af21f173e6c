"""Build the Falcon WSGI app: routes, request-id / auth / metrics middleware, error rendering.

``create_app(engine, tokenizer, model_info, config)`` is what tests use; serve.run_server builds the
same app over an AppState that is filled in once the model has loaded. Must not import waitress.
"""

from __future__ import annotations

import logging
import re
import uuid

import falcon

from engine.server_config import ServerConfig
from engine.types import MemraError

from .anthropic_api import CountTokens, Messages
from .auth import presented_key
from .errors import ApiError, engine_error, from_memra
from .http_common import Resource, send_json
from .model_info import ModelInfo
from .openai_api import ChatCompletions, Completions, Models
from .ops_api import AdminKV, Detokenize, Health, MetricsResource, Ready, Tokenize
from .state import AppState
from .ui import ChatPage

log = logging.getLogger("memra.server")

_OPEN_PATHS = ("/health", "/ready", "/metrics", "/")
_OPEN_PREFIXES = ("/ui/",)  # the chat page's files (the page sends the user's key with its API calls)
_REQ_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _render_error(req: falcon.Request, resp: falcon.Response, err: ApiError) -> None:
    for k, v in err.headers.items():
        resp.set_header(k, v)
    send_json(resp, err.body_for(req.path), err.status)


class _Middleware(Resource):
    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        rid = req.get_header("x-request-id")
        req.context.request_id = rid if rid and _REQ_ID.match(rid) else uuid.uuid4().hex
        resp.set_header("x-request-id", req.context.request_id)
        req.context.tenant = None
        if req.path in _OPEN_PATHS or req.path.startswith(_OPEN_PREFIXES):
            return
        tenant = self.state.keyring.authenticate(
            presented_key(req.get_header("Authorization"), req.get_header("x-api-key"))
        )
        if tenant is None:
            raise ApiError(
                401,
                "Invalid or missing API key (send `Authorization: Bearer <key>` or `x-api-key`)",
                code="invalid_api_key",
                err_type="authentication_error",
                anthropic_type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        req.context.tenant = tenant

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource, req_succeeded: bool
    ) -> None:
        endpoint = getattr(req, "uri_template", None) or "unmatched"
        try:
            status = int(str(resp.status).split()[0])
        except ValueError:
            status = 0
        self.state.metrics.count_request(endpoint, status)


def build_app(state: AppState) -> falcon.App:
    """The app over ``state`` (whose engine may still be None while loading)."""
    app = falcon.App(middleware=[_Middleware(state)], cors_enable=False)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_route("/v1/chat/completions", ChatCompletions(state))
    app.add_route("/v1/completions", Completions(state))
    models = Models(state)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="one")
    app.add_route("/v1/messages", Messages(state))
    app.add_route("/v1/messages/count_tokens", CountTokens(state))
    app.add_route("/tokenize", Tokenize(state))
    app.add_route("/detokenize", Detokenize(state))
    app.add_route("/health", Health(state))
    app.add_route("/ready", Ready(state))
    app.add_route("/metrics", MetricsResource(state))
    app.add_route("/admin/kv", AdminKV(state))
    page = ChatPage()
    app.add_route("/", page)
    app.add_route("/ui/{name}", page, suffix="file")

    def api_error(req, resp, ex, params):
        if ex.status in (408, 429):  # shed load: memra_requests_rejected_total{reason}
            state.metrics.count_rejected(ex.code)
        _render_error(req, resp, ex)

    def memra_error(req, resp, ex, params):
        api_error(req, resp, from_memra(ex, retry_after_s=state.config.retry_after_s), params)

    def http_error(req, resp, ex, params):
        status = int(str(ex.status).split()[0]) if not isinstance(ex.status, int) else ex.status
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request_error")
        msg = ex.title or "error"
        if ex.description:
            msg = f"{msg}: {ex.description}"
        if status == 404:
            msg = f"no route {req.method} {req.path}"
        _render_error(
            req,
            resp,
            ApiError(
                status,
                msg,
                code=code,
                err_type="invalid_request_error",
                anthropic_type="not_found_error" if status == 404 else "invalid_request_error",
                headers=dict(ex.headers or {}),
            ),
        )

    def unexpected(req, resp, ex, params):
        log.exception("unhandled error on %s %s", req.method, req.path)
        _render_error(req, resp, engine_error(f"internal server error ({type(ex).__name__})"))

    app.add_error_handler(Exception, unexpected)
    app.add_error_handler(falcon.HTTPError, http_error)
    app.add_error_handler(MemraError, memra_error)
    app.add_error_handler(ApiError, api_error)
    return app


def create_app(engine, tokenizer, model_info: ModelInfo, config: ServerConfig | None = None) -> falcon.App:
    """A ready app over an already-loaded engine (tests, embedding)."""
    state = AppState(config or ServerConfig(), engine, tokenizer, model_info)
    app = build_app(state)
    _STATES[id(app)] = state
    return app


_STATES: dict[int, AppState] = {}


def app_state(app: falcon.App) -> AppState:
    """The AppState behind an app made by create_app (tests use it to flip draining, read counts)."""
    return _STATES[id(app)]
