"""The WeightSource contract shared by the safetensors and GGUF readers: names, infos, raw bytes.

Must not import CUDA, the model graph or the tokenizer; only numpy, engine.quant and engine.types.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import quant
from engine.types import MemraError


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header facts. ``shape`` is numpy/PyTorch row-major ([out, in] for a linear)."""

    name: str
    dtype: str  # one of engine.storage.BLOCK_SIZES
    shape: tuple[int, ...]
    nbytes: int


class WeightSource:
    """A model checkpoint opened read-only and memory-mapped.

    Subclasses fill ``format``, ``path``, ``files``, ``metadata``, ``_infos`` and ``_where`` (name ->
    the file, byte offset and byte count of its bytes). ``raw`` never copies; ``array`` and
    ``dequantize`` build on it.

    Footprint: a mapped file's pages count in the process's resident set once touched. A runner
    that copies the weights to a device calls ``evict(name)`` after each copy (the pages leave the
    resident set, so the peak stays near one tensor) and ``close()`` at the end (the files are
    unmapped once no view is left). Both are safe at any time: a later ``raw`` maps the file again.
    """

    format: str
    path: Path
    files: list[Path]
    metadata: Mapping[str, Any]
    _infos: dict[str, TensorInfo]
    _where: dict[str, tuple[Path, int, int]]
    _maps: dict[Path, np.memmap]  # our own maps of the files, so close() can let them go

    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def has(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise MemraError(
                f"{self.path}: no tensor named {name!r} ({len(self._infos)} tensors in the checkpoint)"
            ) from None

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name`` (the shard, for a split checkpoint): for error messages."""
        return self._where[name][0] if name in self._where else self.path

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a 1-D uint8 memory-mapped view (no copy)."""
        mm, off, n = self._mapped(name)
        return mm[off : off + n]

    def array(self, name: str) -> np.ndarray:
        """f32/f16 as their numpy dtype, bf16 as uint16 raw bits, in row-major shape; quantised -> MemraError."""
        info = self.info(name)
        dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}.get(info.dtype)
        if dt is None:
            raise MemraError(f"{self.path}: tensor {name!r} is {info.dtype}; use dequantize() or raw()")
        return self.raw(name).view(dt).reshape(info.shape)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor decoded to float32 in row-major shape (a new array)."""
        info = self.info(name)
        return quant.dequantize(self.raw(name), info.dtype, info.shape)

    def _mapped(self, name: str) -> tuple[np.memmap, int, int]:
        """(the file's memory map, byte offset, byte count) of tensor ``name``."""
        self.info(name)
        f, off, n = self._where[name]
        mm = self._maps.get(f)
        if mm is None:
            mm = self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        return mm, off, n

    def file_ranges(self, name: str) -> list[tuple[Path, int, int]]:
        """(file, byte offset, byte count) ranges whose concatenation is tensor ``name``'s stored
        bytes, for a reader that copies them without mapping the file (engine.upload)."""
        self.info(name)
        return [self._where[name]]

    def evict(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process's resident set (``MADV_DONTNEED`` on the
        read-only shared map: the data stays valid and is read again from the page cache if a view
        is used later). A no-op where the platform has no ``madvise``."""
        mm, off, n = self._mapped(name)
        m = getattr(mm, "_mmap", None)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if m is None or advice is None or n == 0 or m.closed:
            return
        page = mmap.PAGESIZE  # the maps start at file offset 0 (see the readers' raw)
        lo, hi = off // page * page, min(-(-(off + n) // page) * page, len(m))
        if hi > lo:
            m.madvise(advice, lo, hi - lo)

    def close(self) -> None:
        """Drop this source's references to its memory maps: a file is unmapped once no view of it
        is left. ``raw`` afterwards maps the file again (metadata stays readable)."""
        self._maps.clear()

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.path} {len(self._infos)} tensors>"
