"""Storage-type facts in one place: the GGUF storage types memra reads, their block sizes, and the
device layouts some of them are repacked into at upload.

File types are GGUF's (lower-case ggml names); their (elements, bytes) per block are the gguf
package's own table (``gguf.constants.GGML_QUANT_SIZES``, written out here: importing this module
does not import gguf). Device layouts are memra's: which file
type each is made from, the byte planes a file block is split into, and the 16-byte row padding
(``engine.quant.repack`` does the repacking); docs/weights-and-tokenizers.md ("Block layouts")
gives every layout bit by bit. Must not import numpy, CUDA or other engine modules except
``engine.types``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.types import MemraError

FLOAT_TYPES = ("f32", "f16", "bf16")
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
#: the storage types a tensor in a model file may have (a family's quant combos name these)
FILE_TYPES = FLOAT_TYPES + QUANT_TYPES

#: device layout -> the file storage type it is repacked from (never in a file)
REPACKED_FROM: dict[str, str] = {"q8_0r": "q8_0", "q6_kr": "q6_k", "q4_0r": "q4_0", "q4_1r": "q4_1"}
#: the planes of each device layout: (start, end) byte ranges of one file block, in plane order
PLANES: dict[str, tuple[tuple[int, int], ...]] = {
    "q8_0r": ((0, 2), (2, 34)),
    "q6_kr": ((0, 128), (128, 192), (192, 208), (208, 210)),
    "q4_0r": ((2, 18), (0, 2)),
    "q4_1r": ((4, 20), (0, 4)),
}
#: the device layouts whose rows are zero-padded to a multiple of 16 bytes (q8_0r pads its d plane,
#: q8_0r_qs_offset, its K-byte qs plane then ending the row on a 16-byte boundary)
PADDED_ROWS = ("q6_kr", "q4_0r", "q4_1r")


def ggml_type(dtype: str) -> Any:
    """The gguf package's enum member of a file type (``q4_k`` -> ``GGMLQuantizationType.Q4_K``);
    the package is imported here, when first needed (not on `memra serve`'s way to a safetensors model)."""
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType[dtype.upper()]


#: dtype -> (elements per block, bytes per block) of the file types: gguf's table
#: (``gguf.constants.GGML_QUANT_SIZES``, tests/test_storage_import.py checks they agree; written out
#: so importing this module does not import gguf); floats are 1-element blocks. A device layout
#: keeps its file type's blocks (its rows may be padded)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
}  # fmt: skip
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
