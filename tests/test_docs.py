"""Docs that must stay true to the code: the env-var table and the module structure page."""

from __future__ import annotations

import re
from pathlib import Path

from engine import env

ROOT = Path(__file__).resolve().parent.parent


def test_flags_doc_lists_every_env_var():
    text = (ROOT / "docs" / "flags.md").read_text()
    documented = set(re.findall(r"^\| `(MEMRA_[A-Z_]+)`", text, flags=re.M))
    assert documented == set(env.REGISTRY), (documented ^ set(env.REGISTRY))


def test_structure_doc_lists_every_module():
    text = (ROOT / "docs" / "structure.md").read_text()
    modules = {
        str(p.relative_to(ROOT)).replace("/", ".")[:-3]
        for p in (ROOT / "engine").rglob("*.py")
        if p.name != "__init__.py" and "_data" not in p.parts
    }
    missing = {m for m in modules if f"`{m}`" not in text}
    assert not missing, f"docs/structure.md does not describe: {sorted(missing)}"


def test_only_two_modules_import_cuda_python():
    """engine.cuda and engine.nvrtc are the only cuda-python users: engine, tools and tests (the GPU
    checks included) reach the driver through them."""
    users = []
    for top in ("engine", "tools", "tests"):
        for p in (ROOT / top).rglob("*.py"):
            src = p.read_text()
            if re.search(r"^\s*(from|import) cuda\b", src, flags=re.M):
                users.append(str(p.relative_to(ROOT)))
    assert sorted(users) == ["engine/cuda.py", "engine/nvrtc.py"], users
