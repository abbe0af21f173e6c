"""The params of gemv_mmq, the int8 tensor-core decode linear (kernels/gemv_mmq.cu.j2), and of its x
quantiser gemv_mmq_x: the row buckets (gemv_mma's), the k split of a weight (the same at every batch
size: what fixes a row's bits) and the row tile of each bucket. Imports only the catalog's contracts
and gemv_mma's k split. Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.kernel_catalog.contracts import MMQ_TYPES, QUANTS
from engine.kernel_catalog.gemv_mma import MMA_SHAPES, mma_k_split
from engine.storage import REPACKED_FROM

MMQ_UNIT = 128  # elements of a warp's step per row (four int8 x blocks of 32)
# the file storage types whose upload layout gemv_mmq decodes (tuning gemv_mmq.types; q6_k where it
# is uploaded as q6_kr, q8_0 as q8_0r, q4_0 / q4_1 as q4_0r / q4_1r)
MMQ_FILE_TYPES = ("q4_k", "q6_k", "q8_0", "q4_0", "q4_1")
MMQ_X_THREADS = 128  # gemv_mmq_x's block: 1024 x elements
# xstage (the bmax-8 kernel quantising its own x rows into shared memory) where that takes at most
# this many bytes: two blocks of 256 threads per SM, as the k split's waves assume (k part of 9728)
MMQ_XSTAGE_MAX = 100 * 1024


def mmq_smem(p: Mapping[str, Any]) -> int:
    """gemv_mmq's dynamic shared memory: with xstage, 8 x rows of the k part (+ 32 bytes each) and
    their blocks' scale pairs; else none."""
    if not p["xstage"]:
        return 0
    kp = -(-(p["k"] // MMQ_UNIT) // p["kparts"]) * MMQ_UNIT
    return 8 * (kp + 32) + 2 * kp


def gemv_mmq_params(
    quant: str,
    n: int,
    k: int,
    bmax: int,
    *,
    sm_count: int = 0,
    residual: bool = False,
    out_dtype: str = "bf16",
    x_stride: int = 0,
) -> dict[str, Any] | None:
    """The gemv_mmq params of a decode linear on a [n, k] weight uploaded as ``quant`` for passes of
    up to ``bmax`` rows (bmax 8 also serves batch 1), or None where the kernel does not apply (a layout
    without a gemv_mmq decoder, k not a whole number of 128-element units and type blocks, x rows not
    16-byte aligned). The k split is gemv_mma's rule over 128-element units (``mma_k_split``), the row
    tile gemv_mma's MMA_SHAPES; the bmax-8 kernel stages and quantises its own x (xstage, reading bf16
    x of row stride ``x_stride``) where that fits MMQ_XSTAGE_MAX, the others read gemv_mmq_x's."""
    if quant not in MMQ_TYPES or k % MMQ_UNIT or k % QUANTS[quant][0] or x_stride % 8:
        return None
    mt, wm = MMA_SHAPES[bmax]
    wk, kparts = mma_k_split(quant, n, k, sm_count, unit=MMQ_UNIT)
    # (bmax 8 and 16: 128 registers a thread, 2 blocks of 256 threads per SM, as gemv_mma)
    min_blocks = 256 // (32 * wm * wk) * 2 if bmax <= 16 else 1
    depth = 1 if quant == "q4_1r" and bmax == 16 else max(1, 2 // mt)  # (q4_1r at bmax 16: registers)
    p = dict(
        quant=quant, n=n, k=k, bmax=bmax, mt=mt, wm=wm, wk=wk, kparts=kparts, depth=depth,
        residual=residual, out_dtype=out_dtype, min_blocks=min_blocks, xstage=bmax == 8, x_stride=x_stride,
    )  # fmt: skip
    if not p["xstage"] or mmq_smem(p) > MMQ_XSTAGE_MAX:
        p.update(xstage=False, x_stride=0)
    return p


def mmq1_smem(p: Mapping[str, Any]) -> int:
    """gemv_mmq1's dynamic shared memory: its x rows' k part as int8 and their blocks' scale pairs
    (lanes=4: and wk units more, which the lanes past their slices' units read)."""
    kp = -(-(p["k"] // MMQ_UNIT) // p["kparts"]) * MMQ_UNIT
    return p["bmax"] * (kp + kp // 4) + (MMQ_UNIT * p["wk"] if p.get("lanes", 1) == 4 else 0)


# gemv_mmq1's launches of a decode linear: (bmax, fewest rows, most rows) -- batch 1 and the 2- and
# 3-4-row passes (dp4a: cheaper than the mma's 8 columns there); the bmax-8 gemv_mmq from 5 rows
MMQ1_BUCKETS = ((1, 0, 1), (2, 2, 2), (4, 3, 4))
# gemv_mmq1's geometry (never a row's bits): MMQ1_LANES lanes per (weight row, k slice) -- 4: each
# reads 16-32 contiguous bytes of a unit and owns one of its four blocks, the row's f32 chain passed
# lane to lane, so four times the warps of lanes=1 (a lane a row's slice) stream the weight.
# MMQ1_WARPS (lanes -> bmax -> warps a block, fewer for a weight whose blocks would not cover the
# SMs; 32 / (wk lanes) rows a warp): every block stages and quantises its x k part, some 145
# instructions a thread per 8 elements (ptxas sm_90), so at least as many rows a block as lanes=1's
# 4 warps had (at 8 warps, lanes=4, the staging was half the main loop's instructions). MMQ1_DEPTH: units in flight per lane (lanes=1: 72-136 bytes a unit; lanes=4
# 16-32 and the unit's scales: as deep as 64 registers hold without spills at batch 1, 48-64 bytes a
# lane). MMQ1_SM_WARPS: the warps an SM holds at once at lanes=4 per bmax (__launch_bounds__'
# min_blocks = MMQ1_SM_WARPS / warps): 32 (64 registers a thread) at 1 and 2 x rows; 24 warps of 80
# registers for 4 x rows' accumulators and dots. 8 warps a block at every bmax: at batch 1 on an
# H100 (tools/gpu_linear_bench.py --mmq1-variants, 2026-12-07) 8 warps beat 16 on q4_k / q6_k /
# q8_0 (52.7 / 60.7 / 74.2 % of copy against 52.3 / 58.4 / 72.3 %).
MMQ1_LANES = 4
MMQ1_WARPS = {1: {1: 4, 2: 4, 4: 4}, 4: {1: 8, 2: 8, 4: 8}}
MMQ1_DEPTH = {
    1: {"q4_k": 2, "q6_kr": 2, "q8_0r": 1, "q4_0r": 2, "q4_1r": 2},
    4: {"q4_k": 3, "q6_kr": 2, "q8_0r": 2, "q4_0r": 3, "q4_1r": 3},
}
MMQ1_SM_WARPS = {1: 32, 2: 32, 4: 24}
# interleave (lanes=4, each lane decoding whole units with lanes=1's code, taken in turn by a group's
# lanes; a variant the plan does not pick): its ring is lanes=1's, a unit deep, in 80 registers
MMQ1_INTERLEAVE = {"warps": 8, "depth": 1, "sm_warps": 24}


def mmq1_min_blocks(lanes: int, warps: int, bmax: int, interleave: bool = False) -> int:
    """gemv_mmq1's __launch_bounds__ minimum of resident blocks per SM: at lanes=4 those of
    MMQ1_SM_WARPS[bmax] warps (interleave: MMQ1_INTERLEAVE's), at lanes=1 none (1)."""
    if lanes == 1:
        return 1
    return max(1, (MMQ1_INTERLEAVE["sm_warps"] if interleave else MMQ1_SM_WARPS[bmax]) // warps)


def mmq1_tile_rows(p: Mapping[str, Any]) -> int:
    """The weight rows of a gemv_mmq1 row tile: warps x 32 / (wk x lanes)."""
    return p["warps"] * 32 // (p["wk"] * p["lanes"])


def mmq1_grid_cap(p: Mapping[str, Any], sm_count: int = 0) -> int:
    """gemv_mmq1's grid_cap for params ``p`` on ``sm_count`` SMs (132 where unknown): for a tall weight
    at one k part (lanes=4) whose row tiles outnumber the blocks the SMs hold at once (min_blocks
    each), that many blocks, each looping over row tiles with its x staged once (every block stages
    its x: the tiles past one wave would stage it again); else 0 (a block a tile)."""
    slots = p["min_blocks"] * (sm_count or 132)
    tall = p["lanes"] == 4 and not p.get("interleave") and p["kparts"] == 1 and -(-p["n"] // mmq1_tile_rows(p)) > slots
    return slots if tall else 0


def mmq1_grid_x(p: Mapping[str, Any]) -> int:
    """gemv_mmq1's blocks over the rows: one a row tile, at most grid_cap (which then loop over them)."""
    tiles = -(-p["n"] // mmq1_tile_rows(p))
    return min(tiles, p["grid_cap"]) if p.get("grid_cap") else tiles


def gemv_mmq1_params(
    quant: str,
    n: int,
    k: int,
    *,
    sm_count: int = 0,
    residual: bool = False,
    out_dtype: str = "bf16",
    x_stride: int = 0,
    bmax: int = 1,
    lanes: int = MMQ1_LANES,
) -> dict[str, Any] | None:
    """The params of gemv_mmq1, the small-batch kernel (up to ``bmax`` rows: 1, 2, 4) giving the
    bmax-8 gemv_mmq's bits on a [n, k] weight (its k split, from gemv_mmq_params), or None where it
    does not apply (no gemv_mmq, a k split over 3 warps, more shared memory than MMQ_XSTAGE_MAX): the
    plan then runs the bmax-8 gemv_mmq for those rows."""
    p8 = gemv_mmq_params(quant, n, k, 8, sm_count=sm_count, residual=residual, out_dtype=out_dtype, x_stride=x_stride)
    if p8 is None or p8["wk"] not in (1, 2, 4):
        return None
    warps = MMQ1_WARPS[lanes][bmax]
    # a small weight: fewer warps a block, down to 4, while its blocks would not cover the SMs (the
    # same warps in all, over more SMs' load units)
    while lanes == 4 and warps > 4 and -(-n // (warps * 8 // p8["wk"])) * p8["kparts"] < (sm_count or 132):
        warps //= 2
    p = dict(
        quant=quant, n=n, k=k, wk=p8["wk"], kparts=p8["kparts"], warps=warps, depth=MMQ1_DEPTH[lanes][quant],
        residual=residual, out_dtype=out_dtype, x_stride=x_stride, prologue="none", eps=0.0, u_off=0, bmax=bmax,
        lanes=lanes, min_blocks=mmq1_min_blocks(lanes, warps, bmax), grid_cap=0,
    )  # fmt: skip
    p["grid_cap"] = mmq1_grid_cap(p, sm_count)
    return p if mmq1_smem(p) <= MMQ_XSTAGE_MAX else None


def gemv_mmq_x_params(k: int, x_stride: int = 0) -> dict[str, Any] | None:
    """The gemv_mmq_x params quantising x rows of ``k`` elements (row stride ``x_stride``, 0: k), or
    None where they cannot be (k not whole 32-blocks, rows not 16-byte aligned)."""
    if k % 32 or x_stride % 8:
        return None
    return dict(k=k, x_stride=x_stride, threads=MMQ_X_THREADS)


def mmq_stages(quant: str, k: int) -> bool:
    """Whether the batch-1 gemv_mmq of any [n, k] weight uploaded as ``quant`` stages its own x
    (xstage), so that an rmsnorm before it may fold into it (prologue norm): at one k part (a tall
    weight, or a fused allocation whose rows the caller does not know), the most shared memory."""
    p = gemv_mmq_params(quant, 1 << 20, k, 8, sm_count=1)
    return p is not None and p["kparts"] == 1 and p["xstage"]


def mmq1_folds(quant: str, n: int, k: int, sm_count: int = 0) -> bool:
    """Whether a silu_mul before the batch-1 gemv_mmq of a [n, k] weight (the down projection) may fold
    into it: gemv_mmq1 serves that weight (prologue silu; the bmax-8 gemv_mmq has no silu prologue)."""
    return n > 0 and gemv_mmq1_params(quant, n, k, sm_count=sm_count) is not None


def mmq_serves(tuning: Mapping[str, Any], dtype: str, cols: int) -> bool:
    """Whether the decode linears of a [*, cols] weight uploaded as ``dtype`` take gemv_mmq: its file
    type in tuning gemv_mmq.types, its layout and k within the kernel's."""
    types = (tuning.get("gemv_mmq") or {}).get("types") or ()
    return REPACKED_FROM.get(dtype, dtype) in types and gemv_mmq_params(dtype, 16, cols, 8) is not None
