"""A wheel built from the repo carries kernels/, models/ and device_profiles/ and works outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_carries_data_and_works_outside_checkout(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{build.stderr[-3000:]}")
    (wheel,) = tmp_path.glob("memra-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "engine/_data/models/llama.yaml",
        "engine/_data/models/qwen3.yaml",
        "engine/_data/models/gemma3.yaml",
        "engine/_data/device_profiles/h200.yaml",
    ):
        assert needed in names, needed
    assert any(n.startswith("engine/_data/kernels/") and n.endswith(".cu.j2") for n in names)
    assert "engine/cli.py" in names and "engine/server/__init__.py" in names
    for page in ("index.html", "chat.js", "chat.css"):  # the web chat page ships in the package
        assert f"engine/server/static/{page}" in names, page
    assert "engine/spec/accept.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import engine, engine.paths as p, engine.graph as g, engine.profile as pr;"
        f"assert str(p.models_dir()).startswith({str(site)!r}), p.models_dir();"
        "print(sorted(g.all_families()), len(pr.all_profiles()), len(list(p.kernels_dir().glob('*.cu.j2'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    families = sorted(f.stem for f in (ROOT / "models").glob("*.yaml"))
    assert f"{families} 9" in out.stdout  # every family of models/ ships
