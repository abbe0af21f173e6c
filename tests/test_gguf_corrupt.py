"""Broken GGUF files give one MemraError naming the file and the field or tensor that is wrong."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.types import MemraError
from engine.weights.gguf_reader import GGUFSource


def _write(path: Path, metadata=None) -> bytes:
    """A tiny GGUF: the default metadata and two tensors, or ``metadata(writer)`` and one tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    if metadata is None:
        w.add_string("general.name", "tiny")
        w.add_uint32("llama.block_count", 1)
        w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    else:
        metadata(w)
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _error(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    with pytest.raises(MemraError) as ei:
        GGUFSource(path)
    msg = str(ei.value)
    assert str(path) in msg and "\n" not in msg
    return msg


def test_valid_file_reads(tmp_path):
    p = tmp_path / "ok.gguf"
    _write(p)
    src = GGUFSource(p)
    assert src.info("token_embd.weight").shape == (4, 8) and src.metadata["general.name"] == "tiny"


def test_huge_metadata_string_length_names_the_field(tmp_path):
    p = tmp_path / "m.gguf"
    data = bytearray(_write(p))
    key = b"general.name"
    at = data.index(key) + len(key) + 4  # key bytes, then the u32 value type, then the u64 length
    assert struct.unpack_from("<Q", data, at)[0] == 4
    struct.pack_into("<Q", data, at, 2**62)
    msg = _error(p, bytes(data))
    assert "'general.name'" in msg and "corrupt" in msg


def test_huge_key_length_names_the_field_index(tmp_path):
    p = tmp_path / "k.gguf"
    data = bytearray(_write(p))
    at = data.index(b"general.name") - 8
    struct.pack_into("<Q", data, at, 2**40)
    assert "metadata field #" in _error(p, bytes(data))


def test_tensor_offset_past_eof_names_the_tensor(tmp_path):
    p = tmp_path / "t.gguf"
    data = bytearray(_write(p))
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4 + 8 + 4  # n_dims u32, one u64 dim, type u32, then offset u64
    struct.pack_into("<Q", data, at, 10**9)
    msg = _error(p, bytes(data))
    assert "'output_norm.weight'" in msg


def test_truncated_file_names_the_tensor(tmp_path):
    p = tmp_path / "cut.gguf"
    data = _write(p)
    msg = _error(p, data[:-8])
    assert "'output_norm.weight'" in msg


def test_truncated_in_metadata_names_the_field(tmp_path):
    p = tmp_path / "cut2.gguf"
    data = _write(p)
    at = data.index(b"llama.block_count")
    assert "'llama.block_count'" in _error(p, data[: at + len(b"llama.block_count") + 2])  # value cut
    assert "metadata field #2" in _error(p, data[: at + 10])  # the key itself cut: its index


def _arrays(w) -> None:
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|x|>", "ü" * 40])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3, 1, 6])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0, 0.0, 7.5])
    w.add_array("empty.strings", [])
    w.add_array("nested", [[1, 2], [3]])


def test_metadata_arrays_read_as_gguf_reads_them(tmp_path):
    # engine.weights.gguf_reader parses arrays without gguf's per-element views: the same contents
    # and types as gguf.GGUFReader for strings, numbers, an empty and a nested array
    p = tmp_path / "arr.gguf"
    _write(p, _arrays)
    ref = gguf.GGUFReader(str(p), "r")
    src = GGUFSource(p)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert src.metadata[key] == field.contents(), key
    assert src.metadata["tokenizer.ggml.tokens"] == ["a", "bé", "", "<|x|>", "ü" * 40]
    assert src.metadata["tokenizer.ggml.token_type"] == [1, 2, 3, 1, 6]


def test_corrupt_string_in_an_array_names_the_field(tmp_path):
    p = tmp_path / "arr2.gguf"
    data = bytearray(_write(p, _arrays))
    at = data.index("ü".encode() * 40) - 8  # the last token's u64 length
    assert struct.unpack_from("<Q", data, at)[0] == 80
    struct.pack_into("<Q", data, at, 2**40)
    msg = _error(p, bytes(data))
    assert "'tokenizer.ggml.tokens'" in msg and "string #4" in msg
