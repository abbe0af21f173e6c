"""HTTP API errors and their OpenAI / Anthropic JSON shapes.

Must not import falcon resources or the engine; only engine.types.
"""

from __future__ import annotations

import json
from typing import Any

from engine.types import MemraError

# MemraError.code -> (HTTP status, OpenAI error type, Anthropic error type)
_CODE_MAP: dict[str, tuple[int, str, str]] = {
    "context_length_exceeded": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_request_error": (400, "invalid_request_error", "invalid_request_error"),
    "unsupported_parameter": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_type": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_value": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error", "authentication_error"),
    "model_not_found": (404, "invalid_request_error", "not_found_error"),
    "not_found": (404, "invalid_request_error", "not_found_error"),
    "request_too_large": (413, "invalid_request_error", "request_too_large"),
    "overloaded": (429, "rate_limit_error", "rate_limit_error"),
    "tenant_limit": (429, "rate_limit_error", "rate_limit_error"),
    "rate_limited": (429, "rate_limit_error", "rate_limit_error"),
    "draining": (503, "server_error", "overloaded_error"),
    "loading": (503, "server_error", "overloaded_error"),
    "engine_dead": (503, "server_error", "api_error"),
}


class ApiError(Exception):
    """An error answered as an HTTP status with an error body; ``headers`` are added to the response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        err_type: str = "invalid_request_error",
        anthropic_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.err_type = err_type
        self.anthropic_type = anthropic_type
        self.headers = dict(headers or {})

    def openai_body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}
        }

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The body in the shape of the API ``path`` belongs to (Anthropic's under /v1/messages)."""
        return self.anthropic_body() if (path or "").startswith("/v1/messages") else self.openai_body()


def bad_request(message: str, param: str | None = None, code: str = "invalid_request_error") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def engine_error(message: str) -> ApiError:
    """A 500: the engine (or the server) failed the request."""
    return ApiError(500, message, code="engine_error", err_type="server_error", anthropic_type="api_error")


def type_error(param: str, expected: str, value: Any) -> ApiError:
    """A request field of the wrong type: names the field, what it must be and (briefly) what it was."""
    shown = json.dumps(value)[:60] if not isinstance(value, (dict, list)) else type(value).__name__
    return bad_request(f"`{param}` must be {expected}, got {shown}", param, "invalid_type")


def from_memra(err: MemraError, *, retry_after_s: int = 1) -> ApiError:
    """Map an engine MemraError to an ApiError (unknown codes are 500 engine errors)."""
    status, otype, atype = _CODE_MAP.get(err.code, (500, "server_error", "api_error"))
    headers = {}
    if status in (429, 503):
        headers["Retry-After"] = str(retry_after_s)
    return ApiError(
        status,
        err.message,
        code=err.code,
        param=err.param,
        err_type=otype,
        anthropic_type=atype,
        headers=headers,
    )


def from_code(code: str, message: str, param: str | None = None) -> ApiError:
    return from_memra(MemraError(message, code=code, param=param))
