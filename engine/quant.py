"""GGUF/ggml block formats: numpy reference dequantisers and simple round-to-nearest quantisers.

This is the oracle the CUDA kernels are checked against, so every layout is documented below
(bytes per block, field order, element order) precisely enough to write a kernel from. It must
not import the ``gguf`` package (tests compare against it), CUDA, or other engine modules except
``engine.types``.

All multi-byte fields are little-endian. ``f16`` is IEEE half. A tensor of row-major shape
``(..., K)`` is stored row by row; each row of K elements is ``K / block_elems`` consecutive blocks
(K must be a multiple of the block size). "element e" below is the index inside one block.

Legacy 32-element blocks (``d``/``m`` are f16 scale/min):

* ``q4_0`` 18 B: ``d, qs[16]``. e<16: ``q = qs[e] & 0xF``; e>=16: ``q = qs[e-16] >> 4``.
  ``x = (q - 8) * d``.
* ``q4_1`` 20 B: ``d, m, qs[16]``. q as q4_0. ``x = q * d + m``.
* ``q5_0`` 22 B: ``d, qh (u32), qs[16]``. low 4 bits as q4_0; bit 4 = ``(qh >> e) & 1``.
  ``x = (q - 16) * d``.
* ``q5_1`` 24 B: ``d, m, qh (u32), qs[16]``. q as q5_0. ``x = q * d + m``.
* ``q8_0`` 34 B: ``d, qs[32] (int8)``. ``x = qs[e] * d``.

K-quants, 256-element super-blocks:

* ``q2_k`` 84 B: ``scales[16], qs[64], d (f16), dmin (f16)``. For e = 128n + 32j + l (n<2, j<4,
  l<32): ``q = (qs[32n + l] >> 2j) & 3``; ``s = scales[e // 16]``;
  ``x = d * (s & 0xF) * q - dmin * (s >> 4)``.
* ``q3_k`` 110 B: ``hmask[32], qs[64], scales[12], d (f16)``. For e = 128n + 32j + l:
  ``q = (qs[32n + l] >> 2j) & 3``, ``h = (hmask[l] >> (4n + j)) & 1``; the 16 6-bit scales:
  for k<16, ``sc = ((scales[k % 8] >> 4*(k // 8)) & 0xF) | (((scales[8 + k % 4] >> 2*(k // 4)) & 3) << 4)``;
  ``x = d * (sc[e // 16] - 32) * (q - (0 if h else 4))``.
* ``q4_k`` 144 B: ``d (f16), dmin (f16), scales[12], qs[128]``. 8 sub-blocks of 32, each with a
  6-bit scale and 6-bit min (``scale_min_k4``): for s<4 ``sc = scales[s] & 63, mn = scales[s+4] & 63``;
  for s>=4 ``sc = (scales[s+4] & 0xF) | ((scales[s-4] >> 6) << 4)``,
  ``mn = (scales[s+4] >> 4) | ((scales[s] >> 6) << 4)``. For e = 64c + 32h + l (c<4, h<2, l<32),
  sub-block s = 2c + h: ``q = (qs[32c + l] >> 4h) & 0xF``; ``x = d * sc[s] * q - dmin * mn[s]``.
* ``q5_k`` 176 B: ``d, dmin, scales[12], qh[32], qs[128]``. As q4_k plus bit 4 of q:
  ``q |= ((qh[l] >> s) & 1) << 4``.
* ``q6_k`` 210 B: ``ql[128], qh[64], scales[16] (int8), d (f16)``. For e = 128n + 32k + l (n<2, k<4,
  l<32): ``low = (ql[64n + 32(k % 2) + l] >> 4(k // 2)) & 0xF``, ``high = (qh[32n + l] >> 2k) & 3``,
  ``q = (low | high << 4) - 32``; ``x = d * scales[e // 16] * q``.

Plain: ``f32`` 4 B, ``f16`` 2 B, ``bf16`` 2 B (the top half of an f32) per element.

Device layouts (never in a file; ``repack`` makes them from file bytes at upload):

* ``q8_0r``: a q8_0 row of K elements as two planes, the K/32 f16 ``d`` of its blocks, then its K
  int8 ``qs`` (same bytes per row as q8_0). With K % 256 == 0 both planes start 16-byte aligned,
  so a kernel reads 16 weights per 16-byte load.
* ``q6_kr``: a q6_k row of K elements (NB = K/256 super-blocks) as four planes, every block's
  ``ql[128]``, then every ``qh[64]``, every ``scales[16]``, every ``d``, zero-padded to a multiple
  of 16 bytes (``row_bytes``): each plane starts 16-byte aligned whatever NB is.
* ``q4_0r`` / ``q4_1r``: a q4_0 / q4_1 row of K elements (NB = K/32 blocks) as two planes, every
  block's ``qs[16]`` (K/2 bytes, nibbles as in the file), then every ``d`` (q4_0r) or ``d, m`` pair
  (q4_1r), zero-padded to a multiple of 16 bytes: the qs plane is 16-byte aligned for any K (a
  kernel reads a whole block's 32 weights per 16-byte load) and the scale plane 2- / 4-byte aligned.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.graph import BLOCK_SIZES as _BLOCK_SIZES
from engine.types import MemraError

#: dtype -> (elements per block, bytes per block); defined with the storage types in engine.graph
BLOCK_SIZES = _BLOCK_SIZES


def nbytes_for(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``shape`` (row-major, last dim = row) takes in ``dtype``; checks divisibility."""
    elems, nbytes = _block(dtype)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if len(shape) and shape[-1] % elems:
        raise MemraError(f"{dtype} tensor row length {shape[-1]} is not a multiple of its block size {elems}")
    return n // elems * nbytes


#: device layout -> the file storage type it is repacked from
REPACKED_FROM: dict[str, str] = {"q8_0r": "q8_0", "q6_kr": "q6_k", "q4_0r": "q4_0", "q4_1r": "q4_1"}
# the planes of each layout: (start, end) byte ranges of one file block, in plane order
_PLANES: dict[str, tuple[tuple[int, int], ...]] = {
    "q8_0r": ((0, 2), (2, 34)),
    "q6_kr": ((0, 128), (128, 192), (192, 208), (208, 210)),
    "q4_0r": ((2, 18), (0, 2)),
    "q4_1r": ((4, 20), (0, 4)),
}
# the layouts whose rows are zero-padded to a multiple of 16 bytes (q8_0r needs K % 256 instead)
_PADDED_ROWS = ("q6_kr", "q4_0r", "q4_1r")


def row_bytes(dtype: str, cols: int) -> int:
    """Bytes of one row of ``cols`` elements stored as ``dtype`` (a device layout's padded pitch)."""
    elems, nbytes = _block(dtype)
    if cols % elems:
        raise MemraError(f"{dtype} row length {cols} is not a multiple of its block size {elems}")
    n = cols // elems * nbytes
    return (n + 15) // 16 * 16 if dtype in _PADDED_ROWS else n


def _layout(layout: str, rows: int, cols: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    if layout not in _PLANES:
        raise MemraError(f"no device layout {layout!r}; known: {', '.join(REPACKED_FROM)}")
    elems, nbytes = _block(REPACKED_FROM[layout])
    if cols % elems:
        raise MemraError(f"{layout} row length {cols} is not a multiple of its block size {elems}")
    return cols // elems, nbytes, _PLANES[layout]


def repack(raw: np.ndarray, layout: str, rows: int, cols: int) -> np.ndarray:
    """File bytes of a [rows, cols] matrix (of type REPACKED_FROM[layout]) in device ``layout``."""
    nb, nbytes, planes = _layout(layout, rows, cols)
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if b.size != rows * nb * nbytes:
        raise MemraError(
            f"{REPACKED_FROM[layout]} matrix [{rows}, {cols}] needs {rows * nb * nbytes} bytes, got {b.size}"
        )
    blocks = b.reshape(rows, nb, nbytes)
    parts = [blocks[:, :, a:e].reshape(rows, -1) for a, e in planes]
    pad = row_bytes(layout, cols) - nb * nbytes
    if pad:
        parts.append(np.zeros((rows, pad), np.uint8))
    return np.concatenate(parts, axis=1).reshape(-1)


def unpack(raw: np.ndarray, layout: str, rows: int, cols: int) -> np.ndarray:
    """The inverse of ``repack``: device-layout bytes back to the file's block bytes."""
    nb, nbytes, planes = _layout(layout, rows, cols)
    b = np.ascontiguousarray(raw).reshape(rows, -1).view(np.uint8)
    out, off = np.empty((rows, nb, nbytes), np.uint8), 0
    for a, e in planes:  # each plane back to its byte range of the block (planes need not be in order)
        out[:, :, a:e] = b[:, off : off + nb * (e - a)].reshape(rows, nb, e - a)
        off += nb * (e - a)
    return out.reshape(-1)


def _block(dtype: str) -> tuple[int, int]:
    try:
        return BLOCK_SIZES[dtype]
    except KeyError:
        raise MemraError(f"unsupported tensor dtype {dtype!r}; supported: {', '.join(BLOCK_SIZES)}") from None


def _f16(b: np.ndarray) -> np.ndarray:
    """(nb, 2) uint8 -> (nb, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) packed -> (nb, 32): low nibbles then high nibbles."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) uint8 little-endian u32 -> (nb, 32) bits, element e = bit e."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _dq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _dq_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:20]).astype(np.float32) + m


def _dq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 6:22]) | (_qh_bits(b[:, 2:6]) << 4)
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _dq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:24]) | (_qh_bits(b[:, 4:8]) << 4)
    return d * q.astype(np.float32) + m


def _dq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    return d * np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(nb, 64) packed 2-bit -> (nb, 256) in order e = 128n + 32j + l."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((q >> shifts) & 3).reshape(nb, 256)


def _dq_q2_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    scales = b[:, 0:16]
    q = _crumbs(b[:, 16:80]).astype(np.float32).reshape(nb, 16, 16)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).astype(np.float32))[:, :, None]
    ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(nb, 256)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """(nb, 12) -> (nb, 16) signed 6-bit scales (already minus 32)."""
    k = np.arange(16)
    low = (s[:, k % 8] >> (4 * (k // 8)).astype(np.uint8)) & 0xF
    high = (s[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def _dq_q3_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    hmask = b[:, 0:32]
    q = _crumbs(b[:, 32:96]).astype(np.int8)
    sc = _q3_k_scales(b[:, 96:108]).astype(np.float32)
    d = _f16(b[:, 108:110])
    # h for e = 128n + 32j + l is bit (4n + j) of hmask[l]
    bits = np.unpackbits(hmask[:, None, :], axis=1, count=8, bitorder="little")  # (nb, 8, 32): bit, l
    q = q - np.where(bits.reshape(nb, 256) != 0, np.int8(0), np.int8(4))
    dl = (d * sc)[:, :, None]
    return (dl * q.astype(np.float32).reshape(nb, 16, 16)).reshape(nb, 256)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nb, 12) -> (sc, mn), each (nb, 8) uint8."""
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 128) -> (nb, 8, 32): sub-block s = 2c + h, element l."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 4, 1, 32)
    return ((q >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF).reshape(nb, 8, 32)


def _dq_q4_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _k4_nibbles(b[:, 16:144]).astype(np.float32)
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * mn.astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(nb, 256)


def _dq_q5_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48]
    high = np.unpackbits(qh[:, None, :], axis=1, count=8, bitorder="little")  # (nb, 8 = s, 32 = l)
    q = (_k4_nibbles(b[:, 48:176]) | (high << 4)).astype(np.float32)
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * mn.astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(nb, 256)


def _dq_q6_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 2, 32)  # n, -, k % 2, l
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)  # n, -, l
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1, 1)) & 0xF  # n, k // 2, k % 2, l
    low = low.reshape(nb, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    dl = (d * sc)[:, :, None]
    return (dl * q.astype(np.float32).reshape(nb, 16, 16)).reshape(nb, 256)


_DEQUANT = {
    "q4_0": _dq_q4_0,
    "q4_1": _dq_q4_1,
    "q5_0": _dq_q5_0,
    "q5_1": _dq_q5_1,
    "q8_0": _dq_q8_0,
    "q2_k": _dq_q2_k,
    "q3_k": _dq_q3_k,
    "q4_k": _dq_q4_k,
    "q5_k": _dq_q5_k,
    "q6_k": _dq_q6_k,
}


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
    if dtype == "f32":
        return b.view(np.float32).reshape(shape).copy()
    if dtype == "f16":
        return b.view(np.float16).astype(np.float32).reshape(shape)
    if dtype == "bf16":
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    elems, nbytes = BLOCK_SIZES[dtype]
    return _DEQUANT[dtype](b.reshape(-1, nbytes)).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Reference quantisers (round-to-nearest), for writing test data. Not tuned for quality.


def _blocks(x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    elems, _ = _block(dtype)
    if x.ndim == 0 or x.shape[-1] % elems:
        raise MemraError(
            f"cannot quantise shape {x.shape} to {dtype}: last dim must be a multiple of {elems}"
        )
    return x.reshape(-1, elems)


def _h(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _pack_qh(q: np.ndarray) -> np.ndarray:
    return np.packbits((q >> 4).astype(np.uint8) & 1, axis=1, bitorder="little")


def _absmax_scale(x: np.ndarray, div: float) -> tuple[np.ndarray, np.ndarray]:
    """Signed max-magnitude element / div as scale (ggml convention) and its inverse."""
    idx = np.abs(x).argmax(axis=1)
    mx = x[np.arange(x.shape[0]), idx]
    d = mx / div
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    return d, inv


def _minmax_scale(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / levels
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    return d, lo, inv


def quantize_reference(x: np.ndarray, dtype: str) -> bytes:
    """Round-to-nearest quantisation of ``x`` (row-major, last dim multiple of the block) to ``dtype``.

    Supports f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, byte-identical to ``gguf.quants.quantize``.
    K-quants are not supported here, nor by ``gguf.quants.quantize`` (it raises NotImplementedError
    for q2_k..q6_k); K-quant test blocks are made from random bytes with finite f16 scales
    (``tests/fixtures/quant_blocks.py``).
    """
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x.tobytes()
    if dtype == "f16":
        return x.astype(np.float16).tobytes()
    if dtype == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype(np.uint16).tobytes()
    b = _blocks(x, dtype)
    if dtype == "q8_0":
        amax = np.abs(b).max(axis=1)
        d = amax / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.rint(b * inv[:, None]).clip(-127, 127).astype(np.int8).view(np.uint8)
        return np.concatenate([_h(d), q], axis=1).tobytes()
    if dtype == "q4_0":
        d, inv = _absmax_scale(b, -8.0)
        q = np.clip(np.floor(b * inv[:, None] + 8.5), 0, 15)
        return np.concatenate([_h(d), _pack_nibbles(q)], axis=1).tobytes()
    if dtype == "q5_0":
        d, inv = _absmax_scale(b, -16.0)
        q = np.clip(np.floor(b * inv[:, None] + 16.5), 0, 31).astype(np.uint8)
        return np.concatenate([_h(d), _pack_qh(q), _pack_nibbles(q & 0xF)], axis=1).tobytes()
    if dtype == "q4_1":
        d, lo, inv = _minmax_scale(b, 15)
        q = np.clip(np.floor((b - lo[:, None]) * inv[:, None] + 0.5), 0, 15)
        return np.concatenate([_h(d), _h(lo), _pack_nibbles(q)], axis=1).tobytes()
    if dtype == "q5_1":
        d, lo, inv = _minmax_scale(b, 31)
        q = np.clip(np.floor((b - lo[:, None]) * inv[:, None] + 0.5), 0, 31).astype(np.uint8)
        return np.concatenate([_h(d), _h(lo), _pack_qh(q), _pack_nibbles(q & 0xF)], axis=1).tobytes()
    raise MemraError(
        f"quantize_reference does not support {dtype!r} (supported: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1)"
    )


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
