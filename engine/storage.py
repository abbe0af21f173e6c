"""Storage-type facts in one place: the GGUF storage types memra reads, their block sizes, and the
device layouts some of them are repacked into at upload.

File types are GGUF's (lower-case ggml names); their (elements, bytes) per block come from the gguf
package's own table (``gguf.constants.GGML_QUANT_SIZES``). Device layouts are memra's: which file
type each is made from, the byte planes a file block is split into, and the 16-byte row padding
(``engine.quant.repack`` does the repacking). Must not import numpy, CUDA or other engine modules
except ``engine.types``.

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

* ``q8_0r``: a q8_0 row of K elements as two planes, the K/32 f16 ``d`` of its blocks zero-padded
  to a multiple of 16 bytes (``q8_0r_qs_offset``), then its K int8 ``qs``: both planes and every row
  start 16-byte aligned for any K, so a kernel reads 16 weights per 16-byte load. With K % 256 == 0
  there is no padding (the same bytes per row as q8_0); Gemma 3 270M's 640-value rows take
  48 + 640 = 688 bytes instead of 680.
* ``q6_kr``: a q6_k row of K elements (NB = K/256 super-blocks) as four planes, every block's
  ``ql[128]``, then every ``qh[64]``, every ``scales[16]``, every ``d``, zero-padded to a multiple
  of 16 bytes (``row_bytes``): each plane starts 16-byte aligned whatever NB is.
* ``q4_0r`` / ``q4_1r``: a q4_0 / q4_1 row of K elements (NB = K/32 blocks) as two planes, every
  block's ``qs[16]`` (K/2 bytes, nibbles as in the file), then every ``d`` (q4_0r) or ``d, m`` pair
  (q4_1r), zero-padded to a multiple of 16 bytes: the qs plane is 16-byte aligned for any K (a
  kernel reads a whole block's 32 weights per 16-byte load) and the scale plane 2- / 4-byte aligned.
* ``q5_0r``: a q5_0 row (NB = K/32 blocks) as three planes, every block's ``qs[16]`` (K/2 bytes),
  every u32 ``qh`` (K/8 bytes), every f16 ``d``, zero-padded to a multiple of 16 bytes (uploaded so
  only for gemv_mma: tuning gemv_mma.types with q5_0, kernel_catalog.upload_type).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.types import MemraError

FLOAT_TYPES = ("f32", "f16", "bf16")
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
#: the storage types a tensor in a model file may have (a family's quant combos name these)
FILE_TYPES = FLOAT_TYPES + QUANT_TYPES

#: device layout -> the file storage type it is repacked from (never in a file)
REPACKED_FROM: dict[str, str] = {
    "q8_0r": "q8_0", "q6_kr": "q6_k", "q4_0r": "q4_0", "q4_1r": "q4_1", "q5_0r": "q5_0",
}
#: the planes of each device layout: (start, end) byte ranges of one file block, in plane order
PLANES: dict[str, tuple[tuple[int, int], ...]] = {
    "q8_0r": ((0, 2), (2, 34)),
    "q6_kr": ((0, 128), (128, 192), (192, 208), (208, 210)),
    "q4_0r": ((2, 18), (0, 2)),
    "q4_1r": ((4, 20), (0, 4)),
    "q5_0r": ((6, 22), (2, 6), (0, 2)),
}
#: the device layouts whose rows are zero-padded to a multiple of 16 bytes (q8_0r pads its d plane,
#: q8_0r_qs_offset, its K-byte qs plane then ending the row on a 16-byte boundary)
PADDED_ROWS = ("q6_kr", "q4_0r", "q4_1r", "q5_0r")


def ggml_type(dtype: str) -> GGMLQuantizationType:
    """The gguf package's enum member of a file type (``q4_k`` -> ``GGMLQuantizationType.Q4_K``)."""
    return GGMLQuantizationType[dtype.upper()]


#: dtype -> (elements per block, bytes per block): gguf's table for file types (floats are
#: 1-element blocks); a device layout keeps its file type's blocks (its rows may be padded)
BLOCK_SIZES: dict[str, tuple[int, int]] = {t: tuple(GGML_QUANT_SIZES[ggml_type(t)]) for t in FILE_TYPES}
BLOCK_SIZES.update({layout: BLOCK_SIZES[file_type] for layout, file_type in REPACKED_FROM.items()})


def block(dtype: str) -> tuple[int, int]:
    """(elements, bytes) per block of ``dtype``; a MemraError names an unknown type."""
    try:
        return BLOCK_SIZES[dtype]
    except KeyError:
        raise MemraError(f"unsupported tensor dtype {dtype!r}; supported: {', '.join(BLOCK_SIZES)}") from None


def q8_0r_qs_offset(cols: int) -> int:
    """Byte offset of a q8_0r row's qs plane: its cols / 32 f16 scales padded to 16 bytes."""
    return (cols // 32 * 2 + 15) // 16 * 16


def row_bytes(dtype: str, cols: int) -> int:
    """Bytes of one row of ``cols`` elements stored as ``dtype`` (a device layout's padded pitch)."""
    elems, nbytes = block(dtype)
    if cols % elems:
        raise MemraError(f"{dtype} row length {cols} is not a multiple of its block size {elems}")
    if dtype == "q8_0r":
        return q8_0r_qs_offset(cols) + cols
    n = cols // elems * nbytes
    return (n + 15) // 16 * 16 if dtype in PADDED_ROWS else n


def nbytes_for(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``shape`` (row-major, last dim = row) takes in file type ``dtype``; checks
    that the row divides into blocks."""
    elems, nbytes = block(dtype)
    n = math.prod(int(s) for s in shape)
    if len(shape) and shape[-1] % elems:
        raise MemraError(f"{dtype} tensor row length {shape[-1]} is not a multiple of its block size {elems}")
    return n // elems * nbytes
