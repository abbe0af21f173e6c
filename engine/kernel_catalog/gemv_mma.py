"""The params of gemv_mma, the tensor-core decode linear (kernels/gemv_mma.cu.j2): its row buckets,
the k split of a weight (the same at every batch size: what fixes a row's bits) and the row tile of
each bucket. Imports only the catalog's contracts and layout. Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.kernel_catalog.contracts import MMA_UNIT, QUANTS
from engine.kernel_catalog.layout import _cdiv
from engine.storage import REPACKED_FROM

# the gemv_mma launches of a decode linear: (bmax, fewest rows, most rows (0: any)) -- a pass of
# rows runs the first whose range holds it (more than 64 rows: bmax 64 per grid row); batch 1 takes
# the bmax-8 kernel
MMA_BUCKETS = ((8, 0, 8), (16, 9, 16), (32, 17, 32), (64, 33, 0))
# bmax -> (m tiles per warp, warps side by side over rows): x fragments are reused over mt m tiles
# and shared through L1 by the wm warps of a block, so x bytes read per weight byte stay bounded as
# the batch grows
# the file storage types whose upload layout gemv_mma decodes (tuning gemv_mma.types; q8_0 where it
# is uploaded as q8_0r; q5_0 as q5_0r, which only gemv_mma's types ask for)
MMA_FILE_TYPES = ("bf16", "q8_0", "q4_k", "q6_k", "q4_0", "q4_1", "q5_0")
MMA_SHAPES = {8: (1, 2), 16: (1, 2), 32: (2, 2), 64: (2, 2)}
MMA_WK = 4  # warps splitting k inside a block (fewer where k has fewer than 2 units per warp)
MMA_DEPTH = 4  # KB of weight loads in flight per warp: units of 1 KB per m tile, so depth MMA_DEPTH / mt
MMA_MIN_UNITS = 2  # the fewest units a warp's k slice has where the k split is chosen
MMA_BLOCKS_PER_SM = 2  # the k split over blocks aims at this many blocks per SM at the bmax-8 row tile
MMA_MAX_KPARTS = 4


def mma_k_split(quant: str, n: int, k: int, sm_count: int = 0, unit: int = 0) -> tuple[int, int]:
    """(wk, kparts) of a [n, k] weight: the k slices a row's sum is split into (warps of a block x
    blocks), from the shape alone, so that every bucket and batch 1 sum a row in the same order.
    kparts (at most MMA_MAX_KPARTS, keeping MMA_MIN_UNITS units per warp, the grid at most 1.5 waves)
    grows where that fills the bmax-8 grid's waves of MMA_BLOCKS_PER_SM blocks on each of
    ``sm_count`` SMs (132 where unknown) better by a fifth of a wave or more: a grid of 1.2 waves
    would leave most SMs idle for its last 0.2, and each part adds f32 partial sums of every row (4
    bytes per row and column). ``unit``: the elements of a warp's step (0: gemv_mma's MMA_UNIT)."""
    units = k // (unit or MMA_UNIT[quant])
    wk = max(1, min(MMA_WK, units // MMA_MIN_UNITS))
    mt, wm = MMA_SHAPES[8]
    tiles = _cdiv(n, 16 * mt * wm)
    slots = MMA_BLOCKS_PER_SM * (sm_count or 132)

    def fill(kparts: int) -> float:
        return tiles * kparts / (_cdiv(tiles * kparts, slots) * slots)

    best = 1
    for kparts in range(2, min(MMA_MAX_KPARTS, units // (wk * MMA_MIN_UNITS)) + 1):
        if tiles * kparts > 1.5 * slots:
            break  # (a grid already in waves: the partial sums would buy nothing)
        if fill(kparts) >= fill(best) + 0.2:
            best = kparts
    return wk, best


def gemv_mma_params(
    quant: str,
    n: int,
    k: int,
    bmax: int,
    *,
    sm_count: int = 0,
    residual: bool = False,
    out_dtype: str = "bf16",
    x_stride: int = 0,
    glu: int = 0,
    prologue: str = "none",
    eps: float = 0.0,
) -> dict[str, Any] | None:
    """The gemv_mma params of a decode linear on a [n, k] weight uploaded as ``quant`` for passes of
    up to ``bmax`` rows (bmax 8 also serves batch 1), or None where the kernel does not apply (a type
    without a gemv_mma decoder, k not a whole number of its units and blocks, x rows not 16-byte aligned).
    ``glu``: a gate|up weight storing silu(gate) * up (each m tile 8 gate rows and their 8 up rows);
    ``prologue`` "norm": x normalised inside (rmsnorm with ``eps``; the norm weight a trailing arg).
    No tuning knob: the k split is ``mma_k_split``'s, the row tile MMA_SHAPES[bmax]."""
    ue = MMA_UNIT.get(quant)
    if ue is None or k % ue or k % QUANTS[quant][0] or x_stride % 8:
        return None
    mt, wm = MMA_SHAPES[bmax]
    wk, kparts = mma_k_split(quant, n, k, sm_count)
    # at bmax 8 and 16, 128 registers a thread: 2 blocks of 256 threads per SM (the k split's waves
    # assume it; q6_kr's raw units, and q4_k's at bmax 16, then take depth 2 to fit without spills),
    # (4 of 128 threads where a small k leaves fewer warps: depth 1 for the 4-bit types)
    min_blocks = 256 // (32 * wm * wk) * 2 if bmax <= 16 else 1
    depth = max(1, MMA_DEPTH // mt)
    if min_blocks == 2 and (quant == "q6_kr" or (bmax == 16 and quant == "q4_k")):
        depth = 2
    if min_blocks == 4 and quant not in ("bf16", "q8_0r"):
        depth = 1
    if bmax == 64 and quant == "q6_kr":
        depth = 1  # (registers)
    return dict(
        quant=quant,
        n=n,
        k=k,
        bmax=bmax,
        mt=mt,
        wm=wm,
        wk=wk,
        kparts=kparts,
        depth=depth,
        residual=residual,
        out_dtype=out_dtype,
        x_stride=x_stride,
        glu=glu,
        prologue=prologue,
        eps=eps,
        cluster=False,
        trigger=False,
        min_blocks=min_blocks,
    )


def mma_serves(tuning: Mapping[str, Any], dtype: str, cols: int) -> bool:
    """Whether the decode linears of a [*, cols] weight uploaded as ``dtype`` take gemv_mma: its file
    type in tuning gemv_mma.types, its layout and k within the kernel's."""
    types = (tuning.get("gemv_mma") or {}).get("types") or ()
    return REPACKED_FROM.get(dtype, dtype) in types and gemv_mma_params(dtype, 16, cols, 8) is not None


def mma_bmax(rows: int) -> int:
    """The bmax of the MMA_BUCKETS launch that runs a pass of ``rows`` rows."""
    return next(b for b, lo, hi in MMA_BUCKETS if rows >= lo and (not hi or rows <= hi))
