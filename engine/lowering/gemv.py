"""The GEMV lowering of linear layers in decode passes (kernels/gemv.cu.j2, gemv_pair.cu.j2).

One launch per weight allocation: the classic layout (tuning gemv) or the warp-cooperative one
(tuning gemv_coop, q8x: int8 x rows and dp4a; in bucket decode, for the types tuning gemv_mmq
names, the int8 tensor-core GEMV with the same per-row bits, kernel_catalog.mma_params, from
gemv_mmq.min_rows rows: two launches, each bounded to its passes' row counts), with a
prologue where a decode rmsnorm / silu_mul was folded into it (the Lowerer's ``prologue``), a glu
epilogue on a gate|up GEMV whose silu_mul it replaces, and at batch 1 a q4_k_m layer's two q|k / v
GEMVs as one gemv_pair launch (tuning decode_graph.pair_linears) or on two streams
(decode_graph.fork_linears). A helper of the ``linear`` unit. Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, Arg, Launch, val, wgt
from engine.lowering.context import PROLOGUE_MODES
from engine.types import ConfigError


def gemv_signature(p: dict) -> tuple:
    """What fixes a gemv's per-row bits: its reduction structure, type, shape and epilogue."""
    tail = (p["quant"], p["n"], p["k"], p["residual"], p["out_dtype"])  # (glu: silu_mul's bits)
    if p["coop"]:
        return ("coop", p["q8x"], p["ksplit"], p["lanes"], *tail)
    return ("classic", p["threads"] // 32 // (p["rows_per_block"] // p.get("rows_per_warp", 1)), *tail)


def linear_gemv(ctx, op, mode, ins, outs, ws, layer=None):
    # the launches of each weight allocation; a fused allocation writes its outputs' shared buffer
    per_w, col = [], 0
    for w in ws:
        per_w.append(gemv_launches(ctx, op, layer, mode, ins, outs[col], w))
        col += len(w.parts)
    paired = pair(ctx, op, layer, mode, ins, outs, ws, [la for las in per_w for la in las])
    if paired is None and mode != "decode1" and len(per_w) == 2 and ctx.graph_knob("pair_linears"):
        per_w[1] = bucket_like_pair(ctx, op, layer, mode, ins, outs, ws, per_w[1])
    return [paired] if paired is not None else fork(ctx, mode, per_w)


def bucket_like_pair(ctx, op, layer, mode, ins, outs, ws, second: list[Launch]) -> list[Launch]:
    """A bucket decode's second GEMV of a linear that pairs at batch 1, in the pair's block shape:
    the batch-1 pair re-plans that part in its first part's blocks, which can take another k split
    (q4_k's 4 becomes 2 in 320-thread blocks), and a row must get the same bits in a bucket as
    alone (tests/fixtures/batch_invariance.py). Else (no pair, or the same reduction) ``second`` as
    it is (the weight's launches: an mma one has its coop twin's reduction)."""
    one = [gemv_launch(ctx, op, layer, "decode1", ins, outs[0], ws[0]),
           gemv_launch(ctx, op, layer, "decode1", ins, outs[len(ws[0].parts)], ws[1])]  # fmt: skip
    paired = pair(ctx, op, layer, "decode1", ins, outs, ws, one)
    if paired is None or gemv_signature(kc.pair_parts(paired.spec)[1].params) == gemv_signature(second[0].spec.params):
        return second
    return gemv_launches(ctx, op, layer, mode, ins, outs[len(ws[0].parts)], ws[1], part_threads=one[0].block[0])


def gemv_launches(ctx, op, layer, mode, ins, out, w, part_threads: int = 0) -> list[Launch]:
    """``gemv_launch``'s launch and, in bucket decode (mode "decode") where tuning gemv_mmq takes the weight
    (kernel_catalog.mma_params of that coop q8x spec), the int8 tensor-core GEMV with its per-row
    bits: for every pass (gemv_mmq.min_rows 0 or 1) in its place, else for passes of min_rows rows
    and more (the runner binds a launch only at the row counts it ``runs_at``), the coop GEMV for
    the passes below, as it is without the knob."""
    la = gemv_launch(ctx, op, layer, mode, ins, out, w, part_threads)
    if mode != "decode":  # (decode1, prefill: the coop GEMV alone)
        return [la]
    mma = kc.mma_params(la.spec.params, ctx.profile.tuning, ctx.profile.sm_count)
    if mma is None:
        return [la]
    ml = spec_launch(ctx, ctx.spec("gemv", **mma), la.args)
    rows = int(ctx.tune("gemv_mmq").get("min_rows") or 0)
    if rows <= 1:
        return [ml]
    return [dataclasses.replace(la, max_rows=rows - 1), dataclasses.replace(ml, min_rows=rows)]


def gemv_launch(ctx, op, layer, mode, ins, out, w, part_threads: int = 0) -> Launch:
    """The GEMV launch of weight allocation ``w`` writing ``out`` (``part_threads``: a coop q8x
    layout in blocks of that many threads, for a gemv_pair part; 0: the tuning's): classic or coop,
    never the mma GEMV (``gemv_launches``)."""
    res_name = op.attrs.get("residual")
    residual = res_name is not None
    out_dtype = ctx.act_dtype(out.name)
    # (a bucket GEMV whose int8 x rows would not fit at GEMV_MAX_BATCH takes fewer rows a grid row,
    # not float x rows: its rows must get the batch-1 GEMV's bits)
    bmax = 1 if mode == "decode1" else kc.decode_bmax(w.dtype, w.cols, ctx.profile.tuning)
    pro = ctx.prologue.get((mode, ins[0].name)) if mode in PROLOGUE_MODES else None
    xv, extra, pp = ins[0], (), {}
    if pro is not None and pro[0] == "glu" and pro[1].width == w.cols:
        xv = pro[1]  # the gate half of gate|up already holds silu(gate) * up
        pp = dict(x_stride=xv.ld)
    elif pro is not None and pro[1].width == w.cols:
        xv = pro[1]
        pp = dict(prologue=pro[0], x_stride=xv.ld)
        if pro[0] == "norm":
            pp["eps"] = repr(float(ctx.dims["rms_eps"]))
            extra = (wgt(pro[2]),)
        else:
            pp["u_off"] = pro[2]
    elif pro is not None:
        raise ConfigError(
            f"plan: fused {pro[0]} of width {pro[1].width} feeds a linear of k={w.cols}"
        )
    # the layout (classic, or warp-cooperative where tuning gemv_coop names the type) and its options
    p = kc.linear_params(
        w.dtype, w.rows, w.cols, ctx.profile.tuning, residual=residual, out_dtype=out_dtype, bmax=bmax,
        sm_count=ctx.profile.sm_count, threads=part_threads,
    )
    if p.get("coop"):
        if pp.get("prologue") != "norm":  # early norm weights: only a norm prologue has them
            p.pop("early_nw", None)
        if not residual:  # the early residual: only a GEMV that adds one
            p.pop("early_res", None)
        if mode == "decode1" and ctx.graph_knob("early_trigger"):
            p["trigger"] = True  # the next kernel may launch once the first loads are out
        if (
            mode == "decode1"
            and p.get("q8x")
            and ctx.tune("gemv_coop").get("q8x_glu")
            and p.get("ksplit", 1) == 1
            and not p.get("wsm")
        ):  # the gate|up GEMV stores silu(gate) * up (a glu epilogue over its tile's row pairs)
            glu = glu_for(ctx, op, layer, mode, w, residual, out_dtype, p["rows_per_block"])
            if glu:
                pp["glu"] = glu
    else:
        glu = glu_for(ctx, op, layer, mode, w, residual, out_dtype)  # a classic-layout epilogue
        if glu:
            pp["glu"] = glu
    spec = ctx.spec("gemv", **p, **pp)
    res = Arg("value", res_name) if residual else NULL
    if spec.params.get("glu"):
        ctx.glu_done.add((mode, out.name))
    return spec_launch(ctx, spec, (val(out), wgt(w), val(xv), res, ROWS) + extra)


def spec_launch(ctx, spec, args: tuple) -> Launch:
    """The launch of gemv ``spec``: a grid row per ``bmax`` rows (the mma GEMV's own bmax); a capped
    grid (grid_cap: its blocks loop over row tiles) fitted by the runner to the resident blocks
    (always for the mma GEMV, the coop one with gemv_coop.q8x_resident_grid)."""
    bm = spec.params["bmax"]
    grid: tuple = (kc.gemv_grid_x(spec.params), f"(n + {bm - 1}) // {bm}")
    fit = bool(spec.params.get("grid_cap")) and bool(
        spec.params["mma"] or ctx.profile.tune("gemv_coop").get("q8x_resident_grid")
    )
    return Launch(spec, grid, (spec.params["threads"],), args, kc.gemv_smem(spec.params), fit_grid=fit)


def pair(ctx, op, layer, mode, ins, outs, ws, launches: list[Launch]) -> Launch | None:
    """A batch-1 linear op's two GEMV launches as one gemv_pair launch (tuning
    decode_graph.pair_linears; kernels/gemv_pair.cu.j2), or None where they stay apart: only coop
    q8x GEMVs without a residual, glu or a tile loop, the second re-planned in the first's block
    shape (``bucket_like_pair`` gives the bucket GEMV the same shape), and with wsm only where every
    block of the pair is resident at once (docs/kernels.md, "Two GEMVs in one launch")."""
    if mode != "decode1" or len(launches) != 2 or not ctx.graph_knob("pair_linears"):
        return None
    a = launches[0]
    if not pairable(a.spec.params):
        return None
    b = gemv_launch(ctx, op, layer, mode, ins, outs[len(ws[0].parts)], ws[1], part_threads=a.block[0])
    if not pairable(b.spec.params) or b.block != a.block or b.args[2] != a.args[2]:
        return None

    min_blocks = int(ctx.tune("decode_graph").get("pair_min_blocks") or 0)
    try:  # (the pair kernel's __launch_bounds__ minimum: both parts carry it)
        spec = kc.pair_with_min_blocks([a.spec, b.spec], min_blocks)
    except ConfigError:
        return None
    smem = kc.pair_smem(spec)
    blocks = spec.params["blocks_a"] + spec.params["blocks_b"]
    if (a.spec.params["wsm"] or b.spec.params["wsm"]) and not kc.one_round(
        ctx.profile.tuning, smem, blocks, ctx.profile.sm_count
    ):
        return None
    return Launch(spec, (blocks, a.grid[1]), a.block, a.args + b.args, smem)


def pairable(p: dict) -> bool:
    """Whether a gemv spec's params allow it as a gemv_pair part (see _pair)."""
    return bool(p.get("coop") and p.get("q8x")) and not p["residual"] and not p["glu"]


def fork(ctx, mode: str, per_w: list[list[Launch]]) -> list[Launch]:
    """A decode linear's launches, per separately stored weight (q|k and v of a q4_k_m file), all
    reading the same x; the weights' after the first marked concurrent (tuning
    decode_graph.fork_linears; a weight's launches for different row counts never run together).
    Not in prefill."""
    on = ctx.graph_knob("fork_linears")
    if not on or mode == "prefill" or len(per_w) < 2:
        return [la for las in per_w for la in las]
    return [*per_w[0], *(dataclasses.replace(la, concurrent=True) for las in per_w[1:] for la in las)]


def glu_for(ctx, op, layer, mode, w, residual: bool, out_dtype: str, rpb: int = 0) -> int:
    """The glu epilogue width of a decode gate|up GEMV whose output only a fusable silu_mul reads
    (tuning gemv.fuse_glu; build_plan fills glu_ops): the intermediate size, else 0. ``rpb``:
    the GEMV's rows per block (default: the classic gemv's), which must be even."""
    if mode not in PROLOGUE_MODES or (id(op), layer) not in ctx.glu_ops or residual:
        return 0
    if len(w.part_rows) != 2 or w.part_rows[0] != w.part_rows[1] or out_dtype != "bf16":
        return 0
    if (rpb or kc.GEMV_ROWS_PER_BLOCK) % 2:
        return 0
    return w.part_rows[0]
