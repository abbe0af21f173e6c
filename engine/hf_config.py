"""Read values from a Hugging Face ``config.json`` in every form transformers writes them.

- dotted paths (``rope_parameters.rope_theta``), also under ``text_config`` / ``llm_config``;
- transformers 5 ``rope_parameters`` (flat, or keyed by layer type such as ``full_attention``) and the
  transformers 4 ``rope_theta`` + ``rope_scaling`` form: a dim lists every path (``hf: [a, b]``) and
  paths that are present must agree, so either form gives the same model;
- a per-layer-type mapping is read through the layer types the model uses (``layer_types``), which
  must all share one value unless the path names the type;
- ``check_expected``: config keys that change the math must hold a value the family implements
  (``hf_expect:`` in models/*.yaml), so an unsupported feature is an error, never a silent default.

Pure Python: must not import numpy, CUDA or the graph/model modules.
"""

from __future__ import annotations

from typing import Any

from engine.types import MemraError

_NESTED = ("text_config", "llm_config")
#: Keys of a per-layer-type mapping (transformers' ``layer_types`` vocabulary).
LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "linear_attention", "hybrid", "mamba"}
)
_MISSING = object()


def _top(meta: dict, key: str) -> Any:
    if key in meta:
        return meta[key]
    for sub in _NESTED:
        inner = meta.get(sub)
        if isinstance(inner, dict) and key in inner:
            return inner[key]
    return _MISSING


def _per_layer_type(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and set(value) <= LAYER_TYPES
        and all(isinstance(v, dict) for v in value.values())
    )


def _used_layer_types(meta: dict) -> set[str] | None:
    lt = _top(meta, "layer_types")
    return set(lt) if isinstance(lt, list) and lt else None


def _shared(value: dict, meta: dict, path: str, source: str) -> Any:
    """The one mapping a per-layer-type value holds for every layer type the model uses."""
    used = _used_layer_types(meta)
    types = sorted(t for t in value if used is None or t in used)
    if not types:
        raise MemraError(
            f"{source}: field {path!r} has no entry for the layer types {sorted(used or ())}",
            code="invalid_model",
        )
    first = value[types[0]]
    for t in types[1:]:
        if value[t] != first:
            raise MemraError(
                f"{source}: field {path!r} differs between layer types {types[0]!r} and {t!r}; "
                "this family uses one value for every layer",
                code="invalid_model",
            )
    return first


def lookup(meta: dict, path: str, source: str = "config.json") -> tuple[bool, Any]:
    """(found, value) of a dotted ``path``; per-layer-type mappings are read through the used types."""
    parts = path.split(".")
    cur = _top(meta, parts[0])
    if cur is _MISSING:
        return False, None
    done = parts[0]
    for p in parts[1:]:
        if _per_layer_type(cur) and p not in cur:
            cur = _shared(cur, meta, done, source)
        if not isinstance(cur, dict) or p not in cur:
            return False, None
        cur = cur[p]
        done = f"{done}.{p}"
    if _per_layer_type(cur):
        cur = _shared(cur, meta, path, source)
    return True, cur


def _agree(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):  # mappings: every key both give must agree
        return all(a[k] == b[k] for k in set(a) & set(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def lookup_any(meta: dict, paths: tuple[str, ...], source: str, what: str) -> tuple[bool, Any, str | None]:
    """(found, value, path) from the first of ``paths`` present (not null); every other present path
    must agree with it, else MemraError naming both (``what`` names the dim)."""
    hits = []
    for p in paths:
        found, v = lookup(meta, p, source)
        if found and v is not None:
            hits.append((p, v))
    if not hits:
        return False, None, None
    p0, v0 = hits[0]
    for p, v in hits[1:]:
        if not _agree(v0, v):
            raise MemraError(
                f"{source}: fields {p0!r} ({v0!r}) and {p!r} ({v!r}) disagree ({what})", code="invalid_model"
            )
    return True, v0, p0


def _allowed(v: Any, a: Any) -> bool:
    if isinstance(v, bool) or isinstance(a, bool) or v is None or a is None:
        return v is a
    return _agree(v, a)


def check_expected(meta: dict, expect: dict[str, tuple[Any, ...]], source: str, family: str) -> None:
    """Every ``expect`` key present in the config holds an allowed value (each element, for a list)."""
    for path, allowed in expect.items():
        found, value = lookup(meta, path, source)
        if not found or value is None:  # absent or null: the default, which every family implements
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if not any(_allowed(v, a) for a in allowed):
                raise MemraError(
                    f"{source}: field {path!r} = {value!r} changes the model in a way family {family} does "
                    f"not implement (supported: {', '.join(repr(a) for a in allowed)})",
                    code="invalid_model",
                )


def canonical_rope_scaling(value: Any) -> dict | None:
    """A ``rope_scaling`` / ``rope_parameters`` mapping in one form: ``rope_theta`` dropped (it is its
    own dim) and ``None`` for plain RoPE, so the transformers 4 and 5 forms give identical dims."""
    if not isinstance(value, dict):
        return None
    out = {k: v for k, v in value.items() if k != "rope_theta"}
    kind = out.get("rope_type", out.get("type", "default"))
    return None if kind == "default" else out
