"""Device memory of a model's weights: bytes per tensor group for a quant, and the fit check.

A MoE model keeps every expert of every sparse layer on the device (any token may route to any
expert), so its weight bytes are those of the whole file, though a decode step reads only the
chosen experts. ``weight_bytes(...)`` counts them from the family graph and dims alone (no file
needed: a named size and a quant combo suffice, as for warmup), per group: ``experts`` (stacked
tensors), ``dense`` (every other matrix), ``embedding`` and ``vectors`` (norms, f32).
``tensor_bytes(...)`` lists the same per tensor and layer (engine.placement splits them across
devices). ``plan_weight_bytes(plan, graph)`` groups a CUDA plan's allocations the same way (what the runner
uploads); ``check_fits(...)`` turns "needed > free" into one clear MemraError. The CUDA runner calls
them before it allocates anything.

Must not import CUDA (the caller passes the free byte count) or anything above engine.model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from engine import storage
from engine.dsl_expr import evaluate
from engine.graph import ModelGraph, QuantCombo
from engine.types import MemraError

GIB = 1 << 30


@dataclass(frozen=True)
class WeightBytes:
    """Device bytes of a model's weights, by group (``total`` is their sum)."""

    experts: int
    dense: int
    embedding: int
    vectors: int

    @property
    def total(self) -> int:
        return self.experts + self.dense + self.embedding + self.vectors

    def describe(self) -> str:
        parts = [(n, getattr(self, n)) for n in ("experts", "dense", "embedding", "vectors")]
        return ", ".join(f"{n} {b / GIB:.2f} GiB" for n, b in parts if b)


@dataclass(frozen=True)
class TensorBytes:
    """One weight on the device: family key, layer (None: not per layer), shape, storage layout,
    group and bytes (``row_bytes`` of the layout times the rows)."""

    key: str
    layer: int | None
    shape: tuple[int, ...]
    dtype: str
    group: str
    nbytes: int


def tensor_bytes(
    graph: ModelGraph,
    dims: Mapping[str, Any],
    combo: QuantCombo | None = None,
    tensor_dtypes: Mapping[str, str] | None = None,
    device_type: Callable[[str, int], str] | None = None,
) -> list[TensorBytes]:
    """Every weight of ``graph`` at ``dims`` with its device bytes (``weight_bytes`` documents the
    storage-type rules); engine.placement splits these across devices."""
    dtypes = tensor_dtypes or {}
    layers_of = graph.tensor_layers(dict(dims))
    out: list[TensorBytes] = []
    for key, spec in graph.tensors.items():
        if spec.optional or (spec.tied_to and dims.get("tie_embeddings")):
            continue  # optional tensors are small extras; a tied head is its embedding
        if spec.shape is None:
            raise MemraError(f"{graph.path}: tensors.{key}: a shape is needed to count its bytes")
        shape = tuple(int(evaluate(s, dims)) for s in spec.shape)
        for layer in layers_of.get(key, []) if spec.per_layer else [None]:
            if spec.kind == "vector":
                out.append(TensorBytes(key, layer, shape, "f32", "vectors", 4 * prod(shape)))
                continue
            dtype = dtypes.get(f"{key}@{layer}") or dtypes.get(key)
            if dtype is None:
                if combo is None:
                    raise MemraError(f"weight_bytes: no storage type for {key} (pass a quant combo)")
                dtype = combo.allowed(key)[0]
            cols = shape[-1]
            layout = device_type(dtype, cols) if device_type and not spec.stack else dtype
            nbytes = prod(shape[:-1]) * storage.row_bytes(layout, cols)
            group = "experts" if spec.stack else "embedding" if spec.kind == "embedding" else "dense"
            out.append(TensorBytes(key, layer, shape, layout, group, nbytes))
    return out


def weight_bytes(
    graph: ModelGraph,
    dims: Mapping[str, Any],
    combo: QuantCombo | None = None,
    tensor_dtypes: Mapping[str, str] | None = None,
    device_type: Callable[[str, int], str] | None = None,
) -> WeightBytes:
    """Bytes every weight of ``graph`` at ``dims`` takes on the device.

    A tensor's storage type is ``tensor_dtypes["<key>@<layer>"]`` or ``tensor_dtypes["<key>"]`` (as
    ``engine.model.LoadedModel`` records a file's), else the first type ``combo`` allows for it.
    ``device_type(type, cols)`` maps a file type to the layout uploaded (a repacked layout pads
    rows: ``engine.storage.row_bytes``); by default the file type. Stacked (expert) tensors keep the
    file's layout (the expert kernels decode the file's blocks). Per-layer tensors count in the
    layers whose ops read them (a dense layer of a MoE model has no experts). A tied head counts
    once. Vectors count as f32. Raises ConfigError for a tensor without a shape.
    """
    groups = {"experts": 0, "dense": 0, "embedding": 0, "vectors": 0}
    for t in tensor_bytes(graph, dims, combo, tensor_dtypes, device_type):
        groups[t.group] += t.nbytes
    return WeightBytes(**groups)


def plan_weight_bytes(plan: Any, graph: ModelGraph) -> WeightBytes:
    """The device bytes of a CUDA plan's weight allocations (``engine.ir.Plan.weights``, exactly
    what the runner uploads), grouped as ``weight_bytes`` groups them; a computed weight (RoPE
    frequencies) counts as a vector."""
    groups = {"experts": 0, "dense": 0, "embedding": 0, "vectors": 0}
    for w in plan.weights:
        spec = graph.tensors.get(w.parts[0])
        if spec is None or spec.kind == "vector":
            group = "vectors"
        else:
            group = "experts" if spec.stack else "embedding" if spec.kind == "embedding" else "dense"
        groups[group] += w.nbytes
    return WeightBytes(**groups)


def active_expert_fraction(dims: Mapping[str, Any], batch: int = 1) -> float:
    """The share of a MoE layer's expert bytes a decode step of ``batch`` rows reads: each row picks
    ``experts_used`` of ``experts`` distinct experts, so exactly top_k / E at batch 1, and with rows
    routed independently and uniformly the expected distinct share 1 - (1 - top_k / E) ** batch."""
    return 1.0 - (1.0 - int(dims["experts_used"]) / int(dims["experts"])) ** max(int(batch), 1)


def check_fits(what: str, weights: WeightBytes, free: int, reserve: int = 0) -> None:
    """Raise MemraError (code ``out_of_memory``) unless ``weights.total + reserve <= free``.

    ``what`` names the model (its file); ``reserve`` is memory needed beside the weights (at least
    one KV block, activation buffers). The message gives bytes needed, by group, and bytes free.
    """
    need = weights.total + reserve
    if need <= free:
        return
    extra = f" + {reserve / GIB:.2f} GiB for KV cache and buffers" if reserve else ""
    raise MemraError(
        f"{what}: the weights need {weights.total / GIB:.2f} GiB on the device ({weights.describe()}){extra}, "
        f"{need / GIB:.2f} GiB in all, but only {free / GIB:.2f} GiB is free",
        code="out_of_memory",
    )
