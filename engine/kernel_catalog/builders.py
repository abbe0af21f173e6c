"""Spec params from dims + profile tuning (linear / gemm params, the attention warps and tiles, the coop
options, upload layouts). Part of engine.kernel_catalog. Must not import CUDA, numpy or gguf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.kernel_catalog.contracts import QUANTS, STAGED_DEFAULT
from engine.kernel_catalog.layout import (
    _COOP_FILE_TYPE,
    COOP_LAYOUTS,
    COOP_Q8X_MAX,
    COOP_TYPES,
    GEMV_XSMEM_MAX,
    MMA_TYPES,
    Q8X_TYPES,
    WSM_SMEM_MAX,
    _cdiv,
    gemv_smem,
)
from engine.storage import row_bytes

# the classic gemv (kernels/gemv.cu.j2): a block of GEMV_THREADS threads owns GEMV_ROWS_PER_BLOCK
# rows (even: the glu epilogue pairs them), GEMV_UNROLL k steps in flight per thread; a decode GEMV
# serves up to GEMV_MAX_BATCH rows (wider decode batches take it more than once, or gemm_decode);
# the warp-cooperative layout's blocks are COOP_THREADS threads
GEMV_THREADS, GEMV_ROWS_PER_BLOCK, GEMV_UNROLL, GEMV_MAX_BATCH = 256, 4, 2, 8
# the classic bf16 bucket GEMVs (bmax > 1): each warp owns this many rows (kernels/_gemv_rows.cuh.j2),
# a block the batch-1 GEMV's warps per row over them (its bits per row): small blocks, so that the
# few hundred blocks of a short weight (n = 2560: 640) spread evenly over the SMs
GEMV_BF16_BUCKET_ROWS_PER_WARP = 4
COOP_THREADS = 128
# q8x staging: file type -> (rounds of x loads issued before quantising them, from this k up); the
# q8_0 down projection's 9728-element x in two rounds
Q8X_STAGE_ROUNDS = {"q8_0": (2, 8192)}


def linear_params(
    quant: str,
    n: int,
    k: int,
    tuning: Mapping[str, Any],
    *,
    residual: bool = False,
    out_dtype: str = "bf16",
    bmax: int | None = None,
    sm_count: int = 0,
    threads: int = 0,
) -> dict[str, Any]:
    """A decode gemv's params for a weight uploaded as ``quant`` (a prologue may be added after);
    ``sm_count`` sizes a capped coop grid, ``threads`` forces a coop q8x block shape (coop_options)."""
    st = STAGED_DEFAULT.get(quant, False)
    bmax = bmax or GEMV_MAX_BATCH
    layout = gemv_layout(quant, tuning, n=n, k=k)
    if layout.get("coop"):
        opts = coop_options(tuning, bmax, k, quant, n=n, sm_count=sm_count, threads=threads)
    else:  # the classic layout: gemv.prefetch on the staged path (left out of the entry name when off)
        opts = {"prefetch": True} if tuning["gemv"].get("prefetch") and st else {}
        if quant == "bf16" and bmax > 1:  # rows_per_warp rows a warp, a block a row group: the same bits
            wpr = layout["threads"] // 32 // layout["rows_per_block"]
            rpw = GEMV_BF16_BUCKET_ROWS_PER_WARP
            opts.update(rows_per_warp=rpw, rows_per_block=rpw, threads=32 * wpr)
    return dict(
        {**layout, **opts},
        stage=False if layout.get("coop") else st,
        quant=quant,
        n=n,
        k=k,
        bmax=bmax,
        residual=residual,
        out_dtype=out_dtype,
    )


def upload_type(dtype: str, cols: int, tuning: Mapping[str, Any], rows: int = 0) -> str:
    """The layout a [rows, cols] matrix stored as ``dtype`` in the file is uploaded in, where the
    coop gemv takes that type (tuning gemv_coop.types): q8_0 becomes the row-planar q8_0r when
    cols % 256 == 0, or when the matrix has at least gemv_coop.q8_0r_min_rows rows (where set: a
    tall short-row matrix such as Gemma 3 270M's 262,144 x 640 tied head, whose q8_0r rows carry
    16 bytes of d-plane padding; ``rows`` 0: unknown, not tall); q6_k / q4_0 / q4_1 the row-planar
    q6_kr / q4_0r / q4_1r (engine.quant.repack); else the file's layout."""
    c = tuning.get("gemv_coop") or {}
    layout = COOP_LAYOUTS.get(dtype)
    if layout is None or dtype not in c.get("types", ()):
        return dtype
    if layout == "q8_0r" and cols % 256:
        tall = int(c.get("q8_0r_min_rows") or 0)
        return layout if tall and rows >= tall else dtype
    return layout


def coop_options(
    tuning: Mapping[str, Any],
    bmax: int,
    k: int,
    quant: str,
    *,
    n: int = 0,
    sm_count: int = 0,
    threads: int = 0,
) -> dict[str, Any]:
    """The coop gemv's switches for one spec on a [n, k] weight uploaded as ``quant`` (empty where
    all are off: the default entry names), from gemv_coop's knobs (tuning.GemvCoop says what each
    does); the file type's q8x_type_tuning entry overrides the general ones, and on a tall weight
    (q8x_tall_min_n / q8x_tall_max_k) its q8x_tall_tuning entry overrides both. ``threads`` (q8x):
    the block shape of another GEMV to share a launch with (a gemv_pair part) instead of the
    tuning's; the k split is then the largest up to the tuning's that divides those warps."""
    c = tuning.get("gemv_coop") or {}
    file_type = _COOP_FILE_TYPE.get(quant, quant)  # what q8x_type_tuning / q8x_tall_tuning name
    # the file type's own q8x block shape (gemv_coop.q8x_type_tuning; 0 keeps the general knob)
    per_type = (c.get("q8x_type_tuning") or {}).get(file_type) or {}
    c = {**c, **{key: v for key, v in per_type.items() if v}}
    tall_n, tall_k = int(c.get("q8x_tall_min_n") or 0), int(c.get("q8x_tall_max_k") or 0)
    if tall_n and n >= tall_n and (not tall_k or k <= tall_k):  # a tall, short-row weight (lm_head)
        tall = (c.get("q8x_tall_tuning") or {}).get(file_type) or {}
        c = {**c, **{key: v for key, v in tall.items() if v}}
    out: dict[str, Any] = {}
    if q8x_applies(tuning, bmax, k, quant):
        out["q8x"] = True
        forced = threads
        threads = forced or c.get("q8x_threads") or COOP_THREADS
        rpw = c.get("q8x_rows_per_warp") or 1
        ksplit = int(c.get("q8x_ksplit") or 1)
        if forced and ksplit > 1:  # the largest k split up to the tuning's that divides the warps
            ksplit = max(d for d in range(1, ksplit + 1) if (forced // 32) % d == 0)
        if (
            ksplit > 1
            and n
            and int(c.get("q8x_ksplit_min_n") or 0) <= n <= int(c.get("q8x_ksplit_max_n") or 0)
        ):
            out["ksplit"] = ksplit
            threads = forced or c.get("q8x_ksplit_threads") or threads
        else:
            ksplit = 1
            if bmax == 1 and c.get("q8x_b1_rows_per_warp"):
                rpw = c["q8x_b1_rows_per_warp"]
        lanes = int(c.get("q8x_lanes_per_row") or 32)
        unroll = int(c["unroll"])
        b1_unroll = int(c.get("q8x_b1_unroll") or 0)
        if bmax == 1 and b1_unroll and b1_unroll != unroll and k <= int(c.get("q8x_b1_unroll_max_k") or k):
            out["unroll"] = b1_unroll  # segments in flight per lane and row
        if (threads, rpw, ksplit, lanes) != (COOP_THREADS, 1, 1, 32):
            out.update(threads=threads, rows_per_block=threads // 32 // ksplit * (32 // lanes) * rpw)
        if lanes != 32:
            out["lanes"] = lanes
        if c.get("q8x_blocks_per_sm") and sm_count:
            out["grid_cap"] = int(c["q8x_blocks_per_sm"]) * sm_count
        rounds, min_k = Q8X_STAGE_ROUNDS.get(file_type, (1, 0))
        if rounds > 1 and k >= min_k:
            out["stage_rounds"] = rounds
        if c.get("q8x_early_norm_w") and bmax == 1:
            out["early_nw"] = True  # (the kernel uses it only with the norm from the staging loads)
        if bmax == 1 and ksplit > 1:
            # a block reads its first tile's residual right after pdl_wait, not with its last store
            out["early_res"] = True  # (read by the k-split epilogue; the plan keeps it where a residual is)
        wkb = int(c.get("q8x_wsm_kb") or 0)
        if wkb and n and bmax == 1:  # the row tile in shared memory
            rpb = int(out.get("rows_per_block") or COOP_THREADS // 32)
            tile = rpb * row_bytes(quant, k)
            wp = {"q8x": True, "wsm": True, "bmax": bmax, "k": k, "rows_per_block": rpb, "quant": quant}
            smem = gemv_smem(wp)
            # every tile in one round of resident blocks (a block with a second tile would wait
            # for its copy after the first)
            if tile <= wkb * 1024 and one_round(tuning, smem, _cdiv(n, rpb), sm_count):
                out["wsm"] = True
    if c.get("pipeline"):
        out["pipeline"] = True
        if c.get("tile_prefetch") and not out.get("wsm"):  # (wsm: the next tile is a bulk copy)
            out["tile_pf"] = True
    return out


# the mma bucket gemv's fixed shape (kernels/_gemv_mmq.cuh.j2): blocks of `threads`, `bmax` x rows a
# block (halved, down to 8, while its shared memory would exceed GEMV_XSMEM_MAX), `unroll`
# segments in flight per warp, `blocks_per_sm` blocks per SM (each stages and quantises its x rows
# once and loops over row tiles; the runner fits the grid to the resident blocks), `stage_rounds`
# rounds of x loads in flight while staging (the template also prefetches a block's first two row
# tiles into L2 before it waits for x)
MMA_FIXED = {"threads": 256, "bmax": 32, "unroll": 4, "blocks_per_sm": 1, "stage_rounds": 8}


def mma_params(p: Mapping[str, Any], tuning: Mapping[str, Any], sm_count: int = 0) -> dict[str, Any] | None:
    """The mma gemv's params (kernels/_gemv_mmq.cuh.j2) for the bucket coop q8x gemv params ``p``
    where tuning gemv_mmq.types names its file type (MMA_TYPES: q4_k, q6_k, q8_0, q4_0, q4_1), else
    None: the same quant, shape, lanes, k split and x staging (a row's bits are the batch-1
    GEMV's), in MMA_FIXED's blocks of 16-row warp tiles (as few tiles as let their warps divide the
    virtual lanes), the grid capped at MMA_FIXED blocks_per_sm * ``sm_count`` blocks (none where
    the SM count is unknown, 0). None where the layout does not apply (not q8x, glu, bmax 8 too
    large). Which passes take it (gemv_mmq.min_rows): engine.lowering.gemv."""
    m = tuning.get("gemv_mmq") or {}
    file_type = _COOP_FILE_TYPE.get(p["quant"], p["quant"])
    if file_type not in m.get("types", ()) or p["quant"] not in MMA_TYPES or not (p.get("coop") and p.get("q8x")):
        return None
    if p.get("glu"):
        return None
    lanes, ksplit = int(p.get("lanes") or 32), int(p.get("ksplit") or 1)
    vl, threads = lanes * ksplit, MMA_FIXED["threads"]
    warps = threads // 32
    tiles = next((t for t in range(1, warps + 1) if warps % t == 0 and vl % (warps // t) == 0), 0)
    if not tiles:
        return None
    q = dict(
        p,
        mma=True,
        lanes=lanes,
        ksplit=ksplit,
        threads=threads,
        rows_per_block=16 * tiles,
        unroll=MMA_FIXED["unroll"],  # (segments in flight per warp)
        grid_cap=MMA_FIXED["blocks_per_sm"] * sm_count,
        min_blocks=0,
        stage_rounds=MMA_FIXED["stage_rounds"],
        # (the coop layout's batch-1 and pipelining options: not this kernel's)
        pipeline=False, tile_pf=False, wsm=False, trigger=False, early_nw=False, early_res=False, l2_pf="",
    )
    bmax = MMA_FIXED["bmax"]
    while bmax > 8 and gemv_smem({**q, "bmax": bmax}) > GEMV_XSMEM_MAX:
        bmax //= 2
    q["bmax"] = bmax
    return q if gemv_smem(q) <= GEMV_XSMEM_MAX else None


def one_round(tuning: Mapping[str, Any], smem: int, blocks: int, sm_count: int) -> bool:
    """Whether ``blocks`` q8x GEMV blocks of ``smem`` bytes of dynamic shared memory are all on
    the GPU at once: at most gemv_coop.q8x_blocks_per_sm (32 where unset) and 227 KB over ``smem``
    blocks per SM, times ``sm_count`` (True where the SM count is unknown, 0)."""
    per_sm = min(int((tuning.get("gemv_coop") or {}).get("q8x_blocks_per_sm") or 32), WSM_SMEM_MAX // smem)
    return not sm_count or blocks <= per_sm * sm_count


def decode_bmax(quant: str, k: int, tuning: Mapping[str, Any]) -> int:
    """The x rows a bucket decode GEMV of a [*, k] weight uploaded as ``quant`` takes per grid row:
    GEMV_MAX_BATCH, or fewer where the batch-1 GEMV has int8 x rows (q8x) and GEMV_MAX_BATCH of
    them would not fit COOP_Q8X_MAX (a long-k down projection: 9728 x 8 x 1.5 bytes): the largest
    power of two that does, so every bucket row is quantised as the batch-1 row is and gets its
    bits (batched equal to solo; the grid then reads the weight once per that many rows)."""
    if not q8x_applies(tuning, 1, k, quant) or q8x_applies(tuning, GEMV_MAX_BATCH, k, quant):
        return GEMV_MAX_BATCH
    b = GEMV_MAX_BATCH
    while b > 1 and not q8x_applies(tuning, b, k, quant):
        b //= 2
    return b


def q8x_applies(tuning: Mapping[str, Any], bmax: int, k: int, quant: str) -> bool:
    """Whether a coop decode gemv of bmax rows on a [*, k] weight uploaded as ``quant`` takes the
    int8-x path: gemv_coop.q8x on, a type with a dp4a decoder, its x rows within COOP_Q8X_MAX."""
    c = tuning.get("gemv_coop") or {}
    return (
        bool(c.get("q8x"))
        and quant in Q8X_TYPES
        and gemv_smem({"q8x": True, "bmax": bmax, "k": k}) <= COOP_Q8X_MAX
    )


# the 32-value block types: the classic GEMV gives a row's warps chunks of 32 of their blocks
LEGACY_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def gemv_layout(quant: str, tuning: Mapping[str, Any], *, n: int = 0, k: int = 0) -> dict[str, Any]:
    """threads / rows_per_block / unroll (and coop=True) of a decode gemv on a [n, k] weight
    uploaded as ``quant``: the warp-cooperative layout where tuning gemv_coop.types names the file
    type, else the classic gemv tuning, whose GEMVs with n <= gemv.short_n_max take
    gemv.b1_short_n_threads threads where set (at every bmax: batch-invariant bits) (more warps per row on the short, long-k weights).
    A classic row of a 32-value block type gets no more warps than the power of two its chunks of
    32 blocks need (``k`` given): a warp past them finds no block of its row (kernels/gemv.cu.j2 deals chunk c to
    warp c % WPR of the row) and only holds a slot at the block's barriers, so the block keeps its
    rows with fewer threads (Gemma 3 270M's 640-value rows: 20 blocks, one warp's chunk; its
    262,144-row head runs 128 threads a block, not 256 of which half idled)."""
    c = tuning.get("gemv_coop") or {}
    file_type = _COOP_FILE_TYPE.get(quant, quant)
    if quant in COOP_TYPES and file_type in c.get("types", ()):
        return dict(
            coop=True,
            threads=COOP_THREADS,
            rows_per_block=COOP_THREADS // 32,
            unroll=c["unroll"],
        )
    g = tuning["gemv"]
    threads = GEMV_THREADS
    # (every bmax alike: the warps per row set how a row's k is split, hence its sum's bits)
    if n and g.get("b1_short_n_threads") and n <= int(g.get("short_n_max") or 0):
        threads = int(g["b1_short_n_threads"])
    rpb = GEMV_ROWS_PER_BLOCK
    if k and quant in LEGACY_TYPES and (threads // 32) % rpb == 0:
        chunks = -(-(k // QUANTS[quant][0]) // 32)
        wpr = threads // 32 // rpb
        while wpr > 1 and wpr // 2 >= chunks:  # (each chunk keeps its own warp)
            wpr //= 2
        threads = 32 * rpb * wpr
    return dict(threads=threads, rows_per_block=rpb, unroll=GEMV_UNROLL)


# the gemm params (kernels/gemm.cu.j2) in their order, and the ones each tuning section keeps fixed
GEMM_KNOBS = ("tile_m", "tile_n", "tile_k", "stages", "warps", "warps_m", "split_k", "swizzle", "fragbuf")
GEMM_FIXED = {
    "gemm": {"tile_m": 128, "tile_n": 128, "stages": 3, "warps": 8, "warps_m": 2, "split_k": 1, "fragbuf": False},
    "gemm_decode": {"tile_k": 128, "warps": 8, "warps_m": 2},
}
# the fewest decode rows that run bf16 linears as gemm_decode GEMMs (engine.plan's wide bucket)
GEMM_DECODE_MIN_ROWS = 16


def gemm_params(
    n: int,
    k: int,
    tuning: Mapping[str, Any],
    *,
    residual: bool = False,
    out_dtype: str = "bf16",
    quant: str = "bf16",
    section: str = "gemm",
) -> dict[str, Any]:
    """gemm params from the profile's ``section`` ("gemm": prefill, "gemm_decode": wide decode
    batches) over GEMM_FIXED. A k that tile_k does not divide falls back to the largest of 64/32/16
    (times split_k) that divides it (the check still rejects a k no tile fits)."""
    g = {**GEMM_FIXED[section], **dict(tuning[section])}
    if k % g["tile_k"]:
        for tk in (64 * g["split_k"], 32 * g["split_k"], 16 * g["split_k"]):
            if k % tk == 0 and (quant == "bf16" or tk % 32 == 0):
                g["tile_k"] = tk
                break
    return dict(
        n=n, k=k, residual=residual, out_dtype=out_dtype, quant=quant, **{x: g[x] for x in GEMM_KNOBS}
    )


# the wgmma GEMM's wide tile (setmaxnreg: producer 40, consumers 232 registers) and the narrow one
# of the weights with n < gemm_wgmma.wide_min_n; consumers: warpgroups of 64 * m_frags rows each
GEMM_WGMMA_TILE = ("tile_n", "consumers", "m_frags", "stages", "raster", "maxnreg")
GEMM_WGMMA_WIDE = {"tile_n": 256, "consumers": 2, "m_frags": 1, "stages": 4, "raster": True, "maxnreg": True}
GEMM_WGMMA_NARROW = {**GEMM_WGMMA_WIDE, "tile_n": 128, "stages": 6, "maxnreg": False}


def gemm_wgmma_params(
    n: int, k: int, tuning: Mapping[str, Any], *, residual: bool = False, out_dtype: str = "bf16"
) -> dict[str, Any] | None:
    """gemm_wgmma params for a bf16 weight of n x k (the profile's ``gemm_wgmma`` section picks
    the tile), or None where it does not apply (off on this profile, k % 64, n % 8): the caller
    keeps "gemm"."""
    g = tuning.get("gemm_wgmma") or {}
    if not g.get("enabled") or k % 64 or n % 8:
        return None
    # few wide tiles: narrower ones keep every SM busy
    p = GEMM_WGMMA_NARROW if n < int(g.get("wide_min_n") or 0) else GEMM_WGMMA_WIDE
    return dict(n=n, k=k, residual=residual, out_dtype=out_dtype, **p)


ELEMENTWISE_THREADS = 256  # the block of the elementwise kernels (embed, rope, silu_mul, add, penalties ...)
SAMPLING_THREADS = 1024  # the block of the sampling kernels (argmax, sample, token_mask)
PREFILL_BLOCK_Q = 64  # the flash prefill's query rows per block (16 per warp)
PREFILL_WARPS = 4
DECODE_WARPS = 4  # the decode attention's warps where attention_decode.direct_warps is 0 (split and direct alike)


def prefill_block_kv(block_q: int, block_kv: int, head_dim: int) -> int:
    """The flash prefill's block_kv, halved (down to 16) until its tiles fit 99 KB of shared memory:
    wide heads (Qwen3.5's 256) take narrower K/V tiles than a profile tuned on 128."""
    while block_kv > 16 and (block_q + 4 * block_kv) * (head_dim + 8) * 2 > 99 * 1024:
        block_kv //= 2
    return block_kv


def attention_warps(warps: int, group: int, head_dim: int) -> int:
    """The decode attention's warps, halved until its per-warp query staging (group x head_dim f32)
    fits 48 KB: a wide GQA group of wide heads (Qwen3.6-35B-A3B: 8 x 256) runs fewer warps."""
    while warps > 1 and warps * group * (head_dim + 2) * 4 > 48 * 1024:
        warps //= 2
    return warps


def direct_qsplit(group: int, tuning: Mapping[str, Any]) -> int:
    """The direct decode attention's split of a kv head's ``group`` query heads over grid z: the
    largest divisor of group up to tuning attention_decode.direct_qsplit (1: one block per kv head)."""
    cap = int((tuning.get("attention_decode") or {}).get("direct_qsplit", 1) or 1)
    return max(q for q in range(1, min(cap, group) + 1) if group % q == 0)


NORM_THREADS = 256  # the rmsnorm kernel's block
