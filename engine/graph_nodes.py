"""The model-family DSL's node types: dims, tensors, ops, per-layer choices, repeats, quant combos.

Plain frozen dataclasses shared by ``engine.graph`` (which builds them from YAML) and
``engine.graph_flow`` (which parses and checks the op list). Must not import numpy or CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.ops import OPS
from engine.types import ConfigError

GRAPH_INPUTS = ("tokens",)
GRAPH_OUTPUT = "logits"


@dataclass(frozen=True)
class DimSpec:
    name: str
    hf: str | None = None
    gguf: str | None = None
    default: Any = None
    has_default: bool = False
    type: str = "int"
    expr: str | None = None
    from_tensor: tuple[str, int] | None = None
    gguf_from_missing: str | None = None  # GGUF: true when this tensor is absent (tied head)
    per_format: dict[str, Any] | None = None  # a constant per source format ({hf: .., gguf: ..})
    # type list: layer i is `every` when (i + 1) % interval == 0, else `other` (HF's and llama.cpp's
    # full_attention_interval rule), used when the file gives no explicit list
    pattern: dict[str, str] | None = None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    hf: str | None
    gguf: str | None
    kind: str
    shape: tuple[str, ...] | None
    tied_to: str | None
    optional: bool
    transform: dict[str, str] = field(default_factory=dict)  # format -> TENSOR_TRANSFORMS name
    shapes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per-format shape overrides
    layers: str = "layers"  # the dim counting this per-layer tensor's layers (mtp_layers...)

    @property
    def per_layer(self) -> bool:
        return "{i}" in (self.hf or "") or "{i}" in (self.gguf or "")

    def shape_for(self, fmt: str) -> tuple[str, ...] | None:
        return self.shapes.get(fmt, self.shape)

    def pattern(self, fmt: str) -> str | None:
        return self.hf if fmt == "hf" else self.gguf

    def file_name(self, fmt: str, layer: int | None = None) -> str | None:
        pat = self.pattern(fmt)
        if pat is None:
            return None
        return pat.replace("{i}", str(layer)) if self.per_layer else pat


@dataclass(frozen=True)
class Op:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    attrs: dict[str, str] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.op, self.inputs, self.outputs, self.weights, tuple(sorted(self.attrs.items()))))


@dataclass(frozen=True)
class Choose:
    """A per-layer choice inside a repeat: layer i runs ``cases[dims[dim][i]]`` (hybrid families)."""

    dim: str  # a list dim with one block-type name per layer
    cases: dict[str, tuple[Op, ...]]

    def __hash__(self) -> int:
        return hash((self.dim, tuple(self.cases.items())))


@dataclass(frozen=True)
class Repeat:
    count: str  # a dim name
    body: tuple[Op | Choose, ...]

    def layer_ops(self, kind: str | None) -> tuple[Op, ...]:
        """The body's ops for one layer whose block type is ``kind`` (None: no choice in the body)."""
        out: list[Op] = []
        for node in self.body:
            if isinstance(node, Choose):
                if kind not in node.cases:
                    raise ConfigError(f"block type {kind!r} is not one of {', '.join(node.cases)}")
                out.extend(node.cases[kind])
            else:
                out.append(node)
        return tuple(out)


@dataclass(frozen=True)
class QuantCombo:
    name: str
    default: tuple[str, ...]
    per_tensor: dict[str, tuple[str, ...]]

    def allowed(self, tensor: str) -> tuple[str, ...]:
        return self.per_tensor.get(tensor, self.default)

    def describe(self) -> str:
        extra = ", ".join(f"{k}: {'|'.join(v)}" for k, v in self.per_tensor.items())
        return f"{self.name} (default {'|'.join(self.default)}{'; ' + extra if extra else ''})"




def op_tensors(op: Op) -> list[str]:
    """The tensors an op reads: its weights and its tensor-valued attributes."""
    names = list(op.weights)
    names += [v for k, v in op.attrs.items() if OPS[op.op].attrs.get(k) == "tensor"]
    return names
