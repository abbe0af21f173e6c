"""The int8 tensor-core lowering of quantised decode linears (kernels/gemv_mmq.cu.j2,
gemv_mmq1.cu.j2, gemv_mmq_x.cu.j2; tuning gemv_mmq.types).

A weight whose file type the profile names, uploaded in a layout gemv_mmq decodes (q4_k, q6_kr,
q8_0r, q4_0r, q4_1r), takes gemv_mmq in every decode pass: the batch-1 pass (decode1) and bucket
passes of 1, 2 or 3-4 rows run gemv_mmq1 at bmax 1, 2, 4 (kernel_catalog.MMQ1_BUCKETS: dp4a dots,
the bmax-8 kernel's bits without its dead columns; where it does not apply, the bmax-8 gemv_mmq),
the larger ones the gemv_mmq launch of their MMA_BUCKETS range (the bmax-8 one from 5 rows). The
small kernels quantise their own x rows (gemv_mmq1, the bmax-8 gemv_mmq's xstage); for the larger
buckets the op's x rows are first quantised to int8 per 32-element block by gemv_mmq_x into the
``mmq_xq`` / ``mmq_xs`` scratch (once per op, however many weight allocations read it; a launch from
the rows its first reader runs at): one quantisation function, the same bits. Every launch of a
weight has the same k split (kernel_catalog.gemv_mmq_params), so a row gets the same bits alone and
in any bucket. At batch 1 an rmsnorm whose readers all stage their x (or are q8x GEMVs) is folded
into them (prologue norm: the rmsnorm kernel's bits; engine.plan's fusable1,
kernel_catalog.mmq_stages), and a silu_mul into the down projection's gemv_mmq1 (prologue silu: the
silu_mul kernel's bits; kernel_catalog.mmq1_folds); the buckets keep their launches. No glu epilogue
(Lowerer.q8x_decode is false for these weights); a gate half that already holds silu(gate) * up
(another GEMV's glu) is read in place. A k split over blocks adds the f32 partial sums and per-tile
counters as scratch (``mmq_part``, ``mmq_count``: the launches run one after another, each leaving
its counters zero). Never forked onto the side stream (decode_graph.fork_linears): they share that
scratch and may read the quantiser's. A batch-1 gemv_mmq1 whose grid is resident at once triggers
the next kernel early under decode_graph.early_trigger (as the coop GEMVs). A helper of the
``linear`` unit. Must not import CUDA or numpy.
"""

from __future__ import annotations

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, Arg, Launch, ScratchPlan, cdiv, val, wgt
from engine.types import ConfigError


def mmq_x(ctx, mode, ins, cols: int):
    """(the x value a gemv_mmq launch reads, its row stride, its prologue or None): a glu prologue's
    gate half in place; at batch 1 an rmsnorm folded in (("norm", its weight): the kernel normalises
    the rmsnorm's input) or a silu_mul (("silu", up's offset): x is the gate|up row)."""
    xv, pro_out = ins[0], None
    pro = ctx.prologue.get((mode, xv.name))
    if pro is not None and pro[0] == "glu" and pro[1].width == cols:
        xv = pro[1]  # the gate half of gate|up already holds silu(gate) * up
    elif pro is not None and pro[0] in ("norm", "silu") and pro[1].width == cols and mode == "decode1":
        xv, pro_out = pro[1], (pro[0], pro[2])  # (engine.plan's fusable1)
    elif pro is not None:
        raise ConfigError(f"plan: a {pro[0]} prologue feeds gemv_mmq (its x must be stored)")
    if xv.width != cols:
        raise ConfigError(f"plan: gemv_mmq reads x of width {xv.width} for a linear of k={cols}")
    return xv, (xv.ld if xv.ld != cols else 0), pro_out


def mmq_quantise(ctx, mode, ins, cols: int, launches: list[Launch]) -> list[Launch]:
    """The gemv_mmq_x launch quantising the op's x rows into the mmq_xq / mmq_xs scratch for those of
    the op's gemv_mmq ``launches`` that read it (not xstage), from the fewest rows any of them runs at
    (none where every one stages its own x: batch 1 and the 2-8 row buckets)."""
    readers = [la for la in launches if la.spec.template == "gemv_mmq" and not la.spec.params["xstage"]]
    if not readers:
        return []
    xv, stride, pro = mmq_x(ctx, mode, ins, cols)
    if pro is not None:
        raise ConfigError(f"plan: a {pro[0]} folded into gemv_mmq launches that read gemv_mmq_x's x ({xv.name})")
    p = kc.gemv_mmq_x_params(cols, stride)
    if p is None:
        raise ConfigError(f"plan: gemv_mmq_x cannot quantise x of k={cols}, row stride {xv.ld}")
    rows8 = cdiv(ctx.max_rows, 8) * 8  # (whole n tiles: gemv_mmq reads the padding rows unchecked)
    ctx.need_scratch(ScratchPlan("mmq_xq", fixed=rows8 * cols))
    ctx.need_scratch(ScratchPlan("mmq_xs", fixed=rows8 * cols // 32 * 8))
    args = (Arg("scratch", "mmq_xq"), Arg("scratch", "mmq_xs"), val(xv), ROWS)
    spec = ctx.spec("gemv_mmq_x", **p)
    grid = (cdiv(cols, 8 * p["threads"]), "n")
    return [Launch(spec, grid, (p["threads"],), args, min_rows=min(la.min_rows for la in readers))]


def mmq1_launch(
    ctx, op, out, w, xv, stride: int, pro, bmax: int = 1, lo: int = 0, hi: int = 0, trigger: bool = False
) -> Launch | None:
    """The gemv_mmq1 launch of weight allocation ``w`` for passes of up to ``bmax`` rows (``lo`` ..
    ``hi``; the bmax-8 gemv_mmq's bits: the same k split), or None where it does not apply (the bmax-8
    gemv_mmq then runs those rows)."""
    res_name = op.attrs.get("residual")
    p = kc.gemv_mmq1_params(
        w.dtype, w.rows, w.cols, sm_count=ctx.profile.sm_count, residual=res_name is not None,
        out_dtype=ctx.act_dtype(out.name), x_stride=stride, bmax=bmax,
    )  # fmt: skip
    if p is None:
        return None
    res = Arg("value", res_name) if res_name is not None else NULL
    args = (val(out), wgt(w), val(xv), res, ROWS)
    tiles = cdiv(w.rows, kc.mmq1_tile_rows(p))
    if p["kparts"] > 1:
        ctx.need_scratch(ScratchPlan("mmq_part", fixed=p["kparts"] * ctx.max_rows * w.rows * 4))
        ctx.need_scratch(ScratchPlan("mmq_count", fixed=tiles * cdiv(ctx.max_rows, bmax) * 4, fill="zero"))
        args += (Arg("scratch", "mmq_part"), Arg("scratch", "mmq_count"))
    if pro is not None and pro[0] == "norm":
        p.update(prologue="norm", eps=float(ctx.dims["rms_eps"]))
        args += (wgt(pro[1]),)
    elif pro is not None:  # silu: x the gate|up row, up pro[1] elements after the gate
        p.update(prologue="silu", u_off=int(pro[1]), x_stride=xv.ld)
    if trigger and kc.mmq1_grid_x(p) * p["kparts"] <= p["min_blocks"] * ctx.profile.sm_count:
        p["trigger"] = True  # (decode_graph.early_trigger, as the batch-1 coop GEMVs: a resident grid)
    spec = ctx.spec("gemv_mmq1", **p)
    grid = (kc.mmq1_grid_x(p), f"(n + {bmax - 1}) // {bmax}", p["kparts"])
    return Launch(spec, grid, (32 * p["warps"],), args, kc.mmq1_smem(p), min_rows=lo, max_rows=hi)


def mmq_launches(ctx, op, mode, ins, out, w) -> list[Launch]:
    """The gemv_mmq launches of weight allocation ``w`` writing ``out`` in decode mode ``mode`` (the
    bmax-8 one quantising its own x where it fits: xstage; the others after mmq_quantise)."""
    res_name = op.attrs.get("residual")
    residual = res_name is not None
    buckets = ((8, 0, 0),) if mode == "decode1" else kc.MMA_BUCKETS
    res = Arg("value", res_name) if residual else NULL
    xv, stride, pro = mmq_x(ctx, mode, ins, w.cols)
    if mode == "decode1":
        one = mmq1_launch(ctx, op, out, w, xv, stride, pro, trigger=ctx.graph_knob("early_trigger"))
        if one is not None:
            return [one]
    if pro is not None and pro[0] == "silu":
        raise ConfigError(f"plan: a silu_mul folded into gemv_mmq {w.key}, which has no batch-1 gemv_mmq1")
    nw = pro[1] if pro is not None else None
    launches = []
    if mode != "decode1":  # 1, 2 and 3-4 rows: gemv_mmq1 where it applies (no dead mma columns)
        small = [mmq1_launch(ctx, op, out, w, xv, stride, None, b, lo, hi) for b, lo, hi in kc.MMQ1_BUCKETS]
        if all(la is not None for la in small):
            launches += small
            buckets = ((8, kc.MMQ1_BUCKETS[-1][2] + 1, 8), *kc.MMA_BUCKETS[1:])
    for bmax, lo, hi in buckets:
        p = kc.gemv_mmq_params(
            w.dtype, w.rows, w.cols, bmax, sm_count=ctx.profile.sm_count, residual=residual,
            out_dtype=ctx.act_dtype(out.name), x_stride=stride,
        )  # fmt: skip
        if p is None:
            raise ConfigError(f"plan: gemv_mmq cannot read {w.key} ({w.dtype} [{w.rows}, {w.cols}])")
        if nw is not None:
            if not p["xstage"]:
                raise ConfigError(f"plan: an rmsnorm folded into gemv_mmq {w.key}, whose batch-1 kernel reads gemv_mmq_x's x")
            p.update(prologue="norm", eps=float(ctx.dims["rms_eps"]))
        tiles = cdiv(w.rows, 16 * p["mt"] * p["wm"])
        xin = (val(xv),) if p["xstage"] else (Arg("scratch", "mmq_xq"), Arg("scratch", "mmq_xs"))
        args = (val(out), wgt(w), *xin, res, ROWS)
        if p["kparts"] > 1:
            ctx.need_scratch(ScratchPlan("mmq_part", fixed=p["kparts"] * ctx.max_rows * w.rows * 4))
            ctx.need_scratch(ScratchPlan("mmq_count", fixed=tiles * cdiv(ctx.max_rows, bmax) * 4, fill="zero"))
            args += (Arg("scratch", "mmq_part"), Arg("scratch", "mmq_count"))
        if nw is not None:
            args += (wgt(nw),)
        grid = (tiles, f"(n + {bmax - 1}) // {bmax}", p["kparts"])
        spec = ctx.spec("gemv_mmq", **p)
        block = (32 * p["wm"] * p["wk"],)
        launches.append(Launch(spec, grid, block, args, kc.mmq_smem(p), min_rows=lo, max_rows=hi))
    return launches
