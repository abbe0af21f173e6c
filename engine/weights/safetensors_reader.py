"""Read a HF checkpoint directory (config.json + single or sharded safetensors), memory-mapped.

The safetensors header is parsed here (8-byte little-endian length + JSON) so bf16 needs no torch.
Must not import torch, CUDA or other engine modules beyond engine.weights.source/engine.types.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from engine.types import ConfigError, MemraError
from engine.weights.source import TensorInfo, WeightSource

_DTYPES = {"F32": ("f32", 4), "F16": ("f16", 2), "BF16": ("bf16", 2)}
_MAX_HEADER = 100 * 1024 * 1024


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise MemraError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: {what} is not valid JSON: {e}") from None


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse one .safetensors header; return (header dict, byte offset of the data section)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise MemraError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise MemraError(f"{path}: corrupt safetensors header (length {n} but file is {size} bytes)")
            blob = f.read(n)
    except OSError as e:
        raise MemraError(f"{path}: cannot read safetensors file: {e.strerror or e}") from None
    try:
        header = json.loads(blob)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise MemraError(f"{path}: corrupt safetensors header: {e}") from None
    return header, 8 + n


class SafetensorsSource(WeightSource):
    """A HF-layout directory. ``metadata`` is config.json (+ ``_generation_config`` if present)."""

    format = "safetensors"

    def __init__(self, directory: Path):
        self.path = directory
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise MemraError(f"{directory}: not a model directory (no config.json)")
        config = _read_json(cfg_path, "config.json")
        if not isinstance(config, dict):
            raise ConfigError(f"{cfg_path}: config.json must be a JSON object")
        gen = directory / "generation_config.json"
        if gen.is_file():
            config["_generation_config"] = _read_json(gen, "generation_config.json")
        self.metadata = config
        self.files = self._shard_files(directory)
        self._maps: dict[Path, np.memmap] = {}
        self._where: dict[str, tuple[Path, int, int]] = {}
        self._infos = {}
        for f in self.files:
            self._index_file(f)

    @staticmethod
    def _shard_files(directory: Path) -> list[Path]:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            data = _read_json(index, "model.safetensors.index.json")
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict):
                raise ConfigError(f"{index}: missing 'weight_map' object")
            files = [directory / name for name in dict.fromkeys(wm.values())]
        elif (directory / "model.safetensors").is_file():
            files = [directory / "model.safetensors"]
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise MemraError(f"{directory}: no model.safetensors or model.safetensors.index.json")
        for f in files:
            if not f.is_file():
                raise MemraError(f"{f}: shard listed in the index is missing")
        return files

    def _index_file(self, f: Path) -> None:
        header, data_start = read_header(f)
        size = f.stat().st_size
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = (
                    entry["dtype"],
                    tuple(int(s) for s in entry["shape"]),
                    entry["data_offsets"],
                )
            except (KeyError, TypeError, ValueError):
                raise MemraError(f"{f}: corrupt safetensors header entry for {name!r}") from None
            if dtype not in _DTYPES:
                raise MemraError(
                    f"{f}: tensor {name!r} has unsupported dtype {dtype} (supported: F32, F16, BF16)"
                )
            ours, width = _DTYPES[dtype]
            nbytes = int(np.prod(shape, dtype=np.int64)) * width
            if end - start != nbytes or start < 0:
                raise MemraError(
                    f"{f}: tensor {name!r} offsets {start}..{end} do not match shape {shape} {dtype}"
                )
            if data_start + end > size:
                raise MemraError(
                    f"{f}: truncated file: tensor {name!r} ends at byte {data_start + end} but the file has {size}"
                )
            if name in self._infos:
                raise MemraError(f"{f}: tensor {name!r} appears in more than one shard")
            self._infos[name] = TensorInfo(name, ours, shape, nbytes)
            self._where[name] = (f, data_start + start, nbytes)
