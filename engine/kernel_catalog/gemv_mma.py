"""The params of gemv_mma, the tensor-core decode linear (kernels/gemv_mma.cu.j2): its row buckets,
the k split of a weight (the same at every batch size: what fixes a row's bits), the row tile of
each launch, its x staging chunks and their shared memory. Imports only the catalog's contracts
and layout (and engine.storage). Must not import CUDA.
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
# the file storage types whose upload layout gemv_mma decodes (tuning gemv_mma.types; q8_0 where it
# is uploaded as q8_0r; q5_0 as q5_0r, which only gemv_mma's types ask for)
MMA_FILE_TYPES = ("bf16", "q8_0", "q4_k", "q6_k", "q4_0", "q4_1", "q5_0")
# bmax -> (m tiles per warp, warps side by side over rows): x fragments are reused over mt m tiles
# and shared by the wm warps of a block (in shared memory: xsm; else through L1), so x bytes read
# per weight byte stay bounded as the batch grows (bmax 8 / 16: where mma_row_tile finds no tile
# of one wave; the k split's reference tile at every bmax)
MMA_SHAPES = {8: (1, 2), 16: (1, 2), 32: (2, 2), 64: (2, 2)}
# bmax 8 / 16 row tiles (mt, wm) mma_row_tile chooses from, and the most m tiles per warp whose
# ring fits 128 registers without spills (ptxas, sm_90) at each bmax (2 where not named)
MMA_TILES = ((1, 2), (1, 1), (2, 2), (2, 1), (4, 2), (4, 1))
MMA_MT_MAX = {8: {"bf16": 4, "q8_0r": 4, "q4_0r": 4, "q4_1r": 4}, 16: {"bf16": 4}}
MMA_WK = 4  # warps splitting k inside a block (fewer where k has fewer than 2 units per warp)
MMA_DEPTH = 4  # KB of weight loads in flight per warp: units of 1 KB per m tile, so depth MMA_DEPTH / mt
MMA_MIN_UNITS = 2  # the fewest units a warp's k slice has where the k split is chosen
MMA_BLOCKS_PER_SM = 2  # the k split over blocks aims at this many blocks per SM at the bmax-8 row tile
MMA_MAX_KPARTS = 4
# (upload type, bmax) whose launches stage x in shared memory on mma_row_tile's tile; the others
# keep MMA_SHAPES' tile with x from global memory. H100, tools/gpu_linear_bench.py, 2026-12-07, the
# Qwen3-4B shapes summed: bf16 b1 71.4 % of the copy staged vs 64.3 % not, b8 63.9 vs 63.5; b32
# 42.9 vs 54.8; q4_k b1 27.3 vs 37.0, b8 17.0 vs 34.7; q6_k b1 35.0 vs 47.8 (docs/PERFORMANCE.md)
MMA_STAGED = frozenset({("bf16", 8)})
# bmax -> the most shared memory a block's x stages take: 4 blocks of 128 threads an SM at bmax 8
# (mma_row_tile's), 2 of 256 above
MMA_XSM_BYTES = {8: 48 * 1024, 16: 96 * 1024, 32: 96 * 1024, 64: 96 * 1024}
SMEM_MAX = 227 * 1024  # a block's shared memory on sm_90 (sm_80: 163 KB; the x chunk stays below both)
SM_SMEM = 228 * 1024  # an SM's (sm_90)


def _x_rounds(quant: str, k: int, wk: int, kparts: int) -> int:
    """The unit rounds of a block's k part: its units (the first part's, the most) over wk warps."""
    return _cdiv(_cdiv(k // MMA_UNIT[quant], kparts), wk)


def mma_smem(p: Mapping[str, Any]) -> int:
    """Dynamic shared memory bytes of gemv_mma ``p``: with xsm (units a warp takes from an x
    chunk) its x stages, [stages][bmax][row] bf16 (kernels/gemv_mma.cu.j2's XST, XROW), else 0."""
    if not p.get("xsm"):
        return 0
    ue, wk = MMA_UNIT[p["quant"]], p["wk"]
    chunk = p["xsm"] * wk * ue  # elements of a chunk's row
    stages = 1 if p["xsm"] >= _x_rounds(p["quant"], p["k"], wk, p["kparts"]) else 2
    return stages * p["bmax"] * (chunk + (32 if chunk * 2 % 128 == 0 else 0)) * 2


def mma_xchunk(quant: str, k: int, bmax: int, wk: int, kparts: int) -> int:
    """The xsm of a launch: the unit rounds of an x chunk -- the whole k part where its bmax rows
    fit MMA_XSM_BYTES[bmax] (one stage, loaded once), else the most rounds whose two stages fit; 0 (x
    read from global memory) where not even one round's do."""
    rounds = _x_rounds(quant, k, wk, kparts)
    p = dict(quant=quant, k=k, bmax=bmax, wk=wk, kparts=kparts)
    for xsm in (rounds, *range(rounds - 1, 0, -1)):
        if mma_smem({**p, "xsm": xsm}) <= MMA_XSM_BYTES[bmax]:
            return xsm
    return 0


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


def mma_red_bytes(bmax: int, mt: int, wm: int, wk: int) -> int:
    """Static shared memory of the k groups' sums (kernels/gemv_mma.cu.j2's red): a slice of
    wm * mt * bmax * 64 bytes per group past the first where those fit 16 KB (one barrier), else one."""
    one = wm * mt * bmax * 64
    return 0 if wk == 1 else (wk - 1) * one if (wk - 1) * one <= 16384 else one


def mma_min_blocks(bmax: int, wm: int, wk: int) -> int:
    """__launch_bounds__' minimum of resident blocks per SM: at bmax 8 and 16 those that give a
    thread 128 registers (2 blocks of 256 threads, 4 of 128, ...), above 1 (no bound)."""
    return max(1, 256 // (32 * wm * wk) * 2) if bmax <= 16 else 1


def mma_resident(bmax: int, mt: int, wm: int, wk: int, smem: int) -> int:
    """The blocks an SM holds at once at bmax 8 and 16 (mma_min_blocks' register bound; fewer where
    ``smem`` bytes of x stages, the k groups' static buffer and the 1 KB an SM reserves per block
    bind them); above, 2 (the k split's assumption)."""
    if bmax > 16:
        return MMA_BLOCKS_PER_SM
    resident = mma_min_blocks(bmax, wm, wk)
    if smem:
        resident = min(resident, SM_SMEM // (smem + mma_red_bytes(bmax, mt, wm, wk) + 1024))
    return resident


def mma_row_tile(quant: str, n: int, bmax: int, wk: int, kparts: int, smem: int, sm_count: int = 0) -> tuple[int, int]:
    """(mt, wm) of a launch: at bmax 32 and 64 MMA_SHAPES[bmax]; at bmax 8 and 16 (batch 1 and the
    small buckets) the MMA_TILES tile whose grid (row tiles x kparts) runs in one wave of the blocks
    an SM holds (2 of 256 threads or 4 of 128 for 128 registers, fewer where ``smem`` bytes of x
    stages limit them) on ``sm_count`` SMs (132 where unknown) and spreads most evenly over the SMs
    (blocks / SMs over its ceiling; then the most warps, the most blocks), within MMA_MT_MAX; where
    none fits one wave, MMA_SHAPES[bmax]. Only which warp computes which rows: never a row's bits."""
    if bmax > 16:
        return MMA_SHAPES[bmax]
    sms = sm_count or 132
    best, key = MMA_SHAPES[bmax], None
    for mt, wm in MMA_TILES:
        if mt > MMA_MT_MAX.get(bmax, {}).get(quant, 2):
            continue
        resident = mma_resident(bmax, mt, wm, wk, smem)
        blocks = _cdiv(n, 16 * mt * wm) * kparts
        if blocks > resident * sms:
            continue  # (waves: each block's start and end paid again)
        k = (round(blocks / sms / _cdiv(blocks, sms), 2), blocks * wm * wk, blocks)
        if key is None or k > key:
            best, key = (mt, wm), k
    return best


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
    stage_x: bool | None = None,
    fit_tile: bool | None = None,
) -> dict[str, Any] | None:
    """The gemv_mma params of a decode linear on a [n, k] weight uploaded as ``quant`` for passes of
    up to ``bmax`` rows (bmax 8 also serves batch 1), or None where the kernel does not apply (a type
    without a gemv_mma decoder, k not a whole number of its units and blocks, x rows not 16-byte aligned).
    ``glu``: a gate|up weight storing silu(gate) * up (each m tile 8 gate rows and their 8 up rows);
    ``prologue`` "norm": x normalised inside (rmsnorm with ``eps``; the norm weight a trailing arg).
    ``stage_x`` / ``fit_tile`` False: x read from global memory / the row tile MMA_SHAPES[bmax] (the
    launches before either existed: tools/gpu_linear_bench.py times them as ``plan=base``); None:
    MMA_STAGED's choice.
    No tuning knob: the k split is ``mma_k_split``'s (the weight's shape alone), the row tile
    ``mma_row_tile``'s, x staged in shared memory in ``mma_xchunk``'s chunks."""
    ue = MMA_UNIT.get(quant)
    if ue is None or k % ue or k % QUANTS[quant][0] or x_stride % 8:
        return None
    wk, kparts = mma_k_split(quant, n, k, sm_count)
    staged = (quant, bmax) in MMA_STAGED
    stage_x = staged if stage_x is None else stage_x
    fit_tile = staged if fit_tile is None else fit_tile
    xsm = mma_xchunk(quant, k, bmax, wk, kparts) if stage_x else 0
    smem = mma_smem(dict(quant=quant, k=k, bmax=bmax, wk=wk, kparts=kparts, xsm=xsm))
    mt, wm = mma_row_tile(quant, n, bmax, wk, kparts, smem, sm_count) if fit_tile else MMA_SHAPES[bmax]
    # at bmax 8 and 16, 128 registers a thread: 2 blocks of 256 threads (4 of 128) per SM; the units
    # in flight per warp (depth x mt m tiles) MMA_DEPTH, but q6_kr's raw units (and q4_k's at bmax
    # 16) 2, to fit without spills, and the 4-bit types' 1 where a small k leaves fewer warps
    min_blocks = mma_min_blocks(bmax, wm, wk)
    units = MMA_DEPTH
    if bmax <= 16 and (quant == "q6_kr" or (bmax == 16 and quant == "q4_k")):
        units = 2
    if bmax <= 16 and wk < MMA_WK and quant not in ("bf16", "q8_0r"):
        units = 1
    depth = max(1, units // mt)
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
        trigger=False,
        min_blocks=min_blocks,
        xsm=xsm,
    )


def mma_serves(tuning: Mapping[str, Any], dtype: str, cols: int) -> bool:
    """Whether the decode linears of a [*, cols] weight uploaded as ``dtype`` take gemv_mma: its file
    type in tuning gemv_mma.types, its layout and k within the kernel's."""
    types = (tuning.get("gemv_mma") or {}).get("types") or ()
    return REPACKED_FROM.get(dtype, dtype) in types and gemv_mma_params(dtype, 16, cols, 8) is not None


def mma_bmax(rows: int) -> int:
    """The bmax of the MMA_BUCKETS launch that runs a pass of ``rows`` rows."""
    return next(b for b, lo, hi in MMA_BUCKETS if rows >= lo and (not hi or rows <= hi))
