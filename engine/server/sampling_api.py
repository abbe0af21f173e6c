"""Request fields of the sampling API (issue #39): ``logit_bias``, ``logprobs`` / ``top_logprobs``,
``response_format``, and which sampling fields a body set (the rest take the model's generation
defaults). Each bad value is a 400 naming the field. Must not import falcon, the engine loop or
engine.server.schemas (which imports this).
"""

from __future__ import annotations

import json
import math

from .errors import bad_request, type_error
from .fields import Num, get_object

MAX_N = 16
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
_TOP = Num(None, 0, MAX_TOP_LOGPROBS, integer=True)  # logprobs alternatives per token


def _invalid(param: str, message: str):
    return bad_request(message, param, "invalid_value")


def given_fields(body: dict, names) -> frozenset[str]:
    """The sampling fields ``body`` sets to a non-null value (the rest take the model's defaults)."""
    return frozenset(n for n in names if body.get(n) is not None)


def get_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI ``logit_bias``: {"token id": bias in [-100, 100]} -> sorted (id, bias) pairs."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise type_error("logit_bias", "an object mapping token ids to numbers", raw)
    if len(raw) > MAX_LOGIT_BIAS:
        raise _invalid("logit_bias", f"`logit_bias` has {len(raw)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for k, v in raw.items():
        key = str(k).strip()
        if not key.isdigit():
            raise _invalid("logit_bias", f"`logit_bias` keys must be token ids (non-negative integers), got {json.dumps(k)[:40]}")
        tok = int(key)
        p = f"logit_bias.{tok}"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise type_error(p, "a number", v)
        if not -100.0 <= v <= 100.0:
            raise _invalid(p, f"`{p}` must be between -100 and 100, got {v}")
        out[tok] = float(v)
    return tuple(sorted(out.items()))


def get_logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives to report per token (None: no logprobs). Chat: ``logprobs`` (bool)
    + ``top_logprobs`` (0..20); completions: ``logprobs`` (0..20)."""
    if not chat:
        return _TOP.read(body, "logprobs")
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise type_error("logprobs", "a boolean", on)
    top = _TOP.read(body, "top_logprobs")
    if top is not None and not on:
        raise bad_request("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return (top or 0) if on else None


def get_response_format(body: dict) -> dict | None:
    """``response_format``: None for text, else {"type": "json_object"} or {"type": "json_schema",
    "schema": {...}, "strict": bool}."""
    rf = get_object(body, "response_format")
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise type_error("response_format.json_schema", "an object", js)
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise type_error("response_format.json_schema.schema", "an object", schema)
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > 256):
            raise type_error("response_format.json_schema.name", "a string of at most 256 characters", name)
        return {"type": "json_schema", "schema": schema, "strict": bool(js.get("strict", False))}
    raise _invalid("response_format.type", "`response_format.type` must be text, json_object or json_schema")
