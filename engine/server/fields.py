"""Readers of one request-body field: a number in a range (``Num``, so a field's range is data), a
boolean, an object, a bounded string, a stop list. A bad value is a 400 naming the field, in the same words for
every API. Must not import falcon, the engine loop or the request parsers (they import this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import bad_request, type_error

MAX_STOP = 16
MAX_STOP_LEN = 512
MISSING = object()


@dataclass(frozen=True)
class Num:
    """A numeric field: its value when absent or null, its range (``lo`` excluded when ``lo_open``)."""

    default: Any
    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False

    def read(self, body: dict, p: str):
        v = body.get(p, MISSING)
        if v is MISSING or v is None:
            return self.default
        kind = "an integer" if self.integer else "a number"
        if self.integer and isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            raise type_error(p, kind, v)
        if v < self.lo or v > self.hi or (self.lo_open and v == self.lo):
            lo_s = f"> {self.lo}" if self.lo_open else f">= {self.lo}"
            raise bad_request(f"`{p}` must be {kind} {lo_s} and <= {self.hi}, got {v}", p, "invalid_value")
        return int(v) if self.integer else float(v)


TOKENS = Num(None, 1, 1 << 31, integer=True)  # a token count (max_tokens and its aliases)


def get_bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    v = body.get(name, MISSING)
    if v is MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise type_error(prefix + name, "a boolean", v)
    return v


def get_object(body: dict, name: str) -> dict | None:
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise type_error(name, "an object", v)
    return v


def get_str(body: dict, name: str, default: str | None, *, max_len: int = 1024) -> str | None:
    v = body.get(name, MISSING)
    if v is MISSING or v is None:
        return default
    if not isinstance(v, str):
        raise type_error(name, "a string", v)
    if len(v) > max_len:
        raise bad_request(f"`{name}` is longer than {max_len} characters", name, "invalid_value")
    return v


def get_stop(body: dict, name: str) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise type_error(name, "a string or a list of strings", v)
    if len(v) > MAX_STOP:
        raise bad_request(f"`{name}` has {len(v)} entries; at most {MAX_STOP} allowed", name, "invalid_value")
    for s in v:
        if not s or len(s) > MAX_STOP_LEN:
            raise bad_request(f"`{name}` entries must be 1..{MAX_STOP_LEN} characters", name, "invalid_value")
    return list(dict.fromkeys(v))
