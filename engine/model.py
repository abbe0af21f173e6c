"""Bind a model file to its family: resolve dims, match the quant combo, map tensor keys to file names.

``load_model(path)`` opens the weights (engine.weights), picks the family from config.json's
``architectures`` or GGUF ``general.architecture``, resolves every dim of the family YAML, checks
every tensor's presence and shape, and matches the file's storage types to a quant combo. All
problems are MemraError/ConfigError naming the file and the field. Must not import CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.graph import (
    LAYER_TYPES_DIM,
    DimSpec,
    ModelGraph,
    QuantCombo,
    evaluate,
    family_for_architecture,
    load_family,
)
from engine.types import ConfigError, MemraError

_CASTS = {"int": int, "float": float, "bool": bool}


@dataclass
class LoadedModel:
    graph: ModelGraph
    fmt: str  # "hf" | "gguf"
    dims: dict[str, Any]
    rope_style: str
    quant: QuantCombo
    weights: Any  # engine.weights.WeightSource
    path: Path
    # storage type per family tensor key ("wq": first layer's) and per layer ("wq@3"), as engine.plan reads it
    tensor_dtypes: dict[str, str]

    @property
    def name(self) -> str:
        return self.path.name

    def file_name(self, tensor: str, layer: int | None = None) -> str:
        spec = self.graph.tensors[tensor]
        name = spec.file_name(self.fmt, layer)
        if spec.tied_to and (self.dims.get("tie_embeddings") or name is None or not self.weights.has(name)):
            return self.file_name(spec.tied_to, layer)
        if name is None:
            raise ConfigError(f"{self.graph.path}: tensors.{tensor}: no {self.fmt} name pattern")
        return name

    def has(self, tensor: str, layer: int | None = None) -> bool:
        try:
            return self.weights.has(self.file_name(tensor, layer))
        except ConfigError:
            return False

    def info(self, tensor: str, layer: int | None = None):
        return self.weights.info(self.file_name(tensor, layer))

    def dequantize(self, tensor: str, layer: int | None = None):
        return self.weights.dequantize(self.file_name(tensor, layer))

    def layer_range(self) -> range:
        return range(int(self.dims["layers"]))

    def weight_bytes(self) -> int:
        """Bytes of every tensor the graph reads once per token (the decode roofline numerator)."""
        total = 0
        seen: set[str] = set()
        for key, spec in self.graph.tensors.items():
            for layer in self.layer_range() if spec.per_layer else [None]:
                if not self.has(key, layer):
                    continue
                name = self.file_name(key, layer)
                if name in seen or (key == "embed" and not self.dims.get("tie_embeddings")):
                    continue  # an untied embedding table is gathered, not streamed
                seen.add(name)
                total += self.weights.info(name).nbytes
        return total


def _meta_lookup(meta: dict, key: str, dotted: bool = False) -> tuple[bool, Any]:
    if key in meta:
        return True, meta[key]
    if dotted and "." in key:  # a config.json path into nested mappings (rope_parameters.full_attention.x)
        head, rest = key.split(".", 1)
        found, inner = _meta_lookup(meta, head)
        if found and isinstance(inner, dict):
            return _meta_lookup(inner, rest, dotted=True)
        return False, None
    # HF configs nest some fields (e.g. text_config); look one level down
    for sub in ("text_config", "llm_config"):
        inner = meta.get(sub)
        if isinstance(inner, dict) and key in inner:
            return True, inner[key]
    return False, None


def _gguf_mapping(meta: dict, prefix: str) -> dict | None:
    """GGUF keys under ``prefix.`` as one mapping ({arch}.rope.scaling.type/factor -> {type, factor})."""
    out = {k[len(prefix) + 1 :]: meta[k] for k in list(meta) if k.startswith(prefix + ".")}  # keys only: lazy values
    return out or None


def resolve_dims(
    graph: ModelGraph, fmt: str, meta: dict, source: str, tensor_shape=None, has_tensor=None
) -> dict[str, Any]:
    """Every dim of ``graph`` from ``meta`` (config.json dict or GGUF metadata), defaults and exprs.

    ``tensor_shape(key) -> shape`` and ``has_tensor(key) -> bool`` serve ``from_tensor`` and
    ``gguf_from_missing``; ``source`` names the file in errors.
    """
    arch = meta.get("general.architecture", "") if fmt == "gguf" else ""
    values: dict[str, Any] = {}
    resolving: set[str] = set()

    def get(name: str) -> Any:
        if name in values:
            return values[name]
        if name not in graph.dims:
            raise KeyError(name)
        if name in resolving:
            raise ConfigError(f"{graph.path}: dims.{name}: circular definition")
        resolving.add(name)
        values[name] = _resolve_one(graph.dims[name])
        resolving.discard(name)
        return values[name]

    def _resolve_one(d: DimSpec) -> Any:
        if d.expr:
            return _eval(d, d.expr)
        if d.by_layer_type is not None:
            return _per_layer(d)
        keys = d.hf if fmt == "hf" else tuple(k.replace("{arch}", arch) for k in d.gguf)
        key = keys[0] if keys else None
        for key in keys:
            found, value = _meta_lookup(meta, key, dotted=fmt == "hf")
            if not found and fmt == "gguf" and d.type == "mapping":
                found, value = True, _gguf_mapping(meta, key)
            if found and value is not None:
                return _cast(d, value, f"{source}: field {key!r} (dim {d.name})")
        if d.layer_pattern is not None:
            return _pattern(d)
        if fmt == "gguf" and d.gguf_from_missing and has_tensor is not None:
            return not has_tensor(d.gguf_from_missing)
        if d.from_tensor and tensor_shape is not None:
            shape = tensor_shape(d.from_tensor[0])
            if shape is not None:
                return int(shape[d.from_tensor[1]])
        if fmt == "gguf" and d.has_gguf_default:
            return _default(d, d.gguf_default)
        if d.has_default:
            return _default(d, d.default)
        raise MemraError(
            f"{source}: missing field {key!r} (needed for dim {d.name!r} of family {graph.family})",
            code="invalid_model",
        )

    def _default(d: DimSpec, value: Any) -> Any:
        if isinstance(value, str) and d.type != "mapping":
            return _eval(d, value)
        return value

    def _pattern(d: DimSpec) -> list[str]:
        # layer i is `every` when (i + 1) % period == 0, else `other`; a GGUF bool list
        # (llama.cpp's sliding_window_pattern array) marks each layer true when it is `other`
        lp = d.layer_pattern or {}
        n, period = int(get("layers")), get(lp["period"])
        if isinstance(period, (list, tuple)):
            if len(period) != n:
                raise MemraError(
                    f"{source}: {lp['period']} has {len(period)} entries for {n} layers", code="invalid_model"
                )
            return [lp["other"] if bool(p) else lp["every"] for p in period]
        period = int(period)
        if period < 1:
            raise MemraError(f"{source}: {lp['period']} must be >= 1, got {period}", code="invalid_model")
        return [lp["every"] if (i + 1) % period == 0 else lp["other"] for i in range(n)]

    def _per_layer(d: DimSpec) -> tuple:
        types = get(LAYER_TYPES_DIM)
        n = int(get("layers"))
        if not isinstance(types, (list, tuple)) or len(types) != n:
            raise MemraError(
                f"{source}: {LAYER_TYPES_DIM} must list one type per layer ({n}), got {types!r}",
                code="invalid_model",
            )
        table = d.by_layer_type or {}
        out = []
        for i, t in enumerate(types):
            if t not in table:
                raise MemraError(
                    f"{source}: layer {i} has type {t!r}, which family {graph.family} does not support "
                    f"(dims.{d.name}.by_layer_type knows: {', '.join(table)})",
                    code="invalid_model",
                )
            value = table[t]
            if isinstance(value, str):
                value = get(value) if value in graph.dims else _eval(d, value)
            out.append(value if value is None else _cast(d, value, f"{graph.path}: dims.{d.name}"))
        return tuple(out)

    def _eval(d: DimSpec, expr: str) -> Any:
        names = {}
        try:
            return _cast(d, evaluate(expr, _LazyDims(get, names)), f"{graph.path}: dims.{d.name}")
        except KeyError as exc:
            raise ConfigError(f"{graph.path}: dims.{d.name}: {exc.args[0]!r} is not a dim") from exc

    def _cast(d: DimSpec, value: Any, where: str) -> Any:
        if d.type == "any":  # taken as found; its reader checks it (a layer_pattern period: int or bool list)
            return value
        if d.type == "list":
            if not isinstance(value, (list, tuple)):
                raise MemraError(f"{where}: expected a list, got {value!r}", code="invalid_model")
            return list(value)
        if d.type == "mapping":
            if value is not None and not isinstance(value, dict):
                raise MemraError(f"{where}: expected a mapping, got {value!r}", code="invalid_model")
            return value
        try:
            if d.type == "int" and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return _CASTS[d.type](value)
        except (TypeError, ValueError):
            raise MemraError(f"{where}: expected {d.type}, got {value!r}", code="invalid_model") from None

    for name in graph.dims:
        get(name)
    return values


class _LazyDims(dict):
    """Mapping view used by ``evaluate``: missing names are resolved on demand."""

    def __init__(self, get, cache):
        super().__init__()
        self._get = get

    def __contains__(self, key: object) -> bool:
        try:
            self._get(key)
            return True
        except KeyError:
            return False

    def __getitem__(self, key: str) -> Any:
        return self._get(key)


def dims_for_size(family: str, size: str) -> dict[str, Any]:
    """Dims of a named size in the family YAML (``sizes:``), completed with defaults and exprs."""
    graph = load_family(family)
    if size not in graph.sizes:
        raise ConfigError(f"{graph.path}: sizes: no size {size!r}; available: {', '.join(graph.sizes)}")
    meta = dict(graph.sizes[size])
    # sizes use dim names directly: present them as an "hf" config keyed by each dim's hf field
    fake: dict[str, Any] = {}
    for name, value in meta.items():
        d = graph.dims[name]
        *parents, leaf = (d.hf[0] if d.hf else name).split(".")
        node = fake
        for part in parents:  # a dotted hf path becomes nested mappings
            node = node.setdefault(part, {})
        node[leaf] = value
    spec_graph = graph
    dims = resolve_dims(spec_graph, "hf", fake, f"{graph.path}: sizes.{size}")
    dims.update({k: v for k, v in meta.items()})
    return dims


def match_quant(
    graph: ModelGraph, dtypes: dict[str, set[str]], source: str, want: str | None = None
) -> QuantCombo:
    """The first combo (YAML order) admitting every matrix/embedding storage type found in the file."""
    candidates = [graph.quant(want)] if want else list(graph.quants.values())
    for combo in candidates:
        if all(types <= set(combo.allowed(key)) for key, types in dtypes.items()):
            return combo
    found = "; ".join(f"{k}: {'|'.join(sorted(v))}" for k, v in sorted(dtypes.items()))
    listed = "\n  ".join(c.describe() for c in graph.quants.values())
    what = f"quant combo {want!r}" if want else "any quant combo"
    raise MemraError(
        f"{source}: tensor types ({found}) match {what} of family {graph.family} ({graph.path}). "
        f"Supported combos:\n  {listed}",
        code="unsupported_quant",
    )


def _check_shape(model: LoadedModel, key: str, layer: int | None) -> None:
    spec = model.graph.tensors[key]
    if spec.shape is None:
        return
    want = tuple(int(evaluate(s, model.dims)) for s in spec.shape)
    info = model.info(key, layer)
    if tuple(info.shape) != want:
        raise MemraError(
            f"{model.path}: tensor {model.file_name(key, layer)} has shape {tuple(info.shape)}, "
            f"expected {want} ({key}: {list(spec.shape)})",
            code="invalid_model",
        )


def load_model(path: str | Path, family: str | None = None, quant: str | None = None) -> LoadedModel:
    """Open ``path`` (HF directory or .gguf) and bind it to its family graph."""
    from engine.weights import open_weights

    path = Path(path)
    weights = open_weights(path)
    meta = weights.metadata
    fmt = "gguf" if weights.format == "gguf" else "hf"
    source = str(weights.files[0] if fmt == "gguf" else path / "config.json")
    if family:
        graph = load_family(family)
    elif fmt == "gguf":
        arch = meta.get("general.architecture")
        if not arch:
            raise MemraError(f"{source}: GGUF metadata has no general.architecture", code="invalid_model")
        graph = family_for_architecture("gguf", arch)
    else:
        archs = meta.get("architectures") or []
        if not archs:
            raise MemraError(f"{source}: missing field 'architectures'", code="invalid_model")
        graph = family_for_architecture("hf", archs[0])

    def file_of(key: str, layer: int | None = None) -> str | None:
        return graph.tensors[key].file_name(
            fmt, 0 if graph.tensors[key].per_layer and layer is None else layer
        )

    def has_tensor(key: str) -> bool:
        name = file_of(key)
        return bool(name) and weights.has(name)

    def tensor_shape(key: str):
        name = file_of(key)
        return tuple(weights.info(name).shape) if name and weights.has(name) else None

    dims = resolve_dims(graph, fmt, meta, source, tensor_shape=tensor_shape, has_tensor=has_tensor)
    model = LoadedModel(
        graph=graph,
        fmt=fmt,
        dims=dims,
        rope_style=graph.rope_style[fmt],
        quant=None,  # type: ignore[arg-type]
        weights=weights,
        path=path,
        tensor_dtypes={},
    )
    found: dict[str, set[str]] = {}
    for key, spec in graph.tensors.items():
        layers = list(model.layer_range()) if spec.per_layer else [None]
        for layer in layers:
            if not model.has(key, layer):
                if spec.optional or spec.pattern(fmt) is None:
                    continue
                if key == "lm_head" and spec.tied_to and model.has(spec.tied_to, layer):
                    continue
                raise MemraError(
                    f"{model.path}: tensor {spec.file_name(fmt, layer)!r} ({key}) is missing",
                    code="invalid_model",
                )
            _check_shape(model, key, layer)
            dtype = model.info(key, layer).dtype
            model.tensor_dtypes.setdefault(key, dtype)
            if layer is not None:
                model.tensor_dtypes[f"{key}@{layer}"] = dtype
            if spec.kind != "vector" and model.file_name(key, layer) == spec.file_name(fmt, layer):
                found.setdefault(key, set()).add(dtype)
    model.quant = match_quant(graph, found, source, quant)
    return model
