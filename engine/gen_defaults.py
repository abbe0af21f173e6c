"""A model's own sampling defaults: generation_config.json (safetensors) or GGUF ``general.sampling.*``.

The server applies them to every request that omits the parameter (vLLM's ``--generation-config
auto``); ``memra serve --generation-config none`` turns that off. Only the keys below are read;
``do_sample`` is ignored, as vLLM does. Must not import CUDA or the server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from engine.types import SamplingParams

# generation_config.json key -> SamplingParams field
_HF = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# GGUF general.sampling.* key -> SamplingParams field
_GGUF = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _value(name: str, v: Any) -> float | int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v) if name == "top_k" else float(v)


def model_generation_defaults(metadata: Mapping[str, Any]) -> dict[str, float | int]:
    """SamplingParams field -> value the model's files ask for (empty when they say nothing).

    ``metadata`` is a WeightSource's: config.json with ``_generation_config`` for a safetensors
    directory, the GGUF key/value metadata for a GGUF file. Values that are not finite numbers
    (or out of SamplingParams' ranges) are skipped.
    """
    out: dict[str, float | int] = {}
    gen = metadata.get("_generation_config")
    pairs = []
    if isinstance(gen, Mapping):
        pairs += [(field, gen.get(key)) for key, field in _HF.items()]
    for key, field in _GGUF.items():
        if key in metadata:
            try:
                pairs.append((field, metadata[key]))
            except Exception:  # an undecodable GGUF value: treat as absent
                continue
    for field, raw in pairs:
        v = _value(field, raw)
        if v is not None:
            out[field] = v
    from engine.sampling import validate_sampling  # lazy: numpy only when defaults are read

    for name in list(out):
        try:
            validate_sampling(replace(SamplingParams(), **{name: out[name]}))
        except Exception:
            del out[name]
    return out


def with_defaults(params: SamplingParams, given: frozenset[str], defaults: Mapping[str, Any]) -> SamplingParams:
    """``params`` with each default applied to a field the request did not set (``given``)."""
    known = {f.name for f in fields(SamplingParams)}
    fill = {k: v for k, v in defaults.items() if k in known and k not in given}
    return replace(params, **fill) if fill else params
