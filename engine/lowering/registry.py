"""The op registry: each YAML op's lowering unit registers here under the op's name.

A unit (a module of engine.lowering) calls ``register("rope", bind=..., short=True)`` on its
``lower`` function; ``engine.lowering`` imports every unit module, so a new one is found without an
edit anywhere else. ``post_pass`` registers a whole-plan pass (a fusion across steps, an L2
prefetch) run after every step is lowered, in ``order``. Imports only engine.ir. Must not import
CUDA or numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.ir import WIDE

# lower(ctx, op, layer, mode, ins, outs, ws) -> list[Launch]
Lower = Callable[..., list]
# bind(op, ws, ins, dims, value_for) -> list[Value]: the op's output values
Bind = Callable[..., list]


@dataclass(frozen=True)
class OpLowering:
    """How one graph op becomes launches. ``short``: the op has its own short-context decode
    launches (direct attention, the rope folded into it); ``wide``: the mode whose lowering serves
    wide decode buckets (WIDE itself, or "prefill" where the op's output is materialised as in
    prefill for the GEMMs that read it)."""

    op: str
    lower: Lower
    bind: Bind
    short: bool = False
    wide: str = WIDE
    attrs: frozenset[str] = frozenset()  # the op attributes this unit implements


LOWERINGS: dict[str, OpLowering] = {}
POST_PASSES: list[tuple[int, Callable[..., None]]] = []


def register(
    op: str, *, bind: Bind, short: bool = False, wide: str = WIDE, attrs: tuple[str, ...] = ()
) -> Callable[[Lower], Lower]:
    """``attrs``: the op attributes the unit implements; a graph op with any other is rejected
    (``lowering_for``) rather than lowered with that attribute silently ignored."""

    def deco(fn: Lower) -> Lower:
        if op in LOWERINGS:
            raise ValueError(f"op {op!r} is lowered twice ({LOWERINGS[op].lower.__module__}, {fn.__module__})")
        LOWERINGS[op] = OpLowering(op, fn, bind, short, wide, frozenset(attrs))
        return fn

    return deco


def post_pass(order: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``fn(ctx, steps, weights, values)``, run after lowering in ascending ``order``."""

    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        POST_PASSES.append((order, fn))
        POST_PASSES.sort(key=lambda p: p[0])
        return fn

    return deco


def lowering_for(op: str, attrs: Any = ()) -> OpLowering:
    """The unit lowering op ``op``; ``attrs`` (the graph op's attribute names) must all be ones it
    implements."""
    from engine.types import ConfigError

    if op not in LOWERINGS:
        raise ConfigError(f"plan: op {op!r} has no CUDA lowering (known: {', '.join(sorted(LOWERINGS))})")
    unit = LOWERINGS[op]
    for attr in attrs:
        if attr not in unit.attrs:
            raise ConfigError(
                f"plan: no CUDA lowering for attribute {attr!r} of op {op!r} (the reference backend runs it; "
                f"the CUDA unit implements: {', '.join(sorted(unit.attrs)) or 'no attributes'})"
            )
    return unit


def same_width(op: Any, ws: list, ins: list, dims: Any, value_for: Callable) -> list:
    """The common binding: one output as wide as the first input."""
    return [value_for(op.outputs[0], ins[0].width)]
