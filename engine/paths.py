"""Where memra's data directories and caches live; the one module that resolves paths.

In a checkout, ``kernels/``, ``models/`` and ``device_profiles/`` sit at the repository root; in an
installed wheel they are carried inside the package as ``engine/_data/<dir>``. Tests redirect the
cache with ``MEMRA_CACHE_DIR``. Must not import CUDA.
"""

from __future__ import annotations

from pathlib import Path

from engine import env

_PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    checkout = _PACKAGE_DIR.parent / name
    if checkout.is_dir():
        return checkout
    installed = _PACKAGE_DIR / "_data" / name
    if installed.is_dir():
        return installed
    raise FileNotFoundError(f"memra data directory {name!r} not found (looked in {checkout} and {installed})")


def kernels_dir() -> Path:
    return _data_dir("kernels")


def models_dir() -> Path:
    return _data_dir("models")


def profiles_dir() -> Path:
    return _data_dir("device_profiles")


def cache_dir() -> Path:
    """Root of memra's caches (cubins, downloaded default model): ``$MEMRA_CACHE_DIR`` or ~/.cache/memra."""
    return Path(env.MEMRA_CACHE_DIR.get()).expanduser()
