"""``extends:`` for the model-family DSL: apply a child family's delta (merged keys and
``graph_edits``) to its parent's raw YAML before engine.graph validates the result.

Works on plain dicts/lists and raises ConfigError through engine.schema.fail. Must not import
engine.graph (graph imports this), numpy or CUDA.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from engine.graph_specs import as_list
from engine.schema import fail


def merge_parent(child: dict, parent: dict, file: Path) -> dict:
    """Apply a child family's delta to its parent's raw YAML."""
    merged = copy.deepcopy(parent)
    merged["family"] = child["family"]
    for key in ("description", "matches", "rope_style", "quants", "sizes", "mtp", "numerics"):
        if key in child:
            merged[key] = child[key]
    for key in ("dims", "tensors", "predicates", "hf_expect"):
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
            pattern, new = edit["after"], as_list(edit["insert"])
        elif keys == {"replace", "with"}:
            pattern, new = edit["replace"], as_list(edit["with"])
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
