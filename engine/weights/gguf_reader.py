"""Read single or split GGUF files through gguf.GGUFReader (memory-mapped) behind the WeightSource API.

Shapes are converted from GGUF's ``ne`` order (innermost first) to numpy row-major order.
Metadata values are converted to plain Python lazily, once per key (tokenizer arrays are large).
Must not import CUDA or engine modules beyond engine.weights.source/engine.storage/engine.types.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engine import storage
from engine.types import MemraError
from engine.weights.source import TensorInfo, WeightSource

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_files(path: Path) -> list[Path]:
    """All shards of a split GGUF given any one of them, in order; ``[path]`` for a plain file."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise MemraError(f"{path}: split GGUF is missing shard(s) {', '.join(missing)} in {path.parent}")
    return files


_U64 = struct.Struct("<Q")


class _Corrupt(Exception):
    """A bounds or format problem found while parsing, with the part of the file being read."""


def _checked_reader_class() -> type:
    """gguf.GGUFReader with every read bounds-checked and the field or tensor being parsed tracked,
    so a corrupt file is reported by name instead of as a numpy IndexError/reshape error."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        _where = "header"

        def _get(self, offset, dtype, count=1, override_order=None):
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            end = int(offset) + itemsize * int(count)
            if int(count) < 0 or end > len(self.data):
                raise _Corrupt(
                    f"{self._where}: needs bytes {int(offset)}..{end} but the file has {len(self.data)} "
                    f"(a length or count of {int(count)} is corrupt, or the file is truncated)"
                )
            return super()._get(offset, dtype, count, override_order)

        def _peek_name(self, offs: int, what: str) -> str:
            n = int(self._get(offs, np.uint64)[0])
            if n > 65536:
                raise _Corrupt(f"{what}: name length {n} is corrupt")
            return bytes(self._get(offs + 8, np.uint8, n)).decode("utf-8", "replace")

        def _get_field_parts(self, orig_offs, raw_type):
            # an array (a tokenizer's vocabulary, merges, token types: ~450k elements) read without
            # gguf's per-element numpy memmap views (seconds of a server's start): numbers as one
            # view, strings as slices of one memoryview of the map; the field's contents() is the
            # same list
            vt = gguf.GGUFValueType
            if int(raw_type) != vt.ARRAY or self.byte_order == "S":
                return super()._get_field_parts(orig_offs, raw_type)
            itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            if int(itype[0]) not in {v.value for v in vt}:  # gguf's own error for an unknown type
                return super()._get_field_parts(orig_offs, raw_type)
            sub = vt(int(itype[0]))
            nptype = self.gguf_scalar_to_np.get(sub)
            if nptype is not None:  # numbers (token types, scores): one view of them all, not one each
                vals = self._get(orig_offs + 12, nptype, int(alen[0]))
                n = len(vals)
                return 12 + int(vals.nbytes), [itype, alen, vals], [2] if n else [], [vt.ARRAY] + ([sub] if n else [])
            if sub != vt.STRING:  # (an array of arrays)
                return super()._get_field_parts(orig_offs, raw_type)
            buf = memoryview(self.data).cast("B")
            size = len(buf)
            parts: list[Any] = [itype, alen]
            idxs: list[int] = []
            offs = orig_offs + 12
            for i in range(int(alen[0])):
                if offs + 8 > size:
                    raise _Corrupt(f"{self._where}: string #{i} needs bytes {offs}..{offs + 8} but the file has {size}")
                end = offs + 8 + _U64.unpack_from(buf, offs)[0]
                if end > size:
                    raise _Corrupt(
                        f"{self._where}: string #{i} needs bytes {offs + 8}..{end} but the file has {size} "
                        "(a length is corrupt, or the file is truncated)"
                    )
                parts += (buf[offs : offs + 8], buf[offs + 8 : end])
                idxs.append(len(parts) - 1)
                offs = end
            types = [vt.ARRAY] + ([vt.STRING] if idxs else [])
            return offs - orig_offs, parts, idxs, types

        def _build_fields(self, offs, count):
            for i in range(int(count)):
                self._where = f"metadata field #{i}"
                self._where = f"metadata field {self._peek_name(offs, self._where)!r}"
                offs = super()._build_fields(offs, 1)
            return offs

        def _build_tensor_info(self, offs, count):
            fields = []
            for i in range(int(count)):
                self._where = f"tensor info #{i}"
                self._where = f"tensor {self._peek_name(offs, self._where)!r} (info)"
                offs, one = super()._build_tensor_info(offs, 1)
                fields += one
            return offs, fields

        def _build_tensors(self, start_offs, fields):
            tensors = []
            for fld in fields:
                name = bytes(fld.parts[1]).decode("utf-8", "replace")
                self._where = f"tensor {name!r}"
                try:
                    super()._build_tensors(start_offs, [fld])
                except _Corrupt:
                    raise
                except Exception as e:  # type, offset or shape that does not fit the file
                    off = int(start_offs + fld.parts[5][0])
                    raise _Corrupt(
                        f"tensor {name!r}: data at byte {off} (file has {len(self.data)}) cannot be read: "
                        f"{type(e).__name__}: {e}"
                    ) from None
                tensors += self.tensors
            self.tensors = tensors

    return CheckedReader


def _open_reader(f: Path) -> Any:
    try:
        return _checked_reader_class()(f, "r")
    except FileNotFoundError:
        raise MemraError(f"{f}: no such file") from None
    except _Corrupt as e:
        raise MemraError(f"{f}: cannot read GGUF file (truncated or corrupt): {e}", code="invalid_model") from None
    except Exception as e:  # gguf raises ValueError/KeyError etc. on bad files
        size = f.stat().st_size if f.exists() else 0
        raise MemraError(
            f"{f}: cannot read GGUF file ({size} bytes; truncated or corrupt): {type(e).__name__}: {e}",
            code="invalid_model",
        ) from None


#: metadata arrays longer than this are not converted when the source closes (the tokenizer's
#: vocabulary: converted when first read, by opening the file again if it was closed by then)
_DETACH_EAGER_MAX = 64


class GGUFMetadata(Mapping[str, Any]):
    """Read-only mapping of GGUF KV metadata; each value is converted on first access and cached.

    The reader's fields are views of its memory map; ``detach`` lets the map go (see GGUFSource.close).
    """

    def __init__(self, fields: Mapping[str, Any]):
        self._fields = {k: v for k, v in fields.items() if not k.startswith("GGUF.")}
        self._keys = list(self._fields)
        self._cache: dict[str, Any] = {}
        self._reopen: Any = None  # after detach: () -> a fresh reader's fields

    def __getitem__(self, key: str) -> Any:
        if key in self._cache:
            return self._cache[key]
        field = self._fields.get(key)
        if field is None:
            if self._reopen is None or key not in self._keys:
                raise KeyError(key)
            field = self._reopen()[key]  # a closed source: read this key from the file again
        try:
            value = field.contents()
        except Exception as e:
            raise MemraError(f"GGUF metadata key {key!r} cannot be decoded: {e}") from None
        self._cache[key] = value
        return value

    def detach(self, reopen: Any) -> None:
        """Convert the small values now and drop every reference to the reader's fields; a long
        array not yet read is read later through ``reopen()`` (a new reader's fields)."""
        for key, field in self._fields.items():
            if key not in self._cache and len(field.data) <= _DETACH_EAGER_MAX:
                self[key]
        self._reopen = reopen  # first: a reader in another thread then always finds one or the other
        self._fields = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._cache or key in self._fields or (self._reopen is not None and key in self._keys)


class GGUFSource(WeightSource):
    """One GGUF model (possibly split). ``metadata`` comes from the first shard."""

    format = "gguf"

    def __init__(self, path: Path):
        self.path = path
        self.files = split_files(path)
        self.path = self.files[0]
        readers = [_open_reader(f) for f in self.files]  # the metadata keeps the first one's fields
        self.metadata = GGUFMetadata(readers[0].fields)
        self._maps = {}
        self._infos = {}
        self._where = {}
        for f, r in zip(self.files, readers, strict=True):
            size = f.stat().st_size
            for t in r.tensors:
                dtype = t.tensor_type.name.lower()
                if dtype not in storage.FILE_TYPES:
                    raise MemraError(f"{f}: tensor {t.name!r} has unsupported type {t.tensor_type.name}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                nbytes = int(t.n_bytes)
                if t.data_offset + nbytes > size:
                    raise MemraError(
                        f"{f}: truncated file: tensor {t.name!r} ends at byte {t.data_offset + nbytes} but the file has {size}"
                    )
                if t.name in self._infos:
                    raise MemraError(f"{f}: tensor {t.name!r} appears in more than one shard")
                self._infos[t.name] = TensorInfo(t.name, dtype, shape, nbytes)
                self._where[t.name] = (f, int(t.data_offset), nbytes)

    def close(self) -> None:
        first = self.files[0]
        self.metadata.detach(lambda: _open_reader(first).fields)
        super().close()
