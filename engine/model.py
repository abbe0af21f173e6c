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

from engine import hf_config
from engine.dsl_expr import evaluate
from engine.graph import (
    DimSpec,
    ModelGraph,
    QuantCombo,
    family_for_architecture,
    load_family,
)
from engine.types import ConfigError, MemraError

_CASTS = {"int": int, "float": float, "bool": bool}
_COPY = {list: list, dict: dict}


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
        """The tensor as float32, with its family's load-time transform for this format applied
        (``plus_one``: 1 + w of a zero-centred norm; ``neg_exp``: -exp(A_log)), so every backend
        reads the form the ops compute with."""
        arr = self.weights.dequantize(self.file_name(tensor, layer))
        how = self.graph.tensors[tensor].transform.get(self.fmt)
        return apply_transform(arr, how) if how else arr

    def tensor_layers(self, tensor: str) -> list[int | None]:
        """The layers a tensor is expected in: [None] for a global tensor, else the layers where
        an op reading it runs (a hybrid's linear-attention weights only in its linear layers)."""
        if not self.graph.tensors[tensor].per_layer:
            return [None]
        return list(self.graph.tensor_layers(self.dims)[tensor])

    def weight_bytes(self) -> int:
        """Bytes of every tensor the graph reads once per token (the decode roofline numerator). A
        stacked (MoE expert) tensor counts the share a router picks per token: its ``top_k`` dim
        over the stack's dim."""
        total = 0
        seen: set[str] = set()
        top_k = next((o.attrs["top_k"] for o, _ in self.graph.ops() if "top_k" in o.attrs), None)
        for key, spec in self.graph.tensors.items():
            if spec.layers != "layers":
                continue  # not run per token by the graph (MTP)
            for layer in self.tensor_layers(key):
                if not self.has(key, layer):
                    continue
                name = self.file_name(key, layer)
                if name in seen or (key == "embed" and not self.dims.get("tie_embeddings")):
                    continue  # an untied embedding table is gathered, not streamed
                seen.add(name)
                nbytes = self.weights.info(name).nbytes
                if spec.stack and top_k:
                    nbytes = nbytes * int(self.dims[top_k]) // int(self.dims[spec.stack])
                total += nbytes
        return total


def apply_transform(arr, how: str):
    """A family tensor's load-time transform (engine.graph_specs.TENSOR_TRANSFORMS), in float32."""
    import numpy as np

    a = np.asarray(arr, dtype=np.float32)
    if how == "plus_one":
        return (a + np.float32(1.0)).astype(np.float32)
    if how == "neg_exp":
        return (-np.exp(a)).astype(np.float32)
    raise ConfigError(f"unknown tensor transform {how!r}")


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
        if fmt == "hf":  # every listed path, read and cross-checked by engine.hf_config
            keys = d.hf_keys
            found, value, path = hf_config.lookup_any(meta, keys, source, f"dim {d.name}")
            if found:
                return _cast(d, value, f"{source}: field {path!r} (dim {d.name})")
        else:  # GGUF metadata keys are flat
            keys = (d.gguf.replace("{arch}", arch),) if d.gguf else ()
            value = meta.get(keys[0]) if keys else None
            if value is None and keys and d.type == "mapping":  # {arch}.rope.scaling.type/factor
                value = {k[len(keys[0]) + 1 :]: meta[k] for k in list(meta) if k.startswith(keys[0] + ".")} or None
            if value is not None:
                return _cast(d, value, f"{source}: field {keys[0]!r} (dim {d.name})")
        key = keys[0] if keys else None
        if d.pattern:
            interval = int(get(d.pattern["interval"]))
            if interval < 1:
                raise MemraError(
                    f"{source}: {d.pattern['interval']} must be >= 1, got {interval}", code="invalid_model"
                )
            return [
                d.pattern["every"] if (i + 1) % interval == 0 else d.pattern["other"]
                for i in range(int(get("layers")))
            ]
        if fmt == "gguf" and d.gguf_from_missing and has_tensor is not None:
            if d.type == "list":  # the layers that lack a per-layer tensor
                return [i for i in range(int(get("layers"))) if not has_tensor(d.gguf_from_missing, i)]
            return not has_tensor(d.gguf_from_missing)
        if d.from_tensor and tensor_shape is not None:
            shape = tensor_shape(d.from_tensor[0])
            if shape is not None:
                return int(shape[d.from_tensor[1]])
        for has, default in ((fmt == "gguf" and d.has_gguf_default, d.gguf_default), (d.has_default, d.default)):
            if has:
                if isinstance(default, str) and d.type != "mapping":
                    return _eval(d, default)
                return _COPY.get(type(default), lambda v: v)(default)
        raise MemraError(
            f"{source}: missing field {key!r} (needed for dim {d.name!r} of family {graph.family})",
            code="invalid_model",
        )

    def _eval(d: DimSpec, expr: str) -> Any:
        try:
            return _cast(d, evaluate(expr, _LazyDims(get)), f"{graph.path}: dims.{d.name}")
        except KeyError as exc:
            raise ConfigError(f"{graph.path}: dims.{d.name}: {exc.args[0]!r} is not a dim") from exc

    def _cast(d: DimSpec, value: Any, where: str) -> Any:
        if d.type == "mapping":
            if value is not None and not isinstance(value, dict):
                raise MemraError(f"{where}: expected a mapping, got {value!r}", code="invalid_model")
            return value
        if d.type == "list":
            if not isinstance(value, (list, tuple)):
                raise MemraError(f"{where}: expected a list, got {value!r}", code="invalid_model")
            return list(value)
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

    def __init__(self, get):
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
    fake = {graph.dims[name].hf or name: value for name, value in meta.items()}
    dims = resolve_dims(graph, "hf", fake, f"{graph.path}: sizes.{size}")
    dims.update(meta)
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


def _block_type_note(model: LoadedModel, layer: int | None) -> str:
    """``" (its config says layer_types[3] = full_attention)"`` for a family with a pattern dim."""
    for name, d in model.graph.dims.items():
        if d.pattern and layer is not None and layer < len(model.dims.get(name) or ()):
            return f" (its config says {name}[{layer}] = {model.dims[name][layer]})"
    return ""


def _check_pattern_dims(model: LoadedModel, source: str) -> None:
    """A per-layer pattern dim (a hybrid's ``layer_types``) has one known name per layer."""
    n = int(model.dims["layers"])
    for name, d in model.graph.dims.items():
        if not d.pattern:
            continue
        types = model.dims[name]
        if len(types) != n:
            raise MemraError(f"{source}: {name} has {len(types)} entries but the model has {n} layers", code="invalid_model")
        known = (d.pattern["other"], d.pattern["every"])
        for i, t in enumerate(types):
            if t not in known:
                raise MemraError(
                    f"{source}: {name}[{i}] = {t!r} is not a block type of family {model.graph.family} "
                    f"({', '.join(known)})",
                    code="invalid_model",
                )


def _check_layer_pattern(model: LoadedModel, layers_of: dict[str, list[int]]) -> None:
    """No layer holds a tensor that none of its ops read (the file's layer pattern disagrees with
    its config): a one-line MemraError naming the layer and the config entry."""
    n = int(model.dims["layers"])
    for key, spec in model.graph.tensors.items():
        if not spec.per_layer or spec.layers != "layers":
            continue
        expected = set(layers_of[key])
        for i in range(n):
            fname = spec.file_name(model.fmt, i)
            if i not in expected and fname and model.weights.has(fname):
                raise MemraError(
                    f"{model.path}: layer {i} holds {fname!r} ({key}), which no op of that layer reads"
                    f"{_block_type_note(model, i)}: the checkpoint's layer pattern disagrees with its config",
                    code="invalid_model",
                )


def _check_shape(model: LoadedModel, key: str, layer: int | None) -> None:
    spec = model.graph.tensors[key]
    shape = spec.shape_for(model.fmt)
    if shape is None:
        return
    want = tuple(int(evaluate(s, model.dims)) for s in shape)
    info = model.info(key, layer)
    got = tuple(info.shape)
    if spec.kind == "vector":  # a 1-output linear is a vector stored [1, n] by HF, [n] by GGUF
        got, want = tuple(n for n in got if n != 1), tuple(n for n in want if n != 1)
    if got != want:
        name = model.file_name(key, layer)
        raise MemraError(
            f"{model.weights.file_of(name)}: tensor {name} has shape {tuple(info.shape)}, "
            f"expected {want} ({key}: {list(shape)}){_block_type_note(model, layer)}",
            code="invalid_model",
        )


def _add_stacks(model: LoadedModel, layers_of: dict[str, list[int]]) -> None:
    """Present every per-index (``{e}``) tensor family of the file as one stacked tensor, named by
    its pattern with ``{e}`` kept, through engine.weights.StackedSource. Raises MemraError naming the
    file and tensor when a member is missing or the file holds more members than the dim says."""
    from engine.weights import StackedSource

    stacked = [(k, t) for k, t in model.graph.tensors.items() if t.stack and "{e}" in (t.pattern(model.fmt) or "")]
    if not stacked:
        return
    src = model.weights = StackedSource(model.weights)
    for key, spec in stacked:
        count = int(model.dims[spec.stack])
        for layer in layers_of.get(key, []) if spec.per_layer else [None]:
            name = spec.file_name(model.fmt, layer) or ""
            extra = name.replace("{e}", str(count))
            if src.base.has(extra):
                field = model.graph.dims[spec.stack].hf or spec.stack
                raise MemraError(
                    f"{src.base.file_of(extra)}: tensor {extra!r} is beyond the {count} experts that "
                    f"config field {field!r} declares ({key}, dim {spec.stack})",
                    code="invalid_model",
                )
            src.add_stack(name, [name.replace("{e}", str(e)) for e in range(count)])


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

    def has_tensor(key: str, layer: int | None = None) -> bool:
        name = file_of(key, layer)
        return bool(name) and weights.has(name)

    def tensor_shape(key: str):
        name = file_of(key)
        return tuple(weights.info(name).shape) if name and weights.has(name) else None

    if fmt == "hf":
        hf_config.check_expected(meta, graph.hf_expect, source, graph.family)
    dims = resolve_dims(graph, fmt, meta, source, tensor_shape=tensor_shape, has_tensor=has_tensor)
    if "rope_scaling" in dims:
        dims["rope_scaling"] = hf_config.canonical_rope_scaling(dims["rope_scaling"])
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
    _check_pattern_dims(model, source)
    layers_of = graph.tensor_layers(dims)  # a tensor only some layers' ops read (`when`) is needed there
    _check_layer_pattern(model, layers_of)
    _add_stacks(model, layers_of)
    found: dict[str, set[str]] = {}
    for key, spec in graph.tensors.items():
        layers = layers_of[key] if spec.per_layer else [None]
        for layer in layers:
            if not model.has(key, layer):
                if spec.optional or spec.pattern(fmt) is None:
                    continue
                if key == "lm_head" and spec.tied_to and model.has(spec.tied_to, layer):
                    continue
                why = _block_type_note(model, layer)
                raise MemraError(
                    f"{model.path}: tensor {spec.file_name(fmt, layer)!r} ({key}) is missing{why}",
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
