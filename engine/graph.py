"""Model-family DSL: load and validate models/<family>.yaml into a ModelGraph.

A family file names its dims (where to read each from config.json or GGUF metadata), its tensors
(name patterns for both formats, kind, expected shape), its op graph, its quant combos and its known
sizes. ``extends:`` derives a family from another with a small delta. Every problem is a ConfigError
naming the file and key path. Must not import numpy or CUDA: this is pure configuration.
"""

from __future__ import annotations

import ast
import copy
import operator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine import paths
from engine.graph_flow import parse_graph
from engine.graph_nodes import (  # noqa: F401  (re-exported: the DSL's node types)
    GRAPH_INPUTS,
    GRAPH_OUTPUT,
    Choose,
    DimSpec,
    Op,
    QuantCombo,
    Repeat,
    TensorSpec,
    op_tensors,
)
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
# Per-format load-time transforms of a vector into the form the ops compute with (engine.model):
# plus_one: HF's zero-centred RMSNorm weight w becomes 1 + w (what llama.cpp's converter stores);
# neg_exp: HF's A_log becomes A = -exp(A_log) (GGUF ssm_a).
TENSOR_TRANSFORMS = ("plus_one", "neg_exp")
ROPE_STYLES = ("neox", "interleaved")
FORMATS = ("hf", "gguf")


# The op vocabulary lives in engine.ops (one module per op family, each op with its reference).


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
        """Every op in order with a flag saying whether it runs once per layer (every case of a
        per-layer ``choose`` included: ``schedule`` gives what each layer runs)."""
        out: list[tuple[Op, bool]] = []
        for node in self.graph:
            if isinstance(node, Repeat):
                for inner in node.body:
                    if isinstance(inner, Choose):
                        out.extend((op, True) for case in inner.cases.values() for op in case)
                    else:
                        out.append((inner, True))
            else:
                out.append((node, False))
        return out

    @property
    def choice_dim(self) -> str | None:
        """The list dim a per-layer ``choose`` reads (one per family at most), or None."""
        for node in self.graph:
            if isinstance(node, Repeat):
                for inner in node.body:
                    if isinstance(inner, Choose):
                        return inner.dim
        return None

    def block_types(self) -> tuple[str, ...]:
        """The case names of the per-layer ``choose`` (empty without one)."""
        for node in self.graph:
            if isinstance(node, Repeat):
                for inner in node.body:
                    if isinstance(inner, Choose):
                        return tuple(inner.cases)
        return ()

    def schedule(self, dims: dict[str, Any]) -> list[tuple[Op, int | None]]:
        """(op, layer) in execution order: each repeat's body once per layer, with the case of a
        ``choose`` that the layer's entry of its list dim names."""
        sched: list[tuple[Op, int | None]] = []
        for node in self.graph:
            if not isinstance(node, Repeat):
                sched.append((node, None))
                continue
            kinds = dims.get(self.choice_dim) if self.choice_dim else None
            for layer in range(int(dims[node.count])):
                kind = kinds[layer] if kinds is not None else None
                sched.extend((op, layer) for op in node.layer_ops(kind))
        return sched

    def tensor_block_types(self) -> dict[str, frozenset[str]]:
        """Per-layer tensors used only inside ``choose`` cases -> the block types that use them
        (such a tensor exists only in the layers of those types)."""
        inside: dict[str, set[str]] = {}
        outside: set[str] = set()
        for node in self.graph:
            if not isinstance(node, Repeat):
                continue
            for inner in node.body:
                if isinstance(inner, Choose):
                    for case, ops in inner.cases.items():
                        for op in ops:
                            for w in op_tensors(op):
                                inside.setdefault(w, set()).add(case)
                else:
                    outside.update(op_tensors(inner))
        return {k: frozenset(v) for k, v in inside.items() if k not in outside}

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
    "hf": Field(str),
    "gguf": Field(str),
    "default": Field((int, float, str, bool, type(None))),
    "type": Field(OneOf(("int", "float", "bool", "mapping", "list")), default="int"),
    "expr": Field(str),
    "from_tensor": Field(list),
    "gguf_from_missing": Field(str),
    "per_format": Field({"hf": Field((int, float, str, bool)), "gguf": Field((int, float, str, bool))}),
    "pattern": Field(
        {"interval": Field(str, required=True), "every": Field(str, required=True), "other": Field(str, required=True)}
    ),
}
_TENSOR = {
    "hf": Field(str),
    "gguf": Field(str),
    "kind": Field(OneOf(TENSOR_KINDS), required=True),
    "shape": Field(ListOf(str)),
    "tied_to": Field(str),
    "optional": Field(bool, default=False),
    "transform": Field({"hf": Field(OneOf(TENSOR_TRANSFORMS)), "gguf": Field(OneOf(TENSOR_TRANSFORMS))}),
    "shape_gguf": Field(ListOf(str)),
    "layers": Field(str),
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
        elif isinstance(node, dict) and "choose" in node:
            for case in (node.get("cases") or {}).values():
                hit |= _edit_nodes(case or [], pattern, new, keep)
        elif _op_matches(node, pattern):
            nodes[i : i + 1] = ([node] if keep else []) + copy.deepcopy(new)
            i += len(new) + (1 if keep else 0)
            hit = True
            continue
        i += 1
    return hit


def _parse_dims(raw: dict, file: Path) -> dict[str, DimSpec]:
    dims: dict[str, DimSpec] = {}
    for name, spec in raw.items():
        where = f"dims.{name}"
        spec = validate(spec, _DIM, file, where)
        ft = spec.get("from_tensor")
        if ft is not None and not (len(ft) == 2 and isinstance(ft[0], str) and isinstance(ft[1], int)):
            raise fail(file, f"{where}.from_tensor", "expected [tensor_name, axis]")
        if not any(k in spec for k in ("hf", "gguf", "expr", "default", "from_tensor", "per_format", "pattern")):
            raise fail(
                file, where, "a dim needs at least one of hf, gguf, expr, default, from_tensor, per_format, pattern"
            )
        if "pattern" in spec and spec["type"] != "list":
            raise fail(file, f"{where}.pattern", "a pattern makes a list dim: add `type: list`")
        dims[name] = DimSpec(
            name=name,
            hf=spec.get("hf"),
            gguf=spec.get("gguf"),
            default=spec.get("default"),
            has_default="default" in spec,
            type=spec["type"],
            expr=spec.get("expr"),
            from_tensor=(ft[0], ft[1]) if ft else None,
            gguf_from_missing=spec.get("gguf_from_missing"),
            per_format=spec.get("per_format"),
            pattern=spec.get("pattern"),
        )
    for name, d in dims.items():
        if d.pattern and d.pattern["interval"] not in dims:
            raise fail(file, f"dims.{name}.pattern.interval", f"{d.pattern['interval']!r} is not a dim of this family")
    return dims


def _parse_tensors(raw: dict, file: Path, dims: dict) -> dict[str, TensorSpec]:
    tensors: dict[str, TensorSpec] = {}
    for name, spec in raw.items():
        where = f"tensors.{name}"
        spec = validate(spec, _TENSOR, file, where)
        if "hf" not in spec and "gguf" not in spec:
            raise fail(file, where, "a tensor needs a name pattern: hf, gguf or both")
        for key in ("shape", "shape_gguf"):
            for part in spec.get(key) or []:
                for ident in _names_in(part, file, f"{where}.{key}"):
                    if ident not in dims:
                        raise fail(file, f"{where}.{key}", f"{ident!r} is not a dim of this family")
        if spec.get("transform") and spec["kind"] != "vector":
            raise fail(file, f"{where}.transform", "only vectors take a load-time transform")
        if "layers" in spec and spec["layers"] not in dims:
            raise fail(file, f"{where}.layers", f"{spec['layers']!r} is not a dim of this family")
        tensors[name] = TensorSpec(
            name=name,
            hf=spec.get("hf"),
            gguf=spec.get("gguf"),
            kind=spec["kind"],
            shape=tuple(spec["shape"]) if spec.get("shape") else None,
            tied_to=spec.get("tied_to"),
            optional=spec["optional"],
            transform=dict(spec.get("transform") or {}),
            shapes={"gguf": tuple(spec["shape_gguf"])} if spec.get("shape_gguf") else {},
            layers=spec.get("layers", "layers"),
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


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def _names_in(expr: str, file: Path, where: str) -> set[str]:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise fail(file, where, f"invalid expression {expr!r}") from exc
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def evaluate(expr: str, values: dict[str, Any]) -> Any:
    """Evaluate a dim expression (``hidden // heads``): names, integers, + - * //, nothing else."""

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise KeyError(node.id)
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported expression element {ast.dump(node)} in {expr!r}")

    return walk(ast.parse(str(expr), mode="eval"))


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
    graph = parse_graph(raw["graph"], file, dims, tensors)
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
