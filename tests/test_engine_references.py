"""Every ``module.name`` that engine/, tools/ and tests/ read through an engine module they import
(``from engine import cuda`` ... ``cuda.alloc``; ``from engine import runner_bench as rb`` ...
``rb.run_all``) names something that module has. Much of that code runs only on a GPU machine
(tools/, tests/gpu/), so a helper renamed or removed on the CPU side would otherwise surface there
first. Likewise every name a ``from engine... import`` / ``from fixtures... import`` anywhere names.
Parsed with ``ast``: names rebound in the file (a parameter or variable of the same name) are left
out."""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _files() -> list[Path]:
    return sorted([*ROOT.glob("engine/**/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("tests/**/*.py")])


@functools.cache
def _parsed() -> list[tuple[Path, list[ast.AST]]]:
    """Every file with all the nodes of its tree (``ast.walk``'s order), parsed and walked once for
    both tests."""
    return [(path, list(ast.walk(ast.parse(path.read_text(), str(path))))) for path in _files()]


def _engine_modules(nodes: list[ast.AST]) -> dict[str, str]:
    """alias -> engine module for each ``from engine[.pkg] import mod [as alias]`` naming a module."""
    out: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "engine":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(full)
                except ImportError:
                    continue  # a function or class, not a module
                out[a.asname or a.name] = full
    return out


def _rebound(nodes: list[ast.AST]) -> set[str]:
    """Names the file also binds otherwise: parameters, assignment targets, loop and with targets."""
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def test_every_engine_module_attribute_read_exists():
    missing = []
    for path, nodes in _parsed():
        aliases = _engine_modules(nodes)
        for name in set(aliases) & _rebound(nodes):
            del aliases[name]
        for node in nodes:
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                mod = importlib.import_module(aliases[node.value.id])
                if isinstance(node.ctx, ast.Load) and not hasattr(mod, node.attr):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert not missing, "\n".join(missing)


def test_every_name_imported_from_engine_or_fixtures_exists():
    """``from engine.x import name`` / ``from fixtures.x import name`` anywhere (function-level
    imports of GPU-only tests and tools included) names something the module has, or a submodule."""
    missing = []
    for path, nodes in _parsed():
        for node in nodes:
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] not in ("engine", "fixtures"):
                continue
            mod = importlib.import_module(node.module)
            for a in node.names:
                if a.name == "*" or hasattr(mod, a.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{a.name}")
                except ImportError:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}")
    assert not missing, "\n".join(missing)
