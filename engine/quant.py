"""The numpy reference for GGUF storage: dequantisation, device-layout repacking, quantisers for test data.

The oracle the CUDA kernels are checked against. File types are decoded by the gguf package's own
dequantisers (``gguf.quants.dequantize``); what it lacks is here: the device layouts (``repack`` /
``unpack``: a file block's byte planes, engine.storage), the size checks that name the tensor's
problem, and ``q8x_round_trip`` (the int8 x rows of the q8x GEMV). ``quantize_reference`` is
``gguf.quants.quantize`` for the types it supports. The block layouts themselves are documented in
engine.storage. Must not import CUDA or other engine modules except engine.storage and engine.types.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.storage import (
    PLANES,
    REPACKED_FROM,
    block,
    ggml_type,
    nbytes_for,
    q8_0r_qs_offset,
    row_bytes,
)
from engine.types import MemraError


def _layout(layout: str, cols: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    if layout not in PLANES:
        raise MemraError(f"no device layout {layout!r}; known: {', '.join(REPACKED_FROM)}")
    elems, nbytes = block(REPACKED_FROM[layout])
    if cols % elems:
        raise MemraError(f"{layout} row length {cols} is not a multiple of its block size {elems}")
    return cols // elems, nbytes, PLANES[layout]


def repack(raw: np.ndarray, layout: str, rows: int, cols: int) -> np.ndarray:
    """File bytes of a [rows, cols] matrix (of type REPACKED_FROM[layout]) in device ``layout``."""
    nb, nbytes, planes = _layout(layout, cols)
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if b.size != rows * nb * nbytes:
        raise MemraError(
            f"{REPACKED_FROM[layout]} matrix [{rows}, {cols}] needs {rows * nb * nbytes} bytes, got {b.size}"
        )
    blocks = b.reshape(rows, nb, nbytes)
    parts = [blocks[:, :, a:e].reshape(rows, -1) for a, e in planes]
    if layout == "q8_0r":  # the d plane padded to 16 bytes (engine.storage.q8_0r_qs_offset)
        parts.insert(1, np.zeros((rows, q8_0r_qs_offset(cols) - nb * 2), np.uint8))
    pad = row_bytes(layout, cols) - sum(p.shape[1] for p in parts)
    if pad:
        parts.append(np.zeros((rows, pad), np.uint8))
    return np.concatenate(parts, axis=1).reshape(-1)


def unpack(raw: np.ndarray, layout: str, rows: int, cols: int) -> np.ndarray:
    """The inverse of ``repack``: device-layout bytes back to the file's block bytes."""
    nb, nbytes, planes = _layout(layout, cols)
    b = np.ascontiguousarray(raw).reshape(rows, -1).view(np.uint8)
    out, off = np.empty((rows, nb, nbytes), np.uint8), 0
    for a, e in planes:  # each plane back to its byte range of the block (planes need not be in order)
        out[:, :, a:e] = b[:, off : off + nb * (e - a)].reshape(rows, nb, e - a)
        off += nb * (e - a)
        if layout == "q8_0r" and a == 0:  # past the d plane's padding
            off = q8_0r_qs_offset(cols)
    return out.reshape(-1)


def dequantize(raw: np.ndarray, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Decode the bytes of one tensor (``raw``: any array, read as bytes) to float32 of ``shape``.

    Raises MemraError when the dtype is unknown or the byte count does not match the shape.
    """
    shape = tuple(int(s) for s in shape)
    want = nbytes_for(dtype, shape)
    if dtype in REPACKED_FROM:
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        want = rows * row_bytes(dtype, shape[-1])
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if b.size != want:
        raise MemraError(f"{dtype} tensor of shape {shape} needs {want} bytes, got {b.size}")
    if dtype in REPACKED_FROM:
        b, dtype = unpack(b, dtype, rows, shape[-1]), REPACKED_FROM[dtype]
    # one row of every block: gguf.quants works in groups of 16 rows, one Python call per group
    from gguf import quants as _gguf_quants  # (imported when first needed: a GGUF model's)

    out = _gguf_quants.dequantize(b.reshape(1, -1), ggml_type(dtype)).astype(np.float32, copy=False)
    if np.shares_memory(out, raw):  # f32 is a view of the bytes: the caller gets its own array
        out = out.copy()
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Reference quantisers (round-to-nearest), for writing test data. Not tuned for quality.


#: the types ``quantize_reference`` writes (gguf.quants.quantize has no K-quant quantisers)
QUANTIZABLE = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def quantize_reference(x: np.ndarray, dtype: str) -> bytes:
    """Round-to-nearest quantisation of ``x`` (row-major, last dim a multiple of the block) to
    ``dtype``, by ``gguf.quants.quantize``, for writing test data. K-quant test blocks are made from
    random bytes with finite f16 scales instead (``tests/fixtures/quant_blocks.py``)."""
    if dtype not in QUANTIZABLE:
        raise MemraError(f"quantize_reference does not support {dtype!r} (supported: {' '.join(QUANTIZABLE)})")
    x = np.asarray(x, dtype=np.float32)
    elems, _ = block(dtype)
    if x.ndim == 0 or x.shape[-1] % elems:
        raise MemraError(f"cannot quantise shape {x.shape} to {dtype}: last dim must be a multiple of {elems}")
    from gguf import quants as _gguf_quants

    return np.ascontiguousarray(_gguf_quants.quantize(x, ggml_type(dtype))).tobytes()


def q8x_round_trip(x: np.ndarray) -> np.ndarray:
    """x rows as the coop GEMV's q8x path sees them (kernels/_gemv_coop.cuh.j2): each group of 32
    consecutive elements quantised to int8 with ``amax = max |x|``, ``q = rint(x * (127 / amax))``,
    and dequantised as ``q * (amax / 127)`` (all f32; a group of zeros stays zero). ``x @ W.T`` of
    the result is what that kernel computes, up to f32 summation order."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % 32:
        raise MemraError(f"q8x: row length {x.shape[-1]} is not a multiple of 32")
    g = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, np.float32(1.0)), np.float32(0.0))
    q = np.rint(g * inv.astype(np.float32))
    return (q * (amax / np.float32(127.0))).astype(np.float32).reshape(x.shape)
