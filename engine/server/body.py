"""Read a JSON request body under limits: size, UTF-8, nesting depth, number size, no NaN/Infinity.

Must not import the engine; raises errors.ApiError only.
"""

from __future__ import annotations

import json
import math

from .errors import ApiError, bad_request

MAX_INT_DIGITS = 40


def too_large(limit: int) -> ApiError:
    """The 413 of a body over ``limit`` bytes (announced by Content-Length, or read)."""
    return ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large", anthropic_type="request_too_large")


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer with {len(s)} digits is too large")
    return int(s)


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:32]} is out of range")
    return v


def _parse_constant(s: str) -> float:
    raise ValueError(f"{s} is not valid JSON")


def _check(value: object, max_depth: int) -> None:
    """Iteratively check nesting depth and that strings are encodable UTF-8 (no lone surrogates)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > max_depth:
                raise bad_request(f"JSON nesting deeper than {max_depth} levels", code="invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    stack.append((k, d))
                stack.append((x, d + 1))
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(
                    "string contains an invalid unicode escape (lone surrogate)", code="invalid_json"
                ) from None


def parse_json_body(raw: bytes, *, max_bytes: int, max_depth: int) -> dict:
    """Decode ``raw`` into a JSON object. Raises ApiError 413/400 naming the problem."""
    if len(raw) > max_bytes:
        raise too_large(max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_json"
        ) from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
        )
    except RecursionError:
        raise bad_request(f"JSON nesting deeper than {max_depth} levels", code="invalid_json") from None
    except ValueError as exc:
        raise bad_request(f"invalid JSON body: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    _check(data, max_depth)
    return data
