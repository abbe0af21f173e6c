"""Docs that must stay true to the code: the env-var table, the op table and the module structure page."""

from __future__ import annotations

import re
from pathlib import Path

from engine import env

ROOT = Path(__file__).resolve().parent.parent


def test_flags_doc_lists_every_env_var():
    text = (ROOT / "docs" / "flags.md").read_text()
    documented = set(re.findall(r"^\| `(MEMRA_[A-Z_]+)`", text, flags=re.M))
    assert documented == set(env.REGISTRY), (documented ^ set(env.REGISTRY))


def test_dsl_doc_describes_every_op():
    from engine.ops import OPS

    text = (ROOT / "docs" / "dsl.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M))
    assert set(OPS) <= documented, f"docs/dsl.md's op table lacks {sorted(set(OPS) - documented)}"


def test_structure_doc_lists_every_module():
    text = (ROOT / "docs" / "structure.md").read_text()
    modules = {
        str(p.relative_to(ROOT)).replace("/", ".")[:-3]
        for p in (ROOT / "engine").rglob("*.py")
        if p.name != "__init__.py" and "_data" not in p.parts
    }
    missing = {m for m in modules if f"`{m}`" not in text}
    assert not missing, f"docs/structure.md does not describe: {sorted(missing)}"


def test_only_cuda_nvrtc_and_nccl_touch_the_driver_or_nccl():
    """engine.cuda (driver) and engine.nvrtc (compiler) import cuda-python; engine.nccl loads NCCL
    (through cuda.pathfinder only, never cuda.bindings); no other engine module loads NCCL, and no
    other module of engine, tools or tests (the GPU checks included) imports cuda-python."""
    users, nccl_users = [], []
    for top in ("engine", "tools", "tests"):
        for p in (ROOT / top).rglob("*.py"):
            if p.resolve() == Path(__file__).resolve():
                continue  # this check's own patterns
            src = p.read_text()
            name = str(p.relative_to(ROOT))
            if re.search(r"^\s*(from|import) cuda\b", src, flags=re.M) or "from cuda." in src:
                users.append(name)
            if top == "engine" and re.search(r"libnccl|load_nvidia_dynamic_lib\(\s*\"nccl|\bnccl[A-Z]\w*\(", src):
                nccl_users.append(name)
    assert sorted(users) == ["engine/cuda.py", "engine/nccl.py", "engine/nvrtc.py"], users
    assert nccl_users == ["engine/nccl.py"], nccl_users
    nccl_src = (ROOT / "engine" / "nccl.py").read_text()
    assert "cuda.bindings" not in nccl_src and not re.search(r"^\s*from engine", nccl_src, flags=re.M)
