"""The dims and tensors sections of a model-family file: DimSpec and TensorSpec, their schemas and
their parsers (``parse_dims``, ``parse_tensors``), used by engine.graph, which re-exports the specs.

Every problem is a ConfigError naming the file and key path (engine.schema.fail). Must not import
engine.graph (graph imports this), numpy or CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import dsl_expr
from engine.schema import Field, ListOf, OneOf, fail, validate

TENSOR_KINDS = ("matrix", "embedding", "vector")
DIM_TYPES = ("int", "float", "bool", "mapping", "list")
# load-time vector transforms (engine.model.apply_transform): 1 + w of a zero-centred norm; -exp(A_log)
TENSOR_TRANSFORMS = ("plus_one", "neg_exp")
FORMATS = ("hf", "gguf")


@dataclass(frozen=True)
class DimSpec:
    name: str
    hf: str | None = None  # a config.json path, dotted for nested keys (engine.hf_config reads it)
    gguf: str | None = None
    default: Any = None
    has_default: bool = False
    type: str = "int"
    expr: str | None = None
    from_tensor: tuple[str, int] | None = None
    # list dim absent from the file: layer i is `every` if (i + 1) % interval == 0, else `other`
    pattern: dict[str, str] | None = None
    # GGUF: true when this tensor is absent (tied head); for a `list` dim and a per-layer tensor,
    # the layers that lack it
    gguf_from_missing: str | None = None
    hf_alternatives: tuple[str, ...] = ()  # further paths of the same value; present ones must agree
    gguf_default: Any = None  # the default in a GGUF file, where it differs from `default`
    has_gguf_default: bool = False

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return ((self.hf,) if self.hf else ()) + self.hf_alternatives


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
    # a stack of tensors along axis 0, one per index of this dim (the experts of a MoE layer); a
    # pattern with `{e}` names one file tensor per index, a pattern without it the stacked tensor
    stack: str | None = None

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


# schema

_DIM = {
    "hf": Field((str, list)),
    "gguf": Field(str),
    "default": Field((int, float, str, bool, list, type(None))),
    "type": Field(OneOf(DIM_TYPES), default="int"),
    "expr": Field(str),
    "from_tensor": Field(list),
    "gguf_from_missing": Field(str),
    "gguf_default": Field((int, float, str, bool, list, type(None))),
    "pattern": Field({k: Field(str, required=True) for k in ("interval", "every", "other")}),
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
    "stack": Field(str),
}

def as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def names_in(expr: str, file: Path, where: str) -> set[str]:
    try:
        return dsl_expr.names_in(expr)
    except (SyntaxError, ValueError) as exc:
        raise fail(file, where, f"invalid expression {expr!r}: {exc}") from exc


def parse_dims(raw: dict, file: Path) -> dict[str, DimSpec]:
    dims: dict[str, DimSpec] = {}
    for name, spec in raw.items():
        where = f"dims.{name}"
        spec = validate(spec, _DIM, file, where)
        ft = spec.get("from_tensor")
        if ft is not None and not (len(ft) == 2 and isinstance(ft[0], str) and isinstance(ft[1], int)):
            raise fail(file, f"{where}.from_tensor", "expected [tensor_name, axis]")
        if not any(k in spec for k in ("hf", "gguf", "expr", "default", "from_tensor", "pattern")):
            raise fail(file, where, "a dim needs at least one of hf, gguf, expr, default, from_tensor, pattern")
        if "pattern" in spec and spec["type"] != "list":
            raise fail(file, f"{where}.pattern", "a pattern makes a list dim: add `type: list`")
        hf_keys = as_list(spec.get("hf"))
        if not all(isinstance(k, str) and k for k in hf_keys):
            raise fail(file, f"{where}.hf", "expected a config.json field name or a list of them")
        dims[name] = DimSpec(
            name=name,
            hf=hf_keys[0] if hf_keys else None,
            hf_alternatives=tuple(hf_keys[1:]),
            has_gguf_default="gguf_default" in spec,
            has_default="default" in spec,
            type=spec["type"],
            from_tensor=(ft[0], ft[1]) if ft else None,
            **{k: spec.get(k) for k in ("gguf", "default", "gguf_default", "expr", "gguf_from_missing", "pattern")},
        )
    for name, d in dims.items():
        if d.pattern and d.pattern["interval"] not in dims:
            raise fail(file, f"dims.{name}.pattern.interval", f"{d.pattern['interval']!r} is not a dim of this family")
    return dims


def parse_tensors(raw: dict, file: Path, dims: dict) -> dict[str, TensorSpec]:
    tensors: dict[str, TensorSpec] = {}
    for name, spec in raw.items():
        where = f"tensors.{name}"
        spec = validate(spec, _TENSOR, file, where)
        if "hf" not in spec and "gguf" not in spec:
            raise fail(file, where, "a tensor needs a name pattern: hf, gguf or both")
        for key in ("shape", "shape_gguf"):
            for part in spec.get(key) or []:
                for ident in names_in(part, file, f"{where}.{key}"):
                    if ident not in dims:
                        raise fail(file, f"{where}.{key}", f"{ident!r} is not a dim of this family")
        if spec.get("transform") and spec["kind"] != "vector":
            raise fail(file, f"{where}.transform", "only vectors take a load-time transform")
        if "layers" in spec and spec["layers"] not in dims:
            raise fail(file, f"{where}.layers", f"{spec['layers']!r} is not a dim of this family")
        tensors[name] = TensorSpec(
            name=name,
            kind=spec["kind"],
            shape=tuple(spec["shape"]) if spec.get("shape") else None,
            optional=spec["optional"],
            transform=dict(spec.get("transform") or {}),
            shapes={"gguf": tuple(spec["shape_gguf"])} if spec.get("shape_gguf") else {},
            layers=spec.get("layers", "layers"),
            **{k: spec.get(k) for k in ("hf", "gguf", "tied_to", "stack")},
        )
        if spec.get("stack") is not None:
            if spec["stack"] not in dims:
                raise fail(file, f"{where}.stack", f"{spec['stack']!r} is not a dim of this family")
            shape = spec.get("shape") or []
            if not shape or shape[0] != spec["stack"]:
                raise fail(file, f"{where}.shape", f"a stacked tensor's shape starts with its stack dim {spec['stack']!r}")
        for fmt in FORMATS:
            if "{e}" in (spec.get(fmt) or "") and spec.get("stack") is None:
                raise fail(file, f"{where}.{fmt}", "a pattern with {e} needs `stack: <dim>` (the index range)")
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
