"""Safe evaluation of the model DSL's expressions: dim formulas, tensor shapes and per-layer op predicates.

An expression is Python syntax restricted to names, int/float/str/bool constants, lists, tuples,
``+ - * // % **`` (an exponent at most 64 in size), unary ``-`` and ``not``, comparisons (``== != < <= > >= in not in``), ``and``/``or``,
``a if c else b`` and subscripts (``layer_types[i]``). Nothing else parses: no calls, attributes
or lambdas. Must not import anything from engine (graph, model and plan import this).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


def parse(expr: str) -> ast.Expression:
    """Parse ``expr``; raises SyntaxError, or ValueError naming the first element outside the language.
    Cached: launch grids are dim expressions evaluated for every new step shape the runner binds, so
    the returned tree is shared and must not be mutated."""
    return _parse(str(expr))


@lru_cache(maxsize=4096)
def _parse(expr: str) -> ast.Expression:
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ValueError(f"unsupported expression element {type(node).__name__} in {expr!r}")
        if isinstance(node, ast.BinOp) and type(node.op) not in _BINOPS:
            raise ValueError(f"unsupported operator {type(node.op).__name__} in {expr!r}")
        if isinstance(node, ast.Compare) and any(type(o) not in _CMPOPS for o in node.ops):
            raise ValueError(f"unsupported comparison in {expr!r}")
    return tree


_ALLOWED = (
    ast.Expression,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.BinOp,
    ast.UnaryOp,
    ast.USub,
    ast.Not,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.Compare,
    ast.IfExp,
    ast.Subscript,
    ast.List,
    ast.Tuple,
    *_BINOPS,
    *_CMPOPS,
)


def names_in(expr: str) -> set[str]:
    """The names an expression reads (raises like ``parse``)."""
    return {n.id for n in ast.walk(parse(expr)) if isinstance(n, ast.Name)}


def evaluate(expr: str, values: Mapping[str, Any]) -> Any:
    """Evaluate ``expr`` over ``values`` (names -> values). A name missing from ``values`` raises
    KeyError(name); an element outside the language raises ValueError."""

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise KeyError(node.id)
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:  # no 10 ** 10 ** 10 from a YAML file
                raise ValueError(f"exponent {right} too large in {expr!r}")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not walk(node.operand)
        if isinstance(node, ast.BoolOp):
            if isinstance(node.op, ast.And):
                return all(walk(v) for v in node.values)
            return any(walk(v) for v in node.values)
        if isinstance(node, ast.Compare):
            left = walk(node.left)
            for op, comp in zip(node.ops, node.comparators, strict=True):
                right = walk(comp)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return walk(node.body) if walk(node.test) else walk(node.orelse)
        if isinstance(node, ast.Subscript):
            return walk(node.value)[walk(node.slice)]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [walk(e) for e in node.elts]
        raise ValueError(f"unsupported expression element {ast.dump(node)} in {expr!r}")

    return walk(parse(expr))
