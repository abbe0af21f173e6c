"""A small declarative validator for memra's YAML/TOML files, with errors naming file and key path.

A schema is a nested dict of ``Field``s. ``validate(data, schema, file)`` returns the data with
defaults filled in, or raises ConfigError("models/llama.yaml: dims.hidden.hf: expected str, got int").
Unknown keys are errors (with a did-you-mean hint). Must not import CUDA or numpy.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.types import ConfigError

_MISSING = object()


@dataclass(frozen=True)
class Field:
    """One key: ``kind`` is a type, a tuple of types, a nested schema dict, ``ListOf``, ``MapOf`` or ``OneOf``."""

    kind: Any
    required: bool = False
    default: Any = _MISSING
    check: Callable[[Any], str | None] | None = None  # returns an error text or None


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class MapOf:
    """A mapping with free-form keys (names chosen by the author) and values of one kind."""

    value: Any


@dataclass(frozen=True)
class OneOf:
    choices: tuple


def _type_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_type_name(k) for k in kind)
    if isinstance(kind, dict):
        return "mapping"
    if isinstance(kind, ListOf):
        return f"list of {_type_name(kind.item)}"
    if isinstance(kind, MapOf):
        return f"mapping of {_type_name(kind.value)}"
    if isinstance(kind, OneOf):
        return "one of " + ", ".join(repr(c) for c in kind.choices)
    return {
        str: "string",
        int: "integer",
        float: "number",
        bool: "true/false",
        dict: "mapping",
        list: "list",
    }.get(kind, getattr(kind, "__name__", str(kind)))


def _got(value: Any) -> str:
    return (
        f"{type(value).__name__} {value!r}" if not isinstance(value, (dict, list)) else type(value).__name__
    )


def fail(file: str | Path, path: str, message: str) -> ConfigError:
    return ConfigError(f"{file}: {path or '<top>'}: {message}")


def _check(value: Any, kind: Any, file: str, path: str) -> Any:
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise fail(file, path, f"expected a mapping, got {_got(value)}")
        return validate(value, kind, file, path)
    if isinstance(kind, ListOf):
        if not isinstance(value, list):
            raise fail(file, path, f"expected {_type_name(kind)}, got {_got(value)}")
        return [_check(v, kind.item, file, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(kind, MapOf):
        if not isinstance(value, dict):
            raise fail(file, path, f"expected {_type_name(kind)}, got {_got(value)}")
        return {k: _check(v, kind.value, file, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(kind, OneOf):
        if value not in kind.choices:
            raise fail(file, path, f"expected {_type_name(kind)}, got {_got(value)}")
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise fail(file, path, f"expected {_type_name(kind)}, got {_got(value)}")
    return value


def validate(data: dict, schema: dict[str, Field], file: str | Path, path: str = "") -> dict:
    file = str(file)
    out: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in schema:
            close = difflib.get_close_matches(str(key), [str(k) for k in schema], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(file, sub, f"unknown key{hint}; expected one of: {', '.join(schema)}")
        spec = schema[key]
        checked = _check(value, spec.kind, file, sub)
        if spec.check is not None:
            problem = spec.check(checked)
            if problem:
                raise fail(file, sub, problem)
        out[key] = checked
    for key, spec in schema.items():
        if key in out:
            continue
        if spec.required:
            raise fail(file, f"{path}.{key}" if path else key, "required key is missing")
        if spec.default is not _MISSING:
            out[key] = spec.default
    return out


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(file: Path) -> dict:
    """Parse a YAML mapping; a syntax error or a non-mapping top level is a ConfigError naming the file."""
    try:
        text = Path(file).read_text()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}") from exc
    try:  # libyaml where present: a start parses every device profile and model family file
        data = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError:
        try:  # the pure-Python parser words the error (line, column, problem)
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{file}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a mapping at the top level, got {type(data).__name__}")
    return data
