"""Model-family DSL: load and validate models/<family>.yaml into a ModelGraph.

A family file names its dims (where to read each from config.json or GGUF metadata), its tensors
(name patterns for both formats, kind, expected shape, stacks such as a MoE layer's experts), its op
graph (ops inside a repeat may run only in the layers where a ``when`` predicate holds), its quant
combos and its known sizes. ``extends:`` derives a family from another with a small delta
(engine.graph_extends); the dims and tensors sections are engine.graph_specs', expressions are
engine.dsl_expr's. Every problem is a ConfigError naming the file and key path. Must not import
numpy or CUDA: this is pure configuration (the storage types are engine.storage's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine import dsl_expr, paths
from engine.graph_extends import merge_parent as _merge_parent
from engine.graph_specs import FORMATS, DimSpec, TensorSpec, as_list, names_in, parse_dims, parse_tensors
from engine.ops import OPS
from engine.schema import Field, ListOf, MapOf, OneOf, fail, load_yaml, validate
from engine.storage import FILE_TYPES
from engine.types import ConfigError, MemraError

LAYER_INDEX = "i"  # the layer index's name in a `when` predicate
ROPE_STYLES = ("neox", "interleaved")


# The op vocabulary lives in engine.ops (one module per op family, each op with its reference).

GRAPH_INPUTS = ("tokens",)
GRAPH_OUTPUT = "logits"
# The MTP sub-graph's inputs: the tokens after the hidden states' positions, and the hidden states
MTP_INPUTS = ("tokens", "hidden")


@dataclass(frozen=True)
class Op:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    attrs: dict[str, str] = field(default_factory=dict)
    # per-layer predicate (an expression over dims, `predicates` and the layer index `i`): the op
    # runs in the layers where it is true; None runs it in every layer
    when: str | None = None

    def __hash__(self) -> int:
        return hash(
            (self.op, self.inputs, self.outputs, self.weights, tuple(sorted(self.attrs.items())), self.when)
        )


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
class MtpGraph:
    """A family's multi-token-prediction head (``mtp:`` in the YAML; engine.spec.mtp_head runs it).

    ``graph`` reads ``tokens`` (token t+1) and ``hidden`` (the main graph's value ``hidden_from`` at
    position t) and produces ``logits`` (the draft for t+2) and ``hidden_out``, the value fed back
    as ``hidden`` for the next draft. Its per-layer ops repeat over ``layers`` (a dim)."""

    graph: tuple[Op | Repeat, ...]
    hidden_from: str
    hidden_out: str
    layers: str


@dataclass(frozen=True)
class ModelGraph:
    family: str
    path: Path
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    dims: dict[str, DimSpec]
    tensors: dict[str, TensorSpec]
    rope_style: dict[str, str]
    graph: tuple[Op | Repeat, ...]
    quants: dict[str, QuantCombo]
    sizes: dict[str, dict[str, Any]]
    predicates: dict[str, str] = field(default_factory=dict)
    #: config.json keys that change the math, with the values this family implements (checked on load)
    hf_expect: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: the multi-token-prediction head (speculative decoding), None when the family has none
    mtp: MtpGraph | None = None
    #: activation values the graph reads that no op writes, {name: width expression}: the runner
    #: fills them (a graph derived from an MTP head, engine.spec.mtp_cuda); families have none
    inputs: dict[str, str] = field(default_factory=dict)
    #: decode numerics the family needs beyond the engine's defaults (``numerics`` in its YAML):
    #: ``exact_x``, the matrices whose decode GEMVs read x unquantised (no int8 q8x staging);
    #: ``f32_values``, activation values stored in f32, not bf16 (an f32 residual stream)
    numerics: dict[str, Any] = field(default_factory=dict)

    def op_runs(self, op: Op, dims: dict[str, Any], layer: int | None) -> bool:
        """Whether ``op`` runs in ``layer`` (its ``when`` predicate over ``dims``; always if it has none)."""
        if op.when is None or layer is None:
            return True
        try:
            return bool(dsl_expr.evaluate(op.when, _LayerScope(self, dims, layer)))
        except (IndexError, TypeError) as exc:  # a per-layer list dim shorter than `layers`, ...
            raise MemraError(
                f"{self.path}: layer {layer}: the `when` predicate {op.when!r} cannot be evaluated over "
                f"the model's dims ({type(exc).__name__}: {exc})",
                code="invalid_model",
            ) from None

    def layer_ops(self, dims: dict[str, Any], layer: int) -> list[Op]:
        """The per-layer ops that run in ``layer``, in graph order."""
        return [op for op, per in self.ops() if per and self.op_runs(op, dims, layer)]

    def tensor_layers(self, dims: dict[str, Any]) -> dict[str, list[int]]:
        """Per-layer tensor key -> the layers in which some op reads it (as a weight or a tensor
        attribute). A per-layer tensor no op reads maps to every layer of its count dim."""
        layers = range(int(dims["layers"]))
        out: dict[str, list[int]] = {}
        runs = {id(op): [i for i in layers if self.op_runs(op, dims, i)] for op, per in self.ops() if per}
        for op, per in self.ops():
            if not per:
                continue
            names = list(op.weights) + [v for k, v in op.attrs.items() if OPS[op.op].attrs[k] == "tensor"]
            for name in names:
                out[name] = sorted(set(out.get(name, [])) | set(runs[id(op)]))
        for key, spec in self.tensors.items():
            if spec.per_layer and key not in out:
                out[key] = list(range(int(dims.get(spec.layers) or 0)))
        return out

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
    "predicates": Field(MapOf((str, type(None))), default={}),
    "quants": Field(MapOf(dict)),
    "sizes": Field(MapOf(dict), default={}),
    # a child's HF name-prefix rewrites ("model.": "model.language_model.") over every tensor
    "hf_rename": Field(MapOf(str), default={}),
    "hf_expect": Field(MapOf((list, type(None))), default={}),
    "mtp": Field((dict, type(None))),  # absent: inherited from an `extends` parent; null: none
    "numerics": Field(dict, default={}),
}


def _parse_op(raw: Any, file: Path, where: str, in_repeat: bool = False, names: frozenset = frozenset()) -> Op:
    if not isinstance(raw, dict) or "op" not in raw:
        raise fail(file, where, "expected a mapping with an `op` key")
    name = raw["op"]
    if name not in OPS:
        raise fail(file, f"{where}.op", f"unknown op {name!r}; known ops: {', '.join(OPS)}")
    d = OPS[name]
    allowed = {"op", "in", "out", "weight", "when"} | set(d.attrs)
    for key in raw:
        if key not in allowed:
            raise fail(
                file,
                f"{where}.{key}",
                f"unknown key for op {name}; expected one of: {', '.join(sorted(allowed))}",
            )
    inputs = tuple(as_list(raw.get("in")))
    outputs = tuple(as_list(raw.get("out")))
    weights = tuple(as_list(raw.get("weight")))
    for label, items in (("in", inputs), ("out", outputs), ("weight", weights)):
        for item in items:
            if not isinstance(item, str):
                raise fail(file, f"{where}.{label}", f"expected names (strings), got {item!r}")
    lo, hi = d.weights
    if not lo <= len(weights) <= hi or (d.weight_counts and len(weights) not in d.weight_counts):
        counts = " or ".join(map(str, d.weight_counts)) if d.weight_counts else f"{lo}..{hi}"
        raise fail(file, f"{where}.weight", f"op {name} takes {counts} weights, got {len(weights)}")
    if d.inputs is not None and len(inputs) != d.inputs:
        raise fail(file, f"{where}.in", f"op {name} takes {d.inputs} input(s), got {len(inputs)}")
    want_out = d.outputs if d.outputs is not None else len(weights)
    if len(outputs) != want_out:
        raise fail(file, f"{where}.out", f"op {name} produces {want_out} output(s), got {len(outputs)}")
    attrs = {k: raw[k] for k in d.attrs if k in raw}
    for k, v in attrs.items():
        if not isinstance(v, str):
            raise fail(file, f"{where}.{k}", f"expected a name (string), got {v!r}")
    when = raw.get("when")
    if when is not None:
        if not in_repeat:
            raise fail(file, f"{where}.when", "a `when` predicate needs a per-layer op (inside a repeat)")
        if not isinstance(when, str):
            raise fail(file, f"{where}.when", f"expected an expression (string), got {when!r}")
        for ident in names_in(when, file, f"{where}.when"):
            if ident not in names:
                raise fail(file, f"{where}.when", f"{ident!r} is not a dim, a predicate or `{LAYER_INDEX}`")
    return Op(name, inputs, outputs, weights, attrs, when)


def _parse_graph(
    raw: list,
    file: Path,
    dims: dict,
    tensors: dict,
    predicates: dict | None = None,
    *,
    key: str = "graph",
    inputs: tuple[str, ...] = GRAPH_INPUTS,
) -> tuple[tuple[Op | Repeat, ...], dict[str, str | None]]:
    """The graph's nodes, and each value it produces -> the ``when`` of its producer (_check_dataflow)."""
    names = frozenset(dims) | frozenset(predicates or {}) | {LAYER_INDEX}
    nodes: list[Op | Repeat] = []
    if not isinstance(raw, list) or not raw:
        raise fail(file, key, "expected a non-empty list of ops")
    for n, item in enumerate(raw):
        where = f"{key}[{n}]"
        if isinstance(item, dict) and "repeat" in item:
            extra = set(item) - {"repeat", "body"}
            if extra:
                raise fail(
                    file, f"{where}.{sorted(extra)[0]}", "unknown key; a repeat has `repeat` and `body`"
                )
            if item["repeat"] not in dims:
                raise fail(file, f"{where}.repeat", f"{item['repeat']!r} is not a dim of this family")
            body = tuple(
                _parse_op(op, file, f"{where}.body[{j}]", True, names)
                for j, op in enumerate(item.get("body") or [])
            )
            if not body:
                raise fail(file, f"{where}.body", "a repeat needs a non-empty body")
            nodes.append(Repeat(item["repeat"], body))
        else:
            nodes.append(_parse_op(item, file, where))
    return tuple(nodes), _check_dataflow(nodes, file, tensors, dims, key=key, inputs=inputs)


def _complementary(a: str, b: str) -> bool:
    """Whether predicates ``a`` and ``b`` are ``p`` and ``not p`` (so every layer runs one of them)."""
    a, b = " ".join(a.split()), " ".join(b.split())
    return a in (f"not {b}", f"not ({b})") or b in (f"not {a}", f"not ({a})")


def _check_dataflow(
    nodes: list[Op | Repeat],
    file: Path,
    tensors: dict[str, TensorSpec],
    dims: dict,
    *,
    key: str = "graph",
    inputs: tuple[str, ...] = GRAPH_INPUTS,
) -> dict[str, str | None]:
    """Check that every value is produced before it is read; return value -> the `when` of the op
    producing it (None: produced in every layer / unconditionally)."""
    # value -> the `when` of the op that first produced it (None: produced in every layer); a value
    # only some layers produce may be read only by ops with the same predicate. Ops under `p` and
    # `not p` (Gemma's sliding and full attention) together produce it in every layer.
    defined: dict[str, str | None] = dict.fromkeys(inputs)
    for n, node in enumerate(nodes):
        ops = node.body if isinstance(node, Repeat) else (node,)
        prefix = f"{key}[{n}]" + (".body" if isinstance(node, Repeat) else "")
        for j, op in enumerate(ops):
            where = f"{prefix}[{j}]" if isinstance(node, Repeat) else prefix
            for name in op.inputs:
                if name not in defined:
                    raise fail(file, f"{where}.in", f"value {name!r} is used before any op produces it")
                if defined[name] is not None and defined[name] != op.when:
                    raise fail(
                        file,
                        f"{where}.in",
                        f"value {name!r} is produced only when {defined[name]!r} but read by an op that "
                        f"runs when {op.when or 'always'!r}",
                    )
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
            for out in op.outputs:
                prev = defined.get(out, op.when)
                if op.when is None or (prev is not None and _complementary(prev, op.when)):
                    defined[out] = None
                elif out not in defined:
                    defined[out] = op.when
    if GRAPH_OUTPUT not in defined:
        raise fail(file, key, f"the graph never produces {GRAPH_OUTPUT!r}")
    return defined


def _parse_mtp(raw: dict, file: Path, dims: dict, tensors: dict, made: dict[str, str | None]) -> MtpGraph:
    """The ``mtp:`` section: {hidden_from, hidden_out, graph} (one repeat over a dim); ``made``: the
    values the main graph produces (``_parse_graph``)."""
    allowed = {"hidden_from", "hidden_out", "graph"}
    for k in raw:
        if k not in allowed:
            raise fail(file, f"mtp.{k}", f"unknown key; expected one of: {', '.join(sorted(allowed))}")
    for k in allowed:
        if k not in raw:
            raise fail(file, f"mtp.{k}", "required key is missing")
    graph, mtp_made = _parse_graph(raw["graph"], file, dims, tensors, key="mtp.graph", inputs=MTP_INPUTS)
    repeats = [n for n in graph if isinstance(n, Repeat)]
    if len(repeats) != 1:
        raise fail(file, "mtp.graph", f"expected exactly one repeat (the MTP layers), got {len(repeats)}")
    src = raw["hidden_from"]
    if not isinstance(src, str) or src not in made or made[src] is not None or src in GRAPH_INPUTS:
        raise fail(file, "mtp.hidden_from", f"{src!r} is not a value the main graph produces in every layer")
    out = raw["hidden_out"]
    if not isinstance(out, str) or out not in mtp_made or out in MTP_INPUTS:
        raise fail(file, "mtp.hidden_out", f"{out!r} is not a value the mtp graph produces")
    return MtpGraph(graph, src, out, repeats[0].count)


def _parse_quants(raw: dict, file: Path, tensors: dict) -> dict[str, QuantCombo]:
    combos: dict[str, QuantCombo] = {}
    for name, spec in raw.items():
        where = f"quants.{name}"
        if "default" not in spec:
            raise fail(file, f"{where}.default", "required key is missing")
        per: dict[str, tuple[str, ...]] = {}
        default: tuple[str, ...] = ()
        for key, value in spec.items():
            types = tuple(as_list(value))
            for t in types:
                if t not in FILE_TYPES:
                    raise fail(
                        file,
                        f"{where}.{key}",
                        f"unknown storage type {t!r}; expected one of {', '.join(FILE_TYPES)}",
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


class _LayerScope(dict):
    """Names a ``when`` predicate sees at one layer: the dims, ``i`` and the family's predicates."""

    def __init__(self, graph: ModelGraph, dims: dict[str, Any], layer: int):
        super().__init__()
        self._graph, self._dims, self._layer = graph, dims, layer

    def __contains__(self, key: object) -> bool:
        return key == LAYER_INDEX or key in self._graph.predicates or key in self._dims

    def __getitem__(self, key: str) -> Any:
        if key == LAYER_INDEX:
            return self._layer
        if key in self._graph.predicates:
            return dsl_expr.evaluate(self._graph.predicates[key], self)
        return self._dims[key]


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
        rename, raw = raw["hf_rename"], _merge_parent(raw, parent_raw, file)
        for spec in raw["tensors"].values():  # the child's hf_rename applies to every tensor
            for old, new in rename.items():
                if str(spec.get("hf", "")).startswith(old):
                    spec["hf"] = new + spec["hf"][len(old) :]
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
    dims = parse_dims(raw["dims"], file)
    tensors = parse_tensors(raw["tensors"], file, dims)
    predicates = {k: v for k, v in (raw.get("predicates") or {}).items() if v is not None}
    pnames = frozenset(dims) | frozenset(predicates) | {LAYER_INDEX}
    for pname, expr in predicates.items():
        if pname in dims or pname == LAYER_INDEX:
            raise fail(file, f"predicates.{pname}", "a predicate name must differ from every dim and `i`")
        for ident in names_in(expr, file, f"predicates.{pname}"):
            if ident not in pnames or ident == pname:
                raise fail(file, f"predicates.{pname}", f"{ident!r} is not a dim, another predicate or `i`")
    graph, made = _parse_graph(raw["graph"], file, dims, tensors, predicates)
    mtp = _parse_mtp(raw["mtp"], file, dims, tensors, made) if raw.get("mtp") else None
    quants = _parse_quants(raw["quants"], file, tensors)
    numerics = _parse_numerics(raw.get("numerics") or {}, file, tensors)
    for size, values in raw["sizes"].items():
        for k in values:
            if k not in dims:
                raise fail(file, f"sizes.{size}.{k}", f"{k!r} is not a dim of this family")
    return ModelGraph(
        family=raw["family"],
        path=file,
        hf_architectures=tuple(raw["matches"]["hf_architectures"]),
        gguf_architectures=tuple(raw["matches"]["gguf_architectures"]),
        dims=dims,
        tensors=tensors,
        rope_style=dict(raw["rope_style"]),
        graph=graph,
        quants=quants,
        sizes=dict(raw["sizes"]),
        predicates=predicates,
        hf_expect={k: tuple(v) for k, v in (raw.get("hf_expect") or {}).items() if v is not None},
        mtp=mtp,
        numerics=numerics,
    )


def _parse_numerics(raw: dict, file: Path, tensors: dict[str, TensorSpec]) -> dict[str, Any]:
    """The ``numerics`` key: ``exact_x`` (matrix tensor keys) and ``f32_values`` (activation value
    names; the plan checks that only ops with an f32 form touch them)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in ("exact_x", "f32_values"):
            raise fail(file, f"numerics.{key}", "unknown key; expected one of: exact_x, f32_values")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(file, f"numerics.{key}", "expected a list of names")
        for t in value if key == "exact_x" else ():
            if t not in tensors or tensors[t].kind != "matrix":
                raise fail(file, "numerics.exact_x", f"{t!r} is not a matrix tensor of this family")
        out[key] = tuple(value)
    return out


def all_families(root: Path | None = None) -> dict[str, ModelGraph]:
    root = root or paths.models_dir()
    return {p.stem: load_family(p.stem, root) for p in sorted(Path(root).glob("*.yaml"))}


def family_for_architecture(fmt: str, arch: str, root: Path | None = None) -> ModelGraph:
    """The family whose ``matches`` lists this HF architecture / GGUF general.architecture."""
    for g in all_families(root).values():
        if arch in (g.hf_architectures if fmt == "hf" else g.gguf_architectures):
            return g
    raise ConfigError(f"no model family in {root or paths.models_dir()} supports {fmt} architecture {arch!r}")
