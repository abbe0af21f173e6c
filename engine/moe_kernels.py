"""KernelSpec builders for the mixture-of-experts kernels, with each kernel's launch contract.

``topk_kernel``: kernels/moe_topk.cu.j2, top-k softmax routing on the device (router logits in,
expert ids and weights out, fixed-size buffers, no host synchronisation). ``router_kernel``:
kernels/moe_router.cu.j2, the router GEMV and that routing in one launch (decode passes). ``expert_gemv_kernel``:
kernels/moe_gemv.cu.j2, GEMVs over stacked [E, N, K] expert weights indexed by those ids: mode
``glu`` (gate and up of each chosen expert plus the silu_mul) and mode ``down`` (the down projection,
weighted by the router and summed over the chosen experts, plus the residual), one warp per
(token, slot) row: batch-1 decode; ``expert_q8_kernel`` (kernels/moe_gemv_q8.cu.j2) runs those two
modes on int8 x rows and dp4a for q4_k / q5_k / q6_k stacks (its glu optionally routing the token from
the router's logits itself). The grouped modes ``glu_grouped`` / ``down_grouped`` (+
``combine_kernel``, kernels/moe_combine.cu.j2) run one block per (row tile, chosen expert) that reads
the expert's rows once for all the tokens routed to it (grid y ``grouped_grid_y``): batched decode;
``q8round_kernel`` (kernels/moe_q8round.cu.j2) rounds their x once a step where they take it int8-rounded. Together
with the router's own GEMV (the dense gemv kernel, f32 logits) they run a Qwen3-MoE sparse MLP.
Prefill (and wide decode buckets) group on the device instead: ``sort_kernel``
(kernels/moe_sort.cu.j2: the pairs sorted by expert, a row-tile table) then ``expert_gemm_kernel``
(kernels/moe_gemm.cu.j2: a tensor-core GEMM per expert row tile, modes ``glu`` and ``down``) and
``combine_kernel``;
``shared_kernel`` (kernels/moe_shared.cu.j2) adds a sigmoid-gated shared expert's output.
engine.lowering.moe lowers the ``moe_router`` / ``moe_experts`` ops through them. ``moe_specs`` lists what a family's dims need
(tests, tests/gpu/test_moe_kernels.py).

Each builder returns a ``MoeKernel``: the spec plus ``args`` ((name, ctype) in order), ``grid(rows)``
and ``block``, the same shape as ``engine.kernel_catalog.KernelChoice`` so launch helpers take
either. Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine import storage
from engine.kernel_spec import KernelSpec, entry_name
from engine.types import ConfigError

# storage types the expert GEMV decodes (kernels/_quant.cuh.j2), with the k granularity of each: a
# quant block (engine.storage), or 8 values (one 16-byte load of bf16 / f16) for a float type
GEMV_QUANTS: dict[str, int] = {
    t: 8 if t in storage.FLOAT_TYPES else storage.BLOCK_SIZES[t][0]
    for t in ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
}
# the templates this module builds, for the catalog-completeness check (tests/test_kernels_compile.py)
KERNELS = {
    "moe_topk": "top-k softmax routing: router logits -> expert ids (int32) and weights (f32) per token",
    "moe_router": "the router GEMV and its top-k softmax routing in one launch (decode): x -> logits, expert ids and weights",
    "moe_gemv": "expert-indexed GEMV over stacked [E, N, K] weights: glu (gate, up, silu) or down "
    "(weighted sum), per (token, slot) or grouped by expert",
    "moe_gemv_q8": "the per-slot expert GEMVs (glu, down) on int8 x rows and dp4a, warp-cooperative segments: "
    "batch-1 decode over q4_k / q5_k / q6_k stacks",
    "moe_combine": "the grouped down projection's weighted sum over each token's slots (+ residual)",
    "moe_q8round": "bf16 rows rounded as moe_gemv_q8 stages them (int8 per 32 values, as f32), once a step for "
    "the grouped GEMVs' q8x_round mode",
    "moe_shared": "the sigmoid-gated shared expert's output added to the routed sum: out += sigmoid(x . g) * y",
    "moe_sort": "groups a step's (token, slot) pairs by expert: the sorted slot permutation and the row-tile table",
    "moe_gemm": "grouped tensor-core GEMM over stacked [E, N, K] weights per expert row tile: glu (gate, up, "
    "silu) or down (per-slot f32 partials)",
}
# storage types the grouped expert GEMM decodes into shared memory as bf16 (bf16 rows: cp.async)
GEMM_QUANTS = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
RAW_UNIT_QUANTS = ("q4_k", "q5_k")  # _quant.cuh.j2 splits their decode into load_raw / decode_raw (qprefetch)
GEMM_DEFAULTS = {"tile_m": 64, "tile_n": 128, "tile_k": 64, "stages": 3, "warps": 8, "warps_m": 2, "qprefetch": True}
MODES = ("glu", "down", "glu_grouped", "down_grouped")
PREFETCH = {"glu": 2, "down": 3}  # the per-slot modes' default raw units per lane in flight
MAX_SLOTS = 8192  # a grouped block's (token, slot) list: 32 KB of static shared memory
MAX_EXPERTS = 512  # moe_topk keeps E / 32 logits per lane in registers (Qwen3-Next: 512)
MAX_GRID_Y = 65535
# moe_gemv_q8 (the per-slot modes on int8 x and dp4a): the storage types, and per mode the warps per
# block, output rows per warp and segments per lane and row in flight (clamped to the lane's count)
Q8_QUANTS = ("q4_k", "q5_k", "q6_k")
Q8_DEFAULTS = {"glu": {"warps": 4, "rows_per_warp": 4, "prefetch": 2}, "down": {"warps": 8, "rows_per_warp": 2, "prefetch": 3}}
# (q6_k loads hold 5 words per 16 bytes, a q5_k segment is 80 bytes: 2 rows a warp for their glu)
Q8_TYPE_DEFAULTS = {("glu", "q6_k"): {"prefetch": 1, "rows_per_warp": 2}, ("glu", "q5_k"): {"rows_per_warp": 2}}
Q8_MAX_SMEM = 40 * 1024  # its int8 x rows and their scales live in static shared memory


@dataclass(frozen=True)
class MoeKernel:
    """A spec plus how to launch it (``grid(rows)`` -> 3-tuple; rows = tokens)."""

    spec: KernelSpec
    args: tuple[tuple[str, str], ...]
    grid: Callable[..., tuple[int, int, int]]
    block: tuple[int, int, int]
    smem: int = 0


def topk_kernel(experts: int, top_k: int, normalize: bool, warps: int = 4) -> MoeKernel:
    """moe_topk for ``experts`` router logits per token, ``top_k`` chosen, renormalised when
    ``normalize``; one warp per token, ``warps`` tokens per block. Raises ConfigError when
    ``experts`` > 512 or ``top_k`` is outside 1..min(32, experts)."""
    if not 0 < experts <= MAX_EXPERTS:
        raise ConfigError(f"moe_topk: {experts} experts; the kernel handles 1..{MAX_EXPERTS}")
    if not 0 < top_k <= min(32, experts):
        raise ConfigError(f"moe_topk: top_k {top_k} must be in 1..{min(32, experts)}")
    if warps not in (1, 2, 4, 8, 16, 32):
        raise ConfigError(f"moe_topk: warps {warps} must be a power of two up to 32")
    params = {"experts": experts, "top_k": top_k, "normalize": bool(normalize), "warps": warps}
    spec = KernelSpec(
        "moe_topk", entry_name("moe_topk", e=experts, k=top_k, n=int(normalize), w=warps), params, pdl=True
    )
    return MoeKernel(
        spec,
        (("ids", "ptr"), ("weights", "ptr"), ("logits", "ptr"), ("rows", "i32")),
        lambda rows, **_: (-(-rows // warps), 1, 1),
        (32 * warps, 1, 1),
    )


def router_kernel(
    experts: int,
    k: int,
    top_k: int,
    normalize: bool,
    wdtype: str,
    x_stride: int,
    rows_per_block: int = 2,
    tokens: int = 8,
    trigger: bool = False,
    eps: float | None = None,
    h_stride: int = 0,
    route: bool = True,
) -> MoeKernel:
    """moe_router: the [experts, k] router GEMV (``wdtype`` f32 or bf16; x rows of ``x_stride``
    elements) and moe_topk's routing in one launch, ``rows_per_block`` router rows and ``tokens``
    tokens (= warps) per block; the last block of each token group routes it (a counter per group
    in a zeroed scratch, ``router_counters``). ``trigger``: pdl_trigger() once the block's router
    rows are loaded and the wait returned. ``eps`` (not None): the rmsnorm before the router
    folded in (x un-normalised; two more args, the f32 norm weight and h, the normalised rows
    written with row stride ``h_stride``). ``route`` False: only the logits (and h), no routing
    (batch 1, where ``expert_q8_kernel``'s glu routes in its blocks). Raises ConfigError for a
    shape it does not take."""
    if not 0 < experts <= MAX_EXPERTS:
        raise ConfigError(f"moe_router: {experts} experts; the kernel handles 1..{MAX_EXPERTS}")
    if not 0 < top_k <= min(32, experts):
        raise ConfigError(f"moe_router: top_k {top_k} must be in 1..{min(32, experts)}")
    if wdtype not in ("f32", "bf16") or k % 8 or k < 8 or x_stride < k or x_stride % 8:
        raise ConfigError(f"moe_router: router {wdtype} [{experts}, {k}] (f32 or bf16, k a multiple of 8), x stride {x_stride}")
    if rows_per_block not in (1, 2, 4) or tokens not in (1, 2, 4, 8, 16):
        raise ConfigError(f"moe_router: rows_per_block {rows_per_block} (1, 2, 4), tokens {tokens} (1 .. 16)")
    norm = eps is not None
    if norm and (h_stride < k or h_stride % 8 or not float(eps) > 0):
        raise ConfigError(f"moe_router: the folded rmsnorm needs eps > 0 ({eps}) and an h stride >= k, a multiple of 8 ({h_stride})")
    params = {"experts": experts, "k": k, "top_k": top_k, "normalize": bool(normalize), "wdtype": wdtype,
              "x_stride": x_stride, "rows_per_block": rows_per_block, "tokens": tokens, "trigger": bool(trigger),
              "norm": norm, **({"eps": repr(float(eps)), "h_stride": h_stride} if norm else {}), "route": bool(route)}
    name = {"e": experts, "k": k, "top": top_k, "n": int(normalize), "xs": x_stride, "r": rows_per_block, "t": tokens,
            **({"tr": 1} if trigger else {}), **({"eps": repr(float(eps)), "hs": h_stride} if norm else {}),
            **({} if route else {"lg": 1})}
    spec = KernelSpec("moe_router", entry_name(f"moe_router_{wdtype}", **name), params, pdl=True)
    extra = (("nw", "ptr"), ("h", "ptr")) if norm else ()
    return MoeKernel(
        spec,
        (("ids", "ptr"), ("weights", "ptr"), ("logits", "ptr"), ("x", "ptr"), ("w", "ptr"), ("count", "ptr"), ("rows", "i32"))
        + extra,
        lambda rows, **_: (-(-experts // rows_per_block), -(-rows // tokens), 1),
        (32 * tokens, 1, 1),
    )


def router_counters(rows: int, tokens: int) -> int:
    """Bytes of moe_router's zeroed counters for passes of up to ``rows`` tokens."""
    return 4 * -(-rows // tokens)


def expert_gemv_kernel(
    mode: str,
    quant: str,
    n: int,
    k: int,
    top_k: int,
    rows_per_block: int = 4,
    residual: bool = False,
    experts: int = 0,
    max_slots: int = 256,
    slot_batch: int = 8,
    trigger: bool = False,
    rows_per_warp: int = 1,
    q8x_round: bool = False,
) -> MoeKernel:
    """moe_gemv ``mode`` over weights stored as ``quant``: "glu" (gate/up [E, n, k] -> act
    [rows, top_k, n]), "down" ([E, n, k] -> out [rows, n], weighted over the top_k slots, +
    residual when ``residual``), or their grouped forms for ``experts`` experts: "glu_grouped"
    (as glu) and "down_grouped" (-> f32 partial [rows, top_k, n], summed by ``combine_kernel``),
    for at most ``max_slots`` rows (tokens) per launch (an expert's (token, slot) pairs: each
    token picks an expert at most once), ``slot_batch`` slots per pass over a
    weight row. ``trigger`` (glu / down): the kernel calls pdl_trigger() once its first weight loads
    are issued (batch-1 decode); glu / down over k-quants with raw units load PREFETCH[mode] units
    per lane before the first is decoded; ``rows_per_warp``
    (grouped): output rows each warp takes one after the other, so a block's scan of ids serves
    ``rows_per_block * rows_per_warp`` rows; ``q8x_round`` (grouped, q4_k / q5_k / q6_k): x (act)
    rounded as moe_gemv_q8 stages it, given as the f32 rows ``q8round_kernel`` wrote, so a grouped
    bucket gives a token the values the per-slot q8x kernels give it (up to f32 order). Raises ConfigError for an unsupported quant, a k that
    is not a whole number of its blocks, a bad mode or shape."""
    if mode not in MODES:
        raise ConfigError(f"moe_gemv: mode {mode!r} must be one of {', '.join(MODES)}")
    if quant not in GEMV_QUANTS:
        raise ConfigError(f"moe_gemv: storage type {quant!r} is not supported ({', '.join(GEMV_QUANTS)})")
    if k % GEMV_QUANTS[quant]:
        raise ConfigError(f"moe_gemv: a {quant} row of {k} values is not a whole number of {GEMV_QUANTS[quant]}-value blocks")
    if not 0 < top_k <= 32 or n < 1 or rows_per_block not in (1, 2, 4, 8, 16):
        raise ConfigError(f"moe_gemv: bad shape n={n} top_k={top_k} rows_per_block={rows_per_block}")
    res = bool(residual) and mode == "down"
    grouped = mode.endswith("_grouped")
    params = {"mode": mode, "quant": quant, "n": n, "k": k, "top_k": top_k, "rows_per_block": rows_per_block, "residual": res}
    name = {"n": n, "k": k, "top": top_k, "r": rows_per_block, **({"res": 1} if res else {})}
    if not grouped:
        params.update(trigger=bool(trigger), prefetch=PREFETCH[mode])
        name.update({"tr": 1} if trigger else {})
    if grouped:
        if (
            not 0 < experts <= MAX_GRID_Y
            or not top_k <= max_slots <= MAX_SLOTS
            or slot_batch not in (1, 2, 4, 8, 16)
            or not 1 <= rows_per_warp <= 16
        ):
            raise ConfigError(
                f"moe_gemv {mode}: experts {experts} (1..{MAX_GRID_Y}), max_slots {max_slots} "
                f"(top_k..{MAX_SLOTS}), slot_batch {slot_batch} (1, 2, 4, 8 or 16), rows_per_warp {rows_per_warp} (1..16)"
            )
        params.update(experts=experts, max_slots=max_slots, slot_batch=slot_batch, rows_per_warp=rows_per_warp)
        name.update(e=experts, ms=max_slots, sb=slot_batch, **({"rw": rows_per_warp} if rows_per_warp != 1 else {}))
        if q8x_round:  # (x as moe_gemv_q8 rounds it: the 32-value units of its storage types)
            if quant not in Q8_QUANTS:
                raise ConfigError(f"moe_gemv {mode}: q8x_round takes {', '.join(Q8_QUANTS)}, not {quant}")
            params["q8x_round"] = True
            name["q8r"] = 1
    spec = KernelSpec("moe_gemv", entry_name(f"moe_gemv_{mode}_{quant}", **name), params, pdl=True)
    slots = top_k if mode == "glu" else 1

    def grid(rows: int, **_: Any) -> tuple[int, int, int]:
        if grouped:
            if rows > max_slots:
                raise ConfigError(f"moe_gemv {mode}: {rows} rows exceed max_slots {max_slots}")
            return (-(-n // (rows_per_block * rows_per_warp)), min(experts, rows * top_k), 1)
        if rows * slots > MAX_GRID_Y:
            raise ConfigError(f"moe_gemv: {rows} rows x {slots} slots exceed the grid's {MAX_GRID_Y}")
        return (-(-n // rows_per_block), rows * slots, 1)

    if mode in ("glu", "glu_grouped"):
        args = (("act", "ptr"), ("wg", "ptr"), ("wu", "ptr"), ("x", "ptr"), ("ids", "ptr"), ("rows", "i32"))
    elif mode == "down_grouped":
        args = (("partial", "ptr"), ("w", "ptr"), ("act", "ptr"), ("ids", "ptr"), ("rows", "i32"))
    else:
        args = (
            ("out", "ptr"),
            ("w", "ptr"),
            ("act", "ptr"),
            ("ids", "ptr"),
            ("weights", "ptr"),
            ("residual", "ptr"),
            ("rows", "i32"),
        )
    return MoeKernel(spec, args, grid, (32 * rows_per_block, 1, 1))


def q8_supported(mode: str, quant: str, k: int, top_k: int) -> bool:
    """Whether moe_gemv_q8 runs per-slot ``mode`` over a [*, k] ``quant`` stack: a q4_k / q5_k / q6_k
    row of whole super-blocks, whose staged int8 x rows (1 for glu, top_k for down) fit
    Q8_MAX_SMEM."""
    xrows = 1 if mode == "glu" else top_k
    return quant in Q8_QUANTS and k % 256 == 0 and xrows * k * 3 // 2 <= Q8_MAX_SMEM and 0 < top_k <= 32


def expert_q8_kernel(
    mode: str,
    quant: str,
    n: int,
    k: int,
    top_k: int,
    residual: bool = False,
    trigger: bool = False,
    route: tuple[int, bool] | None = None,
    shared: int = 0,
    **tuning: Any,
) -> MoeKernel:
    """moe_gemv_q8 ``mode`` ("glu" or "down", the same arguments and results as
    ``expert_gemv_kernel``'s per-slot modes, on int8 x rows and dp4a) over a ``quant`` stack;
    ``tuning`` (warps, rows_per_warp, prefetch) over Q8_TYPE_DEFAULTS and Q8_DEFAULTS[mode]. Grid (ceil(n / (warps *
    rows_per_warp)), rows * top_k (glu) or rows (down)). ``route`` ((experts, normalize); glu only): the
    kernel routes each token from the router's f32 logits itself (as moe_topk) and writes ids
    and weights, two more args (weights, logits) after rows. ``shared`` (down only: moe_shared's
    threads, which the block's must equal): the gated shared expert's add folded in (three more
    args, y, h, gate, before rows; the bits moe_shared stores). Raises ConfigError where
    ``q8_supported`` is false or the block shape is bad."""
    if mode not in ("glu", "down"):
        raise ConfigError(f"moe_gemv_q8: mode {mode!r} must be glu or down")
    if not q8_supported(mode, quant, k, top_k) or n < 1:
        raise ConfigError(f"moe_gemv_q8: {mode} over {quant} [{n}, {k}] top_k {top_k} is not supported "
                          f"({', '.join(Q8_QUANTS)}, k a multiple of 256, the int8 x rows within {Q8_MAX_SMEM} bytes)")
    t = {**Q8_DEFAULTS[mode], **Q8_TYPE_DEFAULTS.get((mode, quant), {}), **tuning}
    warps, rpw, pf = (int(t[x]) for x in ("warps", "rows_per_warp", "prefetch"))
    if warps not in (1, 2, 4, 8, 16) or rpw not in (1, 2, 4, 8) or not 1 <= pf <= 8:
        raise ConfigError(f"moe_gemv_q8: warps {warps} (1..16, a power of two), rows_per_warp {rpw} (1, 2, 4, 8), prefetch {pf} (1..8)")
    seg = 32 if quant == "q6_k" else 64
    per_lane = -(-(k // seg) * (1 if mode == "glu" else top_k) // 32)
    pf = min(pf, per_lane)
    res = bool(residual) and mode == "down"
    if route is not None and mode != "glu":
        raise ConfigError("moe_gemv_q8: only the glu routes its token (route)")
    if route is not None and not top_k <= route[0] <= MAX_EXPERTS:
        raise ConfigError(f"moe_gemv_q8: routing in the kernel takes top_k..{MAX_EXPERTS} experts ({mode}, {route})")
    if shared and (mode != "down" or shared != 32 * warps):
        raise ConfigError(f"moe_gemv_q8: the shared expert's gate folds into a down of {shared} threads ({mode}, {32 * warps})")
    params = {"mode": mode, "quant": quant, "n": n, "k": k, "top_k": top_k, "warps": warps, "rows_per_warp": rpw,
              "prefetch": pf, "residual": res, "trigger": bool(trigger), "route": route is not None, "shared": bool(shared)}
    name = {"n": n, "k": k, "top": top_k, "w": warps, "r": rpw, "pf": pf, **({"res": 1} if res else {}),
            **({"sh": 1} if shared else {}), **({"tr": 1} if trigger else {})}
    if route is not None:
        params.update(experts=int(route[0]), normalize=bool(route[1]))
        name.update(route=f"e{int(route[0])}n{int(bool(route[1]))}")
    spec = KernelSpec("moe_gemv_q8", entry_name(f"moe_gemv_q8_{mode}_{quant}", **name), params, pdl=True)
    slots = top_k if mode == "glu" else 1
    per_block = warps * rpw

    def grid(rows: int, **_: Any) -> tuple[int, int, int]:
        if rows * slots > MAX_GRID_Y:
            raise ConfigError(f"moe_gemv_q8: {rows} rows x {slots} slots exceed the grid's {MAX_GRID_Y}")
        return (-(-n // per_block), rows * slots, 1)

    if mode == "glu":
        args = (("act", "ptr"), ("wg", "ptr"), ("wu", "ptr"), ("x", "ptr"), ("ids", "ptr"), ("rows", "i32"))
        args += (("weights", "ptr"), ("logits", "ptr")) if route is not None else ()
    else:
        args = (("out", "ptr"), ("w", "ptr"), ("act", "ptr"), ("ids", "ptr"), ("weights", "ptr"), ("residual", "ptr"),
                *((("y", "ptr"), ("h", "ptr"), ("gate", "ptr")) if shared else ()), ("rows", "i32"))
    return MoeKernel(spec, args, grid, (32 * warps, 1, 1))


def combine_kernel(n: int, top_k: int, residual: bool = True, threads: int = 256, shared: int = 0) -> MoeKernel:
    """moe_combine: out [rows, n] = the router-weighted sum of the f32 ``partial`` rows that
    ``down_grouped`` wrote (+ residual, which may alias out). ``shared`` (moe_shared's threads,
    which must be ``threads``): the gated shared expert's add folded in (three more args, y, h,
    gate, before rows; the bits moe_shared stores)."""
    if not 0 < top_k <= 32 or n < 1 or threads not in (64, 128, 256, 512, 1024):
        raise ConfigError(f"moe_combine: bad shape n={n} top_k={top_k} threads={threads}")
    if shared and shared != threads:
        raise ConfigError(f"moe_combine: the shared expert's gate folds into a combine of {shared} threads, not {threads}")
    params = {"n": n, "top_k": top_k, "residual": bool(residual), "threads": threads, "shared": bool(shared)}
    name = {"n": n, "top": top_k, "t": threads, **({"res": 1} if residual else {}), **({"sh": 1} if shared else {})}
    return MoeKernel(
        KernelSpec("moe_combine", entry_name("moe_combine", **name), params, pdl=True),
        (("out", "ptr"), ("partial", "ptr"), ("weights", "ptr"), ("residual", "ptr"),
         *((("y", "ptr"), ("h", "ptr"), ("gate", "ptr")) if shared else ()), ("rows", "i32")),
        lambda rows, **_: (-(-n // threads), rows, 1),
        (threads, 1, 1),
    )


def q8round_kernel(k: int, x_stride: int, row_mult: int = 1, threads: int = 128) -> MoeKernel:
    """moe_q8round: out f32 [rows * row_mult, k] = x's bf16 rows (stride ``x_stride``) rounded per
    32-value group as moe_gemv_q8 stages them (engine.quant.q8x_round_trip), the x of the grouped
    GEMVs' ``q8x_round`` mode (``row_mult`` top_k for the act rows of a step's slots)."""
    if k % 32 or k < 32 or x_stride < k or x_stride % 8 or row_mult < 1 or threads not in (32, 64, 128, 256):
        raise ConfigError(f"moe_q8round: bad shape k={k} x_stride={x_stride} row_mult={row_mult} threads={threads}")
    params = {"k": k, "x_stride": x_stride, "row_mult": row_mult, "threads": threads}
    name = {"k": k, "xs": x_stride, **({"m": row_mult} if row_mult != 1 else {}), "t": threads}
    return MoeKernel(
        KernelSpec("moe_q8round", entry_name("moe_q8round", **name), params, pdl=True),
        (("out", "ptr"), ("x", "ptr"), ("rows", "i32")),
        lambda rows, **_: (-(-k // (32 * threads)), rows * row_mult, 1),
        (threads, 1, 1),
    )


def shared_kernel(n: int, threads: int = 256) -> MoeKernel:
    """moe_shared: out [rows, n] += sigmoid(x[t] . gate) * y[t] (the gated shared expert)."""
    if n < 1 or threads not in (64, 128, 256, 512, 1024):
        raise ConfigError(f"moe_shared: bad shape n={n} threads={threads}")
    params = {"n": n, "threads": threads}
    return MoeKernel(
        KernelSpec("moe_shared", entry_name("moe_shared", n=n, t=threads), params, pdl=True),
        (("out", "ptr"), ("y", "ptr"), ("x", "ptr"), ("gate", "ptr"), ("rows", "i32")),
        lambda rows, **_: (rows, 1, 1),
        (threads, 1, 1),
    )


def sort_kernel(experts: int, top_k: int, tile_m: int, threads: int = 1024) -> MoeKernel:
    """moe_sort: one block groups ``rows * top_k`` (token, slot) pairs by expert into a permutation
    and a table of row tiles of at most ``tile_m`` rows (see ``gemm_max_tiles``)."""
    if not 0 < experts <= MAX_EXPERTS or not 0 < top_k <= 32 or tile_m not in (16, 32, 64, 128):
        raise ConfigError(f"moe_sort: bad shape experts={experts} top_k={top_k} tile_m={tile_m}")
    if threads not in (128, 256, 512, 1024):
        raise ConfigError(f"moe_sort: threads {threads} must be 128, 256, 512 or 1024")
    params = {"experts": experts, "top_k": top_k, "tile_m": tile_m, "threads": threads}
    return MoeKernel(
        KernelSpec("moe_sort", entry_name("moe_sort", e=experts, top=top_k, m=tile_m, t=threads), params, pdl=True),
        (("perm", "ptr"), ("tiles", "ptr"), ("ids", "ptr"), ("rows", "i32")),
        lambda rows, **_: (1, 1, 1),
        (threads, 1, 1),
    )


def grouped_grid_y(top_k: int, experts: int) -> str:
    """The grouped GEMVs' grid y as a launch grid expression over the step's rows ``n``: one block
    row per expert the step can choose, min(experts, n * top_k)."""
    return f"n * {top_k} if n * {top_k} < {experts} else {experts}"


def gemm_max_tiles(rows: int, top_k: int, experts: int, tile_m: int) -> int:
    """The most row tiles moe_sort can emit for ``rows`` tokens: each expert's last tile may be
    partial, so sum(ceil(c_e / tile_m)) <= rows * top_k / tile_m + experts."""
    return rows * top_k // tile_m + experts


def gemm_grid_y(top_k: int, experts: int, tile_m: int) -> str:
    """``gemm_max_tiles`` as a launch grid expression over the step's rows ``n``."""
    return f"n * {top_k} // {tile_m} + {experts}"


def expert_gemm_kernel(mode: str, quant: str, n: int, k: int, top_k: int, experts: int, **tuning: Any) -> MoeKernel:
    """moe_gemm ``mode`` ("glu": gate/up [E, n, k] -> act [rows * top_k, n] in moe_sort's order;
    "down": [E, n, k] -> f32 partial [rows, top_k, n] by slot) over weights stored as ``quant``,
    tiles from ``tuning`` over GEMM_DEFAULTS. Raises ConfigError for an unsupported quant, a k
    that tile_k does not divide, an odd n, or tiles the warp layout cannot cover."""
    if mode not in ("glu", "down"):
        raise ConfigError(f"moe_gemm: mode {mode!r} must be glu or down")
    if quant not in GEMM_QUANTS:
        raise ConfigError(f"moe_gemm: storage type {quant!r} is not supported ({', '.join(GEMM_QUANTS)})")
    t = {**GEMM_DEFAULTS, **tuning}
    bm, bn, bk, warps, wm = (int(t[x]) for x in ("tile_m", "tile_n", "tile_k", "warps", "warps_m"))
    if k % bk or bk % 32 or n % 2 or n < 1 or not 0 < top_k <= 32 or not 0 < experts <= MAX_EXPERTS:
        raise ConfigError(
            f"moe_gemm: n={n} (even), k={k} (a multiple of tile_k {bk}, itself of 32), top_k={top_k}, experts={experts}"
        )
    wn = warps // wm if wm and warps % wm == 0 else 0
    # warp tiles: m16 fragments along m; along n, ldmatrix x4 loads n8 fragments in pairs
    if not wn or bm % (16 * wm) or bn % (16 * wn) or int(t["stages"]) < 2 or bm not in (16, 32, 64, 128):
        raise ConfigError(f"moe_gemm: tiles {bm}x{bn}x{bk} do not fit {warps} warps ({wm} along m), stages {t['stages']}")
    params = {"mode": mode, "quant": quant, "n": n, "k": k, "top_k": top_k, "experts": experts,
              "tile_m": bm, "tile_n": bn, "tile_k": bk, "stages": int(t["stages"]), "warps": warps, "warps_m": wm,
              "qprefetch": bool(t["qprefetch"]) and quant in RAW_UNIT_QUANTS}
    name = {"n": n, "k": k, "top": top_k, "e": experts, "m": bm, "bn": bn, "bk": bk, "s": t["stages"], "w": warps, "wm": wm,
            **({"qp": 1} if params["qprefetch"] else {})}
    spec = KernelSpec("moe_gemm", entry_name(f"moe_gemm_{mode}_{quant}", **name), params, pdl=True)
    per_block = bn // 2 if mode == "glu" else bn
    if mode == "glu":
        args = (("act", "ptr"), ("wg", "ptr"), ("wu", "ptr"), ("x", "ptr"), ("perm", "ptr"), ("tiles", "ptr"), ("rows", "i32"))
    else:
        args = (("partial", "ptr"), ("w", "ptr"), ("act", "ptr"), ("perm", "ptr"), ("tiles", "ptr"), ("rows", "i32"))
    return MoeKernel(
        spec,
        args,
        lambda rows, **_: (-(-n // per_block), gemm_max_tiles(rows, top_k, experts, bm), 1),
        (32 * warps, 1, 1),
        int(t["stages"]) * (bm + bn) * bk * 2,
    )


def moe_specs(
    dims: Mapping[str, Any], quants: list[str], rows_per_block: int = 4, max_slots: int = 256
) -> list[KernelSpec]:
    """Every MoE kernel a family's ``dims`` (experts, experts_used, moe_intermediate, hidden,
    norm_topk_prob) need for each expert storage type in ``quants`` (types the GEMV cannot decode
    are skipped), the grouped ones for up to ``max_slots`` (tokens x top_k) per launch."""
    e, top, inter, hidden = (int(dims[x]) for x in ("experts", "experts_used", "moe_intermediate", "hidden"))
    specs = [topk_kernel(e, top, bool(dims.get("norm_topk_prob"))).spec]
    norm = {"eps": float(dims.get("rms_eps", 1e-6)), "h_stride": hidden}  # (decode: the rmsnorm folded in)
    specs += [router_kernel(e, hidden, top, bool(dims.get("norm_topk_prob")), w, hidden, **o).spec
              for w in ("f32", "bf16") for o in ({}, norm, {**norm, "route": False})]
    for q in quants:
        if q not in GEMV_QUANTS or hidden % GEMV_QUANTS[q] or inter % GEMV_QUANTS[q]:
            continue
        specs.append(expert_gemv_kernel("glu", q, inter, hidden, top, rows_per_block).spec)
        specs.append(expert_gemv_kernel("down", q, hidden, inter, top, rows_per_block, residual=True).spec)
        for mode, n, k, res in (("glu", inter, hidden, False), ("down", hidden, inter, True)):
            if q8_supported(mode, q, k, top):
                specs.append(expert_q8_kernel(mode, q, n, k, top, residual=res).spec)
                # (batch 1: the glu routes its token, the down reads its ids and weights)
                route = (e, bool(dims.get("norm_topk_prob"))) if mode == "glu" else None
                specs.append(expert_q8_kernel(mode, q, n, k, top, residual=res, trigger=True, route=route).spec)
                sh = shared_kernel(hidden)
                if mode == "down" and dims.get("shared_intermediate") and expert_q8_kernel(mode, q, n, k, top).block == sh.block:
                    # (batch 1: the shared expert's gate and add folded in: engine.lowering.moe.shared_into_down)
                    specs.append(expert_q8_kernel(mode, q, n, k, top, residual=True, trigger=True, shared=sh.block[0]).spec)
        for mode, n, k in (("glu_grouped", inter, hidden), ("down_grouped", hidden, inter)):
            specs.append(expert_gemv_kernel(mode, q, n, k, top, rows_per_block, experts=e, max_slots=max_slots).spec)
            if q8_supported(mode.split("_")[0], q, k, top):  # (beside moe_gemv_q8's per-slot kernels)
                specs.append(expert_gemv_kernel(mode, q, n, k, top, rows_per_block, experts=e, max_slots=max_slots,
                                                q8x_round=True).spec)
                specs.append(q8round_kernel(k, k, top if mode == "down_grouped" else 1).spec)  # (h, or the act rows)
        if q in GEMM_QUANTS:
            try:
                specs.append(expert_gemm_kernel("glu", q, inter, hidden, top, e).spec)
                specs.append(expert_gemm_kernel("down", q, hidden, inter, top, e).spec)
            except ConfigError:  # a shape the GEMM does not take: prefill keeps the grouped GEMVs
                pass
    specs.append(sort_kernel(e, top, int(GEMM_DEFAULTS["tile_m"])).spec)
    specs.append(combine_kernel(hidden, top).spec)
    if dims.get("shared_intermediate"):  # (moe_shared, and folded into the batched decode's combine)
        specs += [shared_kernel(hidden).spec, combine_kernel(hidden, top, shared=shared_kernel(hidden).block[0]).spec]
    return list(dict.fromkeys(specs))
