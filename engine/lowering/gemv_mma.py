"""The tensor-core lowering of decode linear layers (kernels/gemv_mma.cu.j2; tuning gemv_mma.types).

A weight whose file type the profile names, uploaded in a layout gemv_mma decodes, takes gemv_mma in
every decode pass: the batch-1 pass (decode1) runs the bmax-8 kernel on its one row, a bucket pass
the launch of its MMA_BUCKETS range (min_rows / max_rows). Every launch of a weight has the same k
split (kernel_catalog.gemv_mma_params), so a row gets the same bits alone and in any bucket. A
gate|up weight whose silu_mul the plan folds (gemv.fuse_glu) stores silu(gate) * up (glu). At batch
1 an rmsnorm whose readers all take gemv_mma or a q8x GEMV is folded into them (prologue norm: the
rmsnorm kernel's bits; gemv_coop.q8x_fuse); the buckets keep its launch. A k split over blocks adds
the f32 partial sums and per-tile counters as scratch (``mma_part``, ``mma_count``; a launch forked
beside the op's first, as a q4_k_m layer's v beside its q|k at batch 1 with decode_graph.fork_linears,
has its own, ``mma_part.1`` ...). A helper of the ``linear`` unit.
Must not import CUDA or numpy.
"""

from __future__ import annotations

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, Arg, Launch, ScratchPlan, cdiv, val, wgt
from engine.types import ConfigError

MMA_MODES = ("decode1", "decode")  # the modes gemv_mma serves (prefill keeps the GEMM)


def mma_launches(ctx, op, layer, mode, ins, out, w, glu: int, tag: str = "") -> list[Launch]:
    """The gemv_mma launches of weight allocation ``w`` writing ``out`` in decode mode ``mode``
    (``glu``: the gate|up epilogue's width, 0 for none; the caller checks the silu_mul's fold;
    ``tag``: a suffix of its scratch names, so that a launch forked beside another has its own)."""
    res_name = op.attrs.get("residual")
    residual = res_name is not None
    out_dtype = ctx.act_dtype(out.name)
    xv, extra, pp = ins[0], (), {}
    pro = ctx.prologue.get((mode, xv.name))
    if pro is not None and pro[0] == "glu" and pro[1].width == w.cols:
        xv = pro[1]  # the gate half of gate|up already holds silu(gate) * up
    elif pro is not None and pro[0] == "norm" and pro[1].width == w.cols:
        xv = pro[1]  # the rmsnorm's input: the kernel normalises it (batch 1: engine.plan's fusable1)
        pp = dict(prologue="norm", eps=float(ctx.dims["rms_eps"]))
        extra = (wgt(pro[2]),)
    elif pro is not None:
        raise ConfigError(f"plan: a {pro[0]} prologue feeds gemv_mma {w.key} (its x must be stored)")
    if xv.width != w.cols:
        raise ConfigError(f"plan: linear {w.key} of k={w.cols} reads x of width {xv.width}")
    buckets = ((8, 0, 0),) if mode == "decode1" else kc.MMA_BUCKETS
    res = Arg("value", res_name) if residual else NULL
    launches = []
    for bmax, lo, hi in buckets:
        p = kc.gemv_mma_params(
            w.dtype, w.rows, w.cols, bmax, sm_count=ctx.profile.sm_count, residual=residual,
            out_dtype=out_dtype, x_stride=xv.ld if xv.ld != w.cols else 0, glu=glu, **pp,
        )  # fmt: skip
        if p is None:
            raise ConfigError(f"plan: gemv_mma cannot read {w.key} ({w.dtype} [{w.rows}, {w.cols}], x ld {xv.ld})")
        tiles = cdiv(w.rows, 16 * p["mt"] * p["wm"])
        resident = kc.mma_resident(bmax, p["mt"], p["wm"], p["wk"], kc.mma_smem(p))
        if mode == "decode1" and ctx.graph_knob("early_trigger") and tiles * p["kparts"] <= resident * ctx.profile.sm_count:
            p["trigger"] = True  # (decode_graph.early_trigger, as the batch-1 coop GEMVs: a resident grid)
        spec = ctx.spec("gemv_mma", **p)
        args = (val(out), wgt(w), val(xv), res, ROWS)
        if p["kparts"] > 1:
            ctx.need_scratch(ScratchPlan("mma_part" + tag, fixed=p["kparts"] * ctx.max_rows * w.rows * 4))
            ctx.need_scratch(ScratchPlan("mma_count" + tag, fixed=tiles * cdiv(ctx.max_rows, bmax) * 4, fill="zero"))
            args += (Arg("scratch", "mma_part" + tag), Arg("scratch", "mma_count" + tag))
        args += extra
        grid = (tiles, f"(n + {bmax - 1}) // {bmax}", p["kparts"])
        smem = kc.mma_smem(spec.params)  # (xsm: the x stages)
        launches.append(Launch(spec, grid, (32 * p["wm"] * p["wk"],), args, smem=smem, min_rows=lo, max_rows=hi))
    if glu:
        ctx.glu_done.add((mode, out.name))
    return launches
