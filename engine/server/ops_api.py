"""Operational resources: /health, /ready, /metrics, /admin/kv, /tokenize, /detokenize.

Must not import the engine loop.
"""

from __future__ import annotations

import falcon

from .errors import ApiError, bad_request
from .fields import get_bool, get_str
from .generation import cache_scope, chat_ids, text_ids
from .http_common import Resource, read_json, send_json
from .metrics import CONTENT_TYPE
from .schemas import parse_chat
from .state import AppState


class Health(Resource):
    """200 while the engine runs; 503 while loading, after a failed load or when the engine died."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        if st.engine is None:
            if st.load_error:
                send_json(resp, {"status": "error", "error": st.load_error}, 503)
            else:
                send_json(resp, {"status": "loading"}, 503)
        elif not st.alive:
            send_json(resp, {"status": "dead"}, 503)
        else:
            send_json(resp, {"status": "draining" if st.draining else "ok"})


class Ready(Resource):
    """200 only when new requests are accepted (loaded, alive, not draining)."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        if st.loaded and st.alive and not st.draining:
            send_json(resp, {"status": "ready", "model": st.model_info.id})
        else:
            status = "draining" if st.draining else ("loading" if not st.loaded else "dead")
            resp.set_header("Retry-After", str(st.config.retry_after_s))
            send_json(resp, {"status": status}, 503)


def _stats(state: AppState):
    if state.engine is None:
        return None
    try:
        return state.engine.stats()
    except Exception:
        return None


class MetricsResource(Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        resp.content_type = CONTENT_TYPE
        resp.text = st.metrics.render(_stats(st), alive=st.alive, draining=st.draining)


class AdminKV(Resource):
    """KV block accounting plus engine.check_invariants(); 500 when the invariants fail."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        if st.engine is None:
            raise ApiError(503, "model is still loading", code="loading", err_type="server_error")
        s = _stats(st)
        fields = (
            "running",
            "waiting",
            "kv_blocks_total",
            "kv_blocks_free",
            "kv_blocks_cached",
            "prefix_query_tokens",
            "prefix_hit_tokens",
            "preemptions",
        )
        out: dict = {f: getattr(s, f, None) for f in fields}
        total, free, cached = (
            out["kv_blocks_total"] or 0,
            out["kv_blocks_free"] or 0,
            out["kv_blocks_cached"] or 0,
        )
        # blocks owned by sequences; cached prefix blocks with no owner are reusable, not in use
        out["kv_blocks_used"] = getattr(s, "kv_blocks_used", total - free - cached) if total else None
        try:
            st.engine.check_invariants()
            out["invariants_ok"] = True
            send_json(resp, out)
        except AssertionError as exc:
            out["invariants_ok"] = False
            out["invariant_error"] = str(exc) or "AssertionError"
            send_json(resp, out, 500)


class Tokenize(Resource):
    """POST {"prompt": str} or {"messages": [...]} (chat template applied) -> token ids."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready()
        body = read_json(req, st)
        tenant = req.context.tenant  # tokenised in its cache scope, as its generations are
        if "messages" in body:
            ids = chat_ids(st, parse_chat(body), tenant)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("`prompt` (string) or `messages` is required", "prompt")
            special = get_bool(body, "add_special_tokens", False)
            scope = cache_scope(tenant, get_str(body, "cache_salt", "", max_len=256) or "")
            ids = text_ids(st, prompt, scope, "prompt", add_special_tokens=special)
        send_json(resp, {"tokens": ids, "count": len(ids), "max_model_len": st.model_info.context_length})


class Detokenize(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        st = self.state
        st.require_ready(admit=False)
        body = read_json(req, st)
        toks = body.get("tokens")
        vocab = int(getattr(st.tokenizer, "vocab_size", 1 << 31))
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise bad_request("`tokens` must be a list of integers", "tokens")
        if any(t < 0 or t >= vocab for t in toks):
            raise bad_request(f"`tokens` entries must be in 0..{vocab - 1}", "tokens")
        send_json(resp, {"prompt": st.tokenizer.decode(toks)})
