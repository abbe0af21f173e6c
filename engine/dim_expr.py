"""The dim expression language of the model-family YAML: ``hidden // heads``, ``hidden ** 0.5``,
``query_pre_attn_scalar ** -0.5``. Names, numbers, unary minus, + - * // ** and nothing else (no
calls, no attributes), evaluated by walking the AST. Must not import anything from engine but
engine.schema (for the file-and-key errors).
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path
from typing import Any

from engine.schema import fail

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}


def names_in(expr: str, file: Path, where: str) -> set[str]:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise fail(file, where, f"invalid expression {expr!r}") from exc
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def evaluate(expr: str, values: dict[str, Any]) -> Any:
    """Evaluate a dim expression (``hidden // heads``, ``hidden ** 0.5``): names, numbers, unary minus,
    + - * // **, nothing else."""

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
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:  # no 10 ** 10 ** 10 from a YAML file
                raise ValueError(f"exponent {right} too large in {expr!r}")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported expression element {ast.dump(node)} in {expr!r}")

    return walk(ast.parse(str(expr), mode="eval"))
