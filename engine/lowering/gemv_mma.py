"""The batched decode lowering of linear layers (kernels/gemv_mma.cu.j2): decode passes of 2+ rows.

Each weight allocation gets one gemv_mma launch per row range of kernel_catalog.MMA_BUCKETS (bmax
8 / 16 / 32 / 64, Launch.min_rows / max_rows), so every CUDA-graph bucket reads and dequantises
each weight once per bmax rows, on the tensor cores; a decode gate|up stores silu(gate) * up (glu)
where the GEMV would. Applies to bf16 and every quantised upload
type with a decoder, both the ``decode`` mode and the wide buckets (``decode_wide``, where the
profile has them); ``None`` (the caller keeps its GEMV / GEMM) where an allocation does not fit
(k not a multiple of 64, x rows not 16-byte aligned, a fused rmsnorm / silu prologue). A helper of
the ``linear`` unit. Must not import CUDA or numpy.
"""

from __future__ import annotations

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, WIDE, Arg, Launch, ScratchPlan, cdiv, val, wgt
from engine.lowering.gemv import glu_for


def linear_mma(ctx, op, layer, mode, ins, outs, ws) -> list[Launch] | None:
    """The gemv_mma launches of a decode linear op (every allocation), or None where one does not
    fit. In WIDE mode only the ranges from GEMM_DECODE_MIN_ROWS up are emitted (the others never
    run there). In the decode mode a gate|up whose silu_mul can be folded (gemv.fuse_glu, as the
    GEMV's glu_for) stores silu(gate) * up in its gate half; the silu_mul then has no launch and
    the down projection reads x there (WIDE materialises silu_mul as prefill does: no glu)."""
    res_name = op.attrs.get("residual")
    residual = res_name is not None
    x = ins[0]
    pro = ctx.prologue.get((mode, x.name))
    if pro is not None:
        if pro[0] != "glu":  # a fused rmsnorm / silu_mul: the GEMV computes it while loading x
            return None
        x = pro[1]  # the gate half of gate|up already holds silu(gate) * up (x_stride: its row)
    if x.offset % 8 or x.ld % 8:
        return None
    lo = kc.GEMM_DECODE_MIN_ROWS if mode == WIDE else 0
    buckets = [b for b in kc.MMA_BUCKETS if not b[2] or b[2] >= lo]
    launches, col, glu_outs = [], 0, []
    for w in ws:
        out = outs[col]
        col += len(w.parts)
        out_dtype = ctx.act_dtype(out.name)
        if w.cols != x.width or (residual and out_dtype != "bf16") or out_dtype not in ("bf16", "f32"):
            return None
        glu = glu_for(ctx, op, layer, mode, w, residual, out_dtype, 2) if mode == "decode" else 0
        for bmax, first, last in buckets:
            p = kc.gemv_mma_params(
                w.dtype,
                w.rows,
                w.cols,
                bmax,
                sm_count=ctx.profile.sm_count,
                residual=residual,
                out_dtype=out_dtype,
                x_stride=0 if x.ld == w.cols else x.ld,
                glu=glu,
            )
            if p is None:
                return None
            launches.append(mma_launch(ctx, p, w, x, out, res_name, max(first, lo), last))
        if glu:
            glu_outs.append(out.name)
    ctx.glu_done.update((mode, name) for name in glu_outs)
    return launches


def mma_launch(ctx, p: dict, w, x, out, res_name, min_rows: int, max_rows: int) -> Launch:
    """One gemv_mma launch of params ``p`` for passes of ``min_rows``..``max_rows`` rows; its k
    split's partial sums and per-tile counters are runner scratch (counters zeroed once: the last
    block of a tile zeroes its own again)."""
    spec = ctx.spec("gemv_mma", **p)
    res = Arg("value", res_name) if res_name is not None else NULL
    args = (val(out), wgt(w), val(x), res, ROWS)
    tiles = cdiv(w.rows, 16 * p["mt"] * p["wm"])  # (glu: the same count of gate|up column tiles)
    if p["kparts"] > 1:
        ctx.need_scratch(ScratchPlan("mma_part", fixed=p["kparts"] * ctx.max_rows * w.rows * 4))
        groups = cdiv(ctx.max_rows, p["bmax"])
        ctx.need_scratch(ScratchPlan("mma_count", fixed=tiles * groups * 4, fill="zero"))
        args += (Arg("scratch", "mma_part"), Arg("scratch", "mma_count"))
    grid = (tiles, f"(n + {p['bmax'] - 1}) // {p['bmax']}", p["kparts"])
    return Launch(spec, grid, (32 * p["warps"],), args, min_rows=min_rows, max_rows=max_rows)
