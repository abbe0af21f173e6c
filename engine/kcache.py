"""On-disk cubin cache: ``<cache>/kernels/v<N>/<arch>/<entry>-<key16>.{cu,cubin,json}`` (the entry
name cut to ENTRY_FILE_CHARS).

Writes are atomic (temp file + rename) and the JSON metadata is written last, so a reader never
trusts a half-written entry; an entry whose cubin is missing, truncated or whose sha256 differs from
its metadata is a miss (and is rebuilt). The rendered ``.cu`` is kept beside the cubin for
inspection. Must not import CUDA.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from engine import paths

CACHE_FORMAT = 1
ENTRY_FILE_CHARS = 160  # the most of an entry name a cache file name carries


def cache_key(source: str, arch: str, options: tuple[str, ...], nvrtc_version: tuple[int, int]) -> str:
    """sha256 over the rendered source, arch, sorted options, NVRTC version and the cache format."""
    h = hashlib.sha256()
    for part in (
        f"memra-kcache-v{CACHE_FORMAT}",
        arch,
        "\0".join(sorted(options)),
        "{}.{}".format(*nvrtc_version),
    ):
        h.update(part.encode())
        h.update(b"\x00")
    h.update(source.encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class KernelCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else paths.cache_dir() / "kernels" / f"v{CACHE_FORMAT}"

    def _stem(self, arch: str, entry: str, key: str) -> Path:
        # a long entry name is cut (file names stop at 255 bytes, the temp file adds ~20): the key,
        # a hash of the source that holds the whole name, tells entries apart; the JSON keeps it
        return self.root / arch / f"{entry[:ENTRY_FILE_CHARS]}-{key[:16]}"

    def source_path(self, arch: str, entry: str, key: str) -> Path:
        return self._stem(arch, entry, key).with_suffix(".cu")

    def cubin_path(self, arch: str, entry: str, key: str) -> Path:
        return self._stem(arch, entry, key).with_suffix(".cubin")

    def load(self, arch: str, entry: str, key: str) -> bytes | None:
        """The cached cubin, or None on a miss (absent, truncated, corrupt, or another key)."""
        stem = self._stem(arch, entry, key)
        try:
            meta = json.loads(stem.with_suffix(".json").read_text())
            cubin = stem.with_suffix(".cubin").read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("key") != key or meta.get("size") != len(cubin):
            return None
        if hashlib.sha256(cubin).hexdigest() != meta.get("sha256"):
            return None
        return cubin

    def write_source(self, arch: str, entry: str, key: str, source: str) -> Path:
        path = self.source_path(arch, entry, key)
        _atomic_write(path, source.encode())
        return path

    def store(self, arch: str, entry: str, key: str, cubin: bytes, extra: dict | None = None) -> Path:
        stem = self._stem(arch, entry, key)
        _atomic_write(stem.with_suffix(".cubin"), cubin)
        meta = {
            "key": key,
            "entry": entry,
            "arch": arch,
            "size": len(cubin),
            "sha256": hashlib.sha256(cubin).hexdigest(),
        }
        meta.update(extra or {})
        _atomic_write(stem.with_suffix(".json"), json.dumps(meta, indent=1, sort_keys=True).encode())
        return stem.with_suffix(".cubin")

    def entries(self) -> list[Path]:
        return sorted(self.root.rglob("*.cubin")) if self.root.exists() else []
