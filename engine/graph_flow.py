"""The model-family DSL's op list: parse ops, repeats and per-layer ``choose`` blocks, and check
the dataflow (every input produced first, per-layer tensors only inside a repeat, logits produced).

Errors are ConfigErrors naming the file and the key path. Must not import numpy or CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.graph_nodes import GRAPH_INPUTS, GRAPH_OUTPUT, Choose, Op, Repeat, TensorSpec
from engine.ops import OPS
from engine.schema import fail


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


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


def parse_graph(raw: list, file: Path, dims: dict, tensors: dict) -> tuple[Op | Repeat, ...]:
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
                _parse_body_item(op, file, f"{where}.body[{j}]", dims)
                for j, op in enumerate(item.get("body") or [])
            )
            if sum(isinstance(b, Choose) for b in body) > 1:
                raise fail(file, f"{where}.body", "a repeat takes at most one `choose`")
            if not body:
                raise fail(file, f"{where}.body", "a repeat needs a non-empty body")
            nodes.append(Repeat(item["repeat"], body))
        else:
            nodes.append(_parse_op(item, file, where))
    _check_dataflow(nodes, file, tensors)
    return tuple(nodes)


def _parse_body_item(raw: Any, file: Path, where: str, dims: dict) -> Op | Choose:
    """One item of a repeat body: an op, or ``{choose: <list dim>, cases: {block type: [ops]}}``."""
    if not (isinstance(raw, dict) and "choose" in raw):
        return _parse_op(raw, file, where)
    extra = set(raw) - {"choose", "cases"}
    if extra:
        raise fail(file, f"{where}.{sorted(extra)[0]}", "unknown key; a choose has `choose` and `cases`")
    dim = raw["choose"]
    if dim not in dims or dims[dim].type != "list":
        raise fail(file, f"{where}.choose", f"{dim!r} is not a list dim of this family")
    cases = raw.get("cases")
    if not isinstance(cases, dict) or not cases:
        raise fail(file, f"{where}.cases", "expected a mapping of block type -> list of ops")
    parsed: dict[str, tuple[Op, ...]] = {}
    for name, ops in cases.items():
        if not isinstance(ops, list) or not ops:
            raise fail(file, f"{where}.cases.{name}", "expected a non-empty list of ops")
        parsed[str(name)] = tuple(_parse_op(op, file, f"{where}.cases.{name}[{j}]") for j, op in enumerate(ops))
    return Choose(dim, parsed)


def _check_dataflow(nodes: list[Op | Repeat], file: Path, tensors: dict[str, TensorSpec]) -> None:
    defined = set(GRAPH_INPUTS)
    for n, node in enumerate(nodes):
        if isinstance(node, Repeat):
            for j, item in enumerate(node.body):
                where = f"graph[{n}].body[{j}]"
                if not isinstance(item, Choose):
                    _check_op(item, where, True, defined, file, tensors)
                    continue
                after: set[str] | None = None
                for case, ops in item.cases.items():
                    scope = set(defined)
                    for m, op in enumerate(ops):
                        _check_op(op, f"{where}.cases.{case}[{m}]", True, scope, file, tensors)
                    after = scope if after is None else after & scope
                defined |= after or set()  # what every case produces is defined after the choose
        else:
            _check_op(node, f"graph[{n}]", False, defined, file, tensors)
    if GRAPH_OUTPUT not in defined:
        raise fail(file, "graph", f"the graph never produces {GRAPH_OUTPUT!r}")


def _check_op(op: Op, where: str, in_repeat: bool, defined: set[str], file: Path, tensors: dict) -> None:
    """Check one op's inputs, weights and attributes against what is defined; add its outputs."""
    for name in op.inputs:
        if name not in defined:
            raise fail(file, f"{where}.in", f"value {name!r} is used before any op produces it")
    for w in op.weights:
        if w not in tensors:
            raise fail(file, f"{where}.weight", f"{w!r} is not a tensor of this family")
        if tensors[w].per_layer != in_repeat:
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
    defined.update(op.outputs)
