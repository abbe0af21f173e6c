"""The op vocabulary's building blocks: OpDef (arity rules of a YAML op), the reference-step context,
and the registry every op module registers into.

An op module (``engine/ops/<family>.py``) calls ``define(name, OpDef(...), reference_fn)`` once per op
at import; ``engine.ops`` imports every module of the package, so adding an op needs no edit
anywhere else. Must not import ``engine.graph`` (graph imports the vocabulary from here), CUDA, or
anything above the DSL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class OpDef:
    """Arity rules for one op: how many inputs/outputs/weights and which attributes it takes (what it
    computes: docs/dsl.md's op table)."""

    inputs: int | None  # None: any number >= 1
    outputs: int | None  # None: same as the number of weights
    weights: tuple[int, int]  # (min, max)
    attrs: dict[str, str] = field(default_factory=dict)  # attr -> "value" | "tensor" | "dim"
    # Recurrent state the op keeps per sequence (hybrid families): dims -> the state's shape, one
    # float32 array of that shape per layer the op runs in and per state slot (engine.reference).
    state: Callable[[dict[str, Any]], tuple[int, ...]] | None = None
    weight_counts: tuple[int, ...] = ()  # when set, the only weight counts allowed within (min, max)


@dataclass
class RefStep:
    """What a reference op sees while one item's tokens run through the graph.

    ``runner`` is the ``engine.reference.ReferenceRunner`` (dims, weights, rope tables);
    ``env`` maps value names to arrays [tokens, width]; positions run ``start_pos ..
    start_pos + tokens``; the KV caches are [layers, blocks, block_size, kv_heads, head_dim].
    ``all_logits`` false means only the last position's logits are needed.
    """

    runner: Any
    env: dict[str, np.ndarray]
    start_pos: int
    block_table: Sequence[int]
    k_cache: np.ndarray
    v_cache: np.ndarray
    all_logits: bool
    # Recurrent state (ops with an OpDef.state): (op name, layer) -> [slots, *shape] float32; the
    # item's sequence owns ``slot``; ``snapshots`` are (n, slot): also store the state after the
    # item's first n tokens into that slot (prefix-cache snapshots at block boundaries).
    states: dict[tuple[str, int], np.ndarray] | None = None
    slot: int = 0
    snapshots: Sequence[tuple[int, int]] = ()
    # A sliding-window KV pool (engine.kv_groups): the window layers' caches and the item's table
    # into them; None: the window layers use ``k_cache`` / ``block_table`` like the others.
    window_table: Sequence[int] | None = None
    k_window: np.ndarray | None = None
    v_window: np.ndarray | None = None

    def state(self, op: Any, layer: int) -> np.ndarray:
        """The live state array of ``op`` at ``layer`` for this item's sequence (a view: write it)."""
        if self.states is None:
            raise RuntimeError(f"op {op.op} keeps recurrent state but the runner gave none")
        return self.states[(op.op, layer)][self.slot]

    def save_snapshot(self, op: Any, layer: int, slot: int, value: np.ndarray) -> None:
        """Store ``op``'s state at ``layer`` into snapshot slot ``slot``."""
        assert self.states is not None
        self.states[(op.op, layer)][slot] = value

    @property
    def positions(self) -> slice:
        n = len(self.env["tokens"])
        return slice(self.start_pos, self.start_pos + n)

    def weight(self, name: str, layer: int | None) -> np.ndarray:
        return self.runner.weight(name, layer)

    def attr_dim(self, op: Any, attr: str, default: Any = None) -> Any:
        """The value of the dim that ``op``'s attribute ``attr`` names, or ``default`` when unset."""
        name = op.attrs.get(attr)
        return default if name is None else self.runner.model.dims[name]


# ReferenceRunner.rope_tables' default scaling: the model's rope_scaling dim (None means no scaling)
MODEL_SCALING: Any = object()

# (step, op, layer) -> None: reads op.inputs from step.env and writes op.outputs into it.
ReferenceFn = Callable[[RefStep, Any, "int | None"], None]

OPS: dict[str, OpDef] = {}
REFERENCE: dict[str, ReferenceFn] = {}


def define(name: str, opdef: OpDef, reference: ReferenceFn) -> None:
    """Register op ``name``: its arity rules and its numpy reference implementation."""
    if name in OPS:
        raise ValueError(f"op {name!r} is defined twice")
    OPS[name] = opdef
    REFERENCE[name] = reference
