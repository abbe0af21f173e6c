"""Model-family DSL: load and validate models/<family>.yaml into a ModelGraph.

A family file names its dims (where to read each from config.json or GGUF metadata), its tensors
(name patterns for both formats, kind, expected shape), its op graph, its quant combos and its known
sizes. ``extends:`` derives a family from another with a small delta. Every problem is a ConfigError
naming the file and key path. Must not import numpy or CUDA: this is pure configuration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine import paths
from engine.dim_expr import evaluate, names_in
from engine.ops import OPS
from engine.schema import Field, ListOf, MapOf, OneOf, fail, load_yaml, validate
from engine.types import ConfigError

# Storage types a tensor may have (GGUF names, lower case).
FLOAT_TYPES = ("f32", "f16", "bf16")
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
STORAGE_TYPES = FLOAT_TYPES + QUANT_TYPES

# (elements per block, bytes per block) of each storage type: GGUF block layouts, floats are
# 1-element blocks. engine/quant.py documents each layout's fields.
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q8_0": (32, 34),
    "q2_k": (256, 84),
    "q3_k": (256, 110),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    # device layouts, never file types: rows repacked at upload (engine.quant.repack; q6_kr, q4_0r
    # and q4_1r rows are padded to 16 bytes, engine.quant.row_bytes)
    "q8_0r": (32, 34),
    "q6_kr": (256, 210),
    "q4_0r": (32, 18),
    "q4_1r": (32, 20),
}

TENSOR_KINDS = ("matrix", "embedding", "vector")
DIM_TYPES = ("int", "float", "bool", "mapping", "list", "any")
LAYER_TYPES_DIM = "layer_types"  # the dim naming each layer's type, read by `by_layer_type` dims
ROPE_STYLES = ("neox", "interleaved")
FORMATS = ("hf", "gguf")


__all__ = ["evaluate"]  # re-exported: engine.model and engine.plan import it from here

# The op vocabulary lives in engine.ops (one module per op family, each op with its reference).

GRAPH_INPUTS = ("tokens",)
GRAPH_OUTPUT = "logits"


@dataclass(frozen=True)
class DimSpec:
    name: str
    hf: tuple[str, ...] = ()  # config.json fields (dotted paths), first present wins
    gguf: tuple[str, ...] = ()  # GGUF metadata keys ({arch} replaced), first present wins
    default: Any = None
    has_default: bool = False
    type: str = "int"
    expr: str | None = None
    from_tensor: tuple[str, int] | None = None
    gguf_from_missing: str | None = None  # GGUF: true when this tensor is absent (tied head)
    gguf_default: Any = None  # the default in a GGUF file, where it differs from `default`
    has_gguf_default: bool = False
    layer_pattern: dict[str, str] | None = None  # fallback of the layer_types dim (see docs/dsl.md)
    by_layer_type: dict[str, Any] | None = None  # per-layer: a value per entry of the layer_types dim

    @property
    def per_layer(self) -> bool:
        """True when the dim's value is a tuple with one entry per layer (``by_layer_type``)."""
        return self.by_layer_type is not None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    hf: str | None
    gguf: str | None
    kind: str
    shape: tuple[str, ...] | None
    tied_to: str | None
    optional: bool

    @property
    def per_layer(self) -> bool:
        return "{i}" in (self.hf or "") or "{i}" in (self.gguf or "")

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
class Repeat:
    count: str  # a dim name
    body: tuple[Op, ...]


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


@dataclass(frozen=True)
class ModelGraph:
    family: str
    path: Path
    description: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    dims: dict[str, DimSpec]
    tensors: dict[str, TensorSpec]
    rope_style: dict[str, str]
    graph: tuple[Op | Repeat, ...]
    quants: dict[str, QuantCombo]
    sizes: dict[str, dict[str, Any]]

    def ops(self) -> list[tuple[Op, bool]]:
        """Every op in order with a flag saying whether it runs once per layer."""
        out: list[tuple[Op, bool]] = []
        for node in self.graph:
            if isinstance(node, Repeat):
                out.extend((op, True) for op in node.body)
            else:
                out.append((node, False))
        return out

    def quant(self, name: str) -> QuantCombo:
        if name not in self.quants:
            raise ConfigError(
                f"{self.path}: quant combo {name!r} not defined for family {self.family}; "
                f"available: {', '.join(self.quants)}"
            )
        return self.quants[name]


# ---------------------------------------------------------------------------------------------
# schema

_DIM = {
    "hf": Field((str, list)),
    "gguf": Field((str, list)),
    "default": Field((int, float, str, bool, type(None))),
    "type": Field(OneOf(DIM_TYPES), default="int"),
    "expr": Field(str),
    "from_tensor": Field(list),
    "gguf_from_missing": Field(str),
    "gguf_default": Field((int, float, str, bool, type(None))),
    "layer_pattern": Field(
        {"period": Field(str, required=True), "every": Field(str, required=True), "other": Field(str, required=True)}
    ),
    "by_layer_type": Field(dict),
}
_TENSOR = {
    "hf": Field(str),
    "gguf": Field(str),
    "kind": Field(OneOf(TENSOR_KINDS), required=True),
    "shape": Field(ListOf(str)),
    "tied_to": Field(str),
    "optional": Field(bool, default=False),
}
_TOP = {
    "family": Field(str, required=True),
    "extends": Field(str),
    "description": Field(str, default=""),
    "matches": Field(
        {
            "hf_architectures": Field(ListOf(str), default=[]),
            "gguf_architectures": Field(ListOf(str), default=[]),
        },
        default={"hf_architectures": [], "gguf_architectures": []},
    ),
    "dims": Field(MapOf((dict, type(None))), default={}),
    "rope_style": Field({"hf": Field(OneOf(ROPE_STYLES)), "gguf": Field(OneOf(ROPE_STYLES))}),
    "tensors": Field(MapOf((dict, type(None))), default={}),
    "graph": Field(list),
    "graph_edits": Field(list, default=[]),
    "quants": Field(MapOf(dict)),
    "sizes": Field(MapOf(dict), default={}),
}


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _merge_parent(child: dict, parent: dict, file: Path) -> dict:
    """Apply a child family's delta to its parent's raw YAML."""
    merged = copy.deepcopy(parent)
    merged["family"] = child["family"]
    for key in ("description", "matches", "rope_style", "quants", "sizes"):
        if key in child:
            merged[key] = child[key]
    for key in ("dims", "tensors"):
        base = dict(merged.get(key) or {})
        for name, value in (child.get(key) or {}).items():
            if value is None:
                base.pop(name, None)  # `name: null` removes an inherited entry
            else:
                base[name] = value
        merged[key] = base
    if "graph" in child:
        merged["graph"] = child["graph"]
    merged["graph"] = _apply_edits(merged["graph"], child.get("graph_edits") or [], file)
    merged.pop("extends", None)
    merged.pop("graph_edits", None)
    return merged


def _op_matches(node: Any, pattern: dict) -> bool:
    return isinstance(node, dict) and all(node.get(k) == v for k, v in pattern.items())


def _apply_edits(graph: list, edits: list, file: Path) -> list:
    graph = copy.deepcopy(graph)
    for n, edit in enumerate(edits):
        where = f"graph_edits[{n}]"
        if not isinstance(edit, dict):
            raise fail(file, where, "expected a mapping with after/insert, replace/with or remove")
        keys = set(edit)
        if keys == {"after", "insert"}:
            pattern, new = edit["after"], _as_list(edit["insert"])
        elif keys == {"replace", "with"}:
            pattern, new = edit["replace"], _as_list(edit["with"])
        elif keys == {"remove"}:
            pattern, new = edit["remove"], []
        else:
            raise fail(file, where, f"expected keys after+insert, replace+with or remove; got {sorted(keys)}")
        if not _edit_nodes(graph, pattern, new, "after" in keys):
            raise fail(file, where, f"no op in the parent graph matches {pattern}")
    return graph


def _edit_nodes(nodes: list, pattern: dict, new: list, keep: bool) -> bool:
    hit = False
    i = 0
    while i < len(nodes):
        node = nodes[i]
        if isinstance(node, dict) and "repeat" in node:
            hit |= _edit_nodes(node.get("body") or [], pattern, new, keep)
        elif _op_matches(node, pattern):
            nodes[i : i + 1] = ([node] if keep else []) + copy.deepcopy(new)
            i += len(new) + (1 if keep else 0)
            hit = True
            continue
        i += 1
    return hit


def _parse_op(raw: Any, file: Path, where: str) -> Op:
    if not isinstance(raw, dict) or "op" not in raw:
        raise fail(file, where, "expected a mapping with an `op` key")
    name = raw["op"]
    if name not in OPS:
        raise fail(file, f"{where}.op", f"unknown op {name!r}; known ops: {', '.join(OPS)}")
    d = OPS[name]
    allowed = {"op", "in", "out", "weight"} | set(d.attrs)
    for key in raw:
        if key not in allowed:
            raise fail(
                file,
                f"{where}.{key}",
                f"unknown key for op {name}; expected one of: {', '.join(sorted(allowed))}",
            )
    inputs = tuple(_as_list(raw.get("in")))
    outputs = tuple(_as_list(raw.get("out")))
    weights = tuple(_as_list(raw.get("weight")))
    for label, items in (("in", inputs), ("out", outputs), ("weight", weights)):
        for item in items:
            if not isinstance(item, str):
                raise fail(file, f"{where}.{label}", f"expected names (strings), got {item!r}")
    lo, hi = d.weights
    if not lo <= len(weights) <= hi:
        raise fail(file, f"{where}.weight", f"op {name} takes {lo}..{hi} weights, got {len(weights)}")
    if d.inputs is not None and len(inputs) != d.inputs:
        raise fail(file, f"{where}.in", f"op {name} takes {d.inputs} input(s), got {len(inputs)}")
    want_out = d.outputs if d.outputs is not None else len(weights)
    if len(outputs) != want_out:
        raise fail(file, f"{where}.out", f"op {name} produces {want_out} output(s), got {len(outputs)}")
    attrs = {k: raw[k] for k in d.attrs if k in raw}
    for k, v in attrs.items():
        if not isinstance(v, str):
            raise fail(file, f"{where}.{k}", f"expected a name (string), got {v!r}")
    return Op(name, inputs, outputs, weights, attrs)


def _parse_graph(raw: list, file: Path, dims: dict, tensors: dict) -> tuple[Op | Repeat, ...]:
    nodes: list[Op | Repeat] = []
    for n, item in enumerate(raw):
        where = f"graph[{n}]"
        if isinstance(item, dict) and "repeat" in item:
            extra = set(item) - {"repeat", "body"}
            if extra:
                raise fail(
                    file, f"{where}.{sorted(extra)[0]}", "unknown key; a repeat has `repeat` and `body`"
                )
            if item["repeat"] not in dims:
                raise fail(file, f"{where}.repeat", f"{item['repeat']!r} is not a dim of this family")
            body = tuple(
                _parse_op(op, file, f"{where}.body[{j}]") for j, op in enumerate(item.get("body") or [])
            )
            if not body:
                raise fail(file, f"{where}.body", "a repeat needs a non-empty body")
            nodes.append(Repeat(item["repeat"], body))
        else:
            nodes.append(_parse_op(item, file, where))
    _check_dataflow(nodes, file, tensors, dims)
    return tuple(nodes)


def _check_dataflow(
    nodes: list[Op | Repeat], file: Path, tensors: dict[str, TensorSpec], dims: dict[str, DimSpec]
) -> None:
    defined = set(GRAPH_INPUTS)
    for n, node in enumerate(nodes):
        ops = node.body if isinstance(node, Repeat) else (node,)
        prefix = f"graph[{n}]" + (".body" if isinstance(node, Repeat) else "")
        for j, op in enumerate(ops):
            where = f"{prefix}[{j}]" if isinstance(node, Repeat) else prefix
            for name in op.inputs:
                if name not in defined:
                    raise fail(file, f"{where}.in", f"value {name!r} is used before any op produces it")
            for w in op.weights:
                if w not in tensors:
                    raise fail(file, f"{where}.weight", f"{w!r} is not a tensor of this family")
                if tensors[w].per_layer != isinstance(node, Repeat):
                    scope = "inside" if tensors[w].per_layer else "outside"
                    raise fail(
                        file,
                        f"{where}.weight",
                        f"per-layer tensor rules: {w!r} must be used {scope} a repeat",
                    )
            for k, v in op.attrs.items():
                kind = OPS[op.op].attrs[k]
                if kind == "tensor" and v not in tensors:
                    raise fail(file, f"{where}.{k}", f"{v!r} is not a tensor of this family")
                if kind == "value" and v not in defined:
                    raise fail(file, f"{where}.{k}", f"value {v!r} is used before any op produces it")
                if kind == "dim" and v not in dims:
                    raise fail(file, f"{where}.{k}", f"{v!r} is not a dim of this family")
                if kind == "dim" and dims[v].per_layer and not isinstance(node, Repeat):
                    raise fail(file, f"{where}.{k}", f"per-layer dim {v!r} must be used inside a repeat")
            defined.update(op.outputs)
    if GRAPH_OUTPUT not in defined:
        raise fail(file, "graph", f"the graph never produces {GRAPH_OUTPUT!r}")


def _parse_dims(raw: dict, file: Path) -> dict[str, DimSpec]:
    dims: dict[str, DimSpec] = {}
    for name, spec in raw.items():
        where = f"dims.{name}"
        spec = validate(spec, _DIM, file, where)
        ft = spec.get("from_tensor")
        if ft is not None and not (len(ft) == 2 and isinstance(ft[0], str) and isinstance(ft[1], int)):
            raise fail(file, f"{where}.from_tensor", "expected [tensor_name, axis]")
        sources = ("hf", "gguf", "expr", "default", "from_tensor", "layer_pattern", "by_layer_type")
        if not any(k in spec for k in sources):
            raise fail(file, where, f"a dim needs at least one of {', '.join(sources)}")
        for key in ("hf", "gguf"):
            for item in _as_list(spec.get(key)):
                if not isinstance(item, str):
                    raise fail(file, f"{where}.{key}", f"expected a name or a list of names, got {item!r}")
        if spec.get("layer_pattern") is not None and name != LAYER_TYPES_DIM:
            raise fail(file, f"{where}.layer_pattern", f"only the {LAYER_TYPES_DIM!r} dim takes a layer_pattern")
        blt = spec.get("by_layer_type")
        if blt is not None:
            if not blt:
                raise fail(file, f"{where}.by_layer_type", "expected a value per layer type, got none")
            for ltype, value in blt.items():
                if not isinstance(value, (int, float, str, type(None))):
                    raise fail(
                        file, f"{where}.by_layer_type.{ltype}", f"expected a number, a dim expression or null, got {value!r}"
                    )
        dims[name] = DimSpec(
            name=name,
            hf=tuple(_as_list(spec.get("hf"))),
            gguf=tuple(_as_list(spec.get("gguf"))),
            default=spec.get("default"),
            has_default="default" in spec,
            type=spec["type"],
            expr=spec.get("expr"),
            from_tensor=(ft[0], ft[1]) if ft else None,
            gguf_from_missing=spec.get("gguf_from_missing"),
            gguf_default=spec.get("gguf_default"),
            has_gguf_default="gguf_default" in spec,
            layer_pattern=dict(spec["layer_pattern"]) if spec.get("layer_pattern") else None,
            by_layer_type=dict(blt) if blt is not None else None,
        )
    for name, d in dims.items():
        if d.per_layer and LAYER_TYPES_DIM not in dims:
            raise fail(file, f"dims.{name}.by_layer_type", f"needs a {LAYER_TYPES_DIM!r} dim naming each layer's type")
        if d.layer_pattern and d.layer_pattern["period"] not in dims:
            raise fail(file, f"dims.{name}.layer_pattern.period", f"{d.layer_pattern['period']!r} is not a dim")
    return dims


def _parse_tensors(raw: dict, file: Path, dims: dict) -> dict[str, TensorSpec]:
    tensors: dict[str, TensorSpec] = {}
    for name, spec in raw.items():
        where = f"tensors.{name}"
        spec = validate(spec, _TENSOR, file, where)
        if "hf" not in spec and "gguf" not in spec:
            raise fail(file, where, "a tensor needs a name pattern: hf, gguf or both")
        for part in spec.get("shape") or []:
            for ident in names_in(part, file, f"{where}.shape"):
                if ident not in dims:
                    raise fail(file, f"{where}.shape", f"{ident!r} is not a dim of this family")
        tensors[name] = TensorSpec(
            name=name,
            hf=spec.get("hf"),
            gguf=spec.get("gguf"),
            kind=spec["kind"],
            shape=tuple(spec["shape"]) if spec.get("shape") else None,
            tied_to=spec.get("tied_to"),
            optional=spec["optional"],
        )
    for name, t in tensors.items():
        if t.tied_to is not None and t.tied_to not in tensors:
            raise fail(file, f"tensors.{name}.tied_to", f"{t.tied_to!r} is not a tensor of this family")
    for name, d in dims.items():
        if d.from_tensor and d.from_tensor[0] not in tensors:
            raise fail(
                file, f"dims.{name}.from_tensor", f"{d.from_tensor[0]!r} is not a tensor of this family"
            )
        if d.gguf_from_missing and d.gguf_from_missing not in tensors:
            raise fail(
                file,
                f"dims.{name}.gguf_from_missing",
                f"{d.gguf_from_missing!r} is not a tensor of this family",
            )
    return tensors


def _parse_quants(raw: dict, file: Path, tensors: dict) -> dict[str, QuantCombo]:
    combos: dict[str, QuantCombo] = {}
    for name, spec in raw.items():
        where = f"quants.{name}"
        if "default" not in spec:
            raise fail(file, f"{where}.default", "required key is missing")
        per: dict[str, tuple[str, ...]] = {}
        default: tuple[str, ...] = ()
        for key, value in spec.items():
            types = tuple(_as_list(value))
            for t in types:
                if t not in STORAGE_TYPES:
                    raise fail(
                        file,
                        f"{where}.{key}",
                        f"unknown storage type {t!r}; expected one of {', '.join(STORAGE_TYPES)}",
                    )
            if key == "default":
                default = types
                continue
            if key not in tensors:
                raise fail(file, f"{where}.{key}", f"{key!r} is not a tensor of this family")
            if tensors[key].kind == "vector":
                raise fail(file, f"{where}.{key}", f"{key!r} is a vector (norm); vectors are always float")
            per[key] = types
        combos[name] = QuantCombo(name, default, per)
    return combos


def _raw_family(name: str, root: Path, chain: tuple[str, ...] = ()) -> tuple[dict, Path]:
    file = root / f"{name}.yaml"
    if not file.is_file():
        known = ", ".join(sorted(p.stem for p in root.glob("*.yaml")))
        raise ConfigError(f"unknown model family {name!r}: no {file} (families: {known})")
    raw = load_yaml(file)
    raw = validate(raw, _TOP, file)
    if raw["family"] != name:
        raise fail(file, "family", f"{raw['family']!r} must equal the file name {name!r}")
    parent = raw.get("extends")
    if parent:
        if parent in chain or parent == name:
            raise fail(file, "extends", f"circular extends: {' -> '.join(chain + (name, parent))}")
        parent_raw, _ = _raw_family(parent, root, chain + (name,))
        raw = _merge_parent(raw, parent_raw, file)
    elif raw.get("graph_edits"):
        raise fail(file, "graph_edits", "graph_edits needs `extends:` (edits apply to a parent's graph)")
    return raw, file


def load_family(name: str, root: Path | None = None) -> ModelGraph:
    """Load models/<name>.yaml (resolving ``extends``) into a validated ModelGraph."""
    return _load_family(name, str(root or paths.models_dir()))


@lru_cache(maxsize=16)
def _load_family(name: str, root: str) -> ModelGraph:
    raw, file = _raw_family(name, Path(root))
    for key in ("graph", "quants", "rope_style"):
        if not raw.get(key):
            raise fail(file, key, "required key is missing")
    for fmt in FORMATS:
        if fmt not in raw["rope_style"]:
            raise fail(file, f"rope_style.{fmt}", "required key is missing")
    dims = _parse_dims(raw["dims"], file)
    tensors = _parse_tensors(raw["tensors"], file, dims)
    graph = _parse_graph(raw["graph"], file, dims, tensors)
    quants = _parse_quants(raw["quants"], file, tensors)
    for size, values in raw["sizes"].items():
        for k in values:
            if k not in dims:
                raise fail(file, f"sizes.{size}.{k}", f"{k!r} is not a dim of this family")
    return ModelGraph(
        family=raw["family"],
        path=file,
        description=raw["description"],
        hf_architectures=tuple(raw["matches"]["hf_architectures"]),
        gguf_architectures=tuple(raw["matches"]["gguf_architectures"]),
        dims=dims,
        tensors=tensors,
        rope_style=dict(raw["rope_style"]),
        graph=graph,
        quants=quants,
        sizes=dict(raw["sizes"]),
    )


def all_families(root: Path | None = None) -> dict[str, ModelGraph]:
    root = root or paths.models_dir()
    return {p.stem: load_family(p.stem, root) for p in sorted(Path(root).glob("*.yaml"))}


def family_for_architecture(fmt: str, arch: str, root: Path | None = None) -> ModelGraph:
    """The family whose ``matches`` lists this HF architecture / GGUF general.architecture."""
    for g in all_families(root).values():
        if arch in (g.hf_architectures if fmt == "hf" else g.gguf_architectures):
            return g
    raise ConfigError(f"no model family in {root or paths.models_dir()} supports {fmt} architecture {arch!r}")
