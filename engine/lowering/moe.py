"""Lowering units ``moe_router`` and ``moe_experts``: a Qwen3-MoE sparse MLP on the device.

moe_router: the router GEMV (the dense gemv kernel, f32 logits [rows, E] into a value of their own,
from a bf16 or f32 router matrix) then moe_topk, which writes the expert ids (i32) and weights (f32)
into fixed-size [rows, top_k] values: no host synchronisation, so decode stays in the CUDA graph.
moe_experts over the stacked [E, N, K] expert weights (uploaded as the file's blocks): at batch 1
(decode1) the per-slot moe_gemv ``glu`` then ``down`` (+ residual), which read only the chosen
experts' rows; in batched decode, wide decode buckets and prefill the grouped modes (one block per
(row tile, expert) reads the expert once for all its tokens) and moe_combine (the router-weighted
slot sum + residual). Kernel specs and argument lists come from engine.moe_kernels. The shared
expert (seven weights) has no CUDA lowering yet: a ConfigError says so. Must not import CUDA or
numpy.
"""

from __future__ import annotations

from engine import moe_kernels as mk
from engine.ir import NULL, ROWS, Arg, Launch, ScratchPlan, cdiv, val, wgt
from engine.lowering.gemv import gemv_launch
from engine.lowering.registry import register
from engine.types import ConfigError

RPB = 4  # warps (output rows) per block of the expert GEMVs
TOPK_WARPS = 4  # tokens per block of moe_topk
SLOT_BATCH = 8  # (token, slot) pairs per pass over an expert row (grouped modes)


def _dim(ctx, op, attr: str, default=None):
    name = op.attrs.get(attr)
    if name is None:
        if default is None:
            raise ConfigError(f"plan: op {op.op} needs the attribute {attr!r}")
        return default
    if name not in ctx.dims:
        raise ConfigError(f"plan: op {op.op} attribute {attr}={name!r} is not a dim")
    return ctx.dims[name]


def bind_router(op, ws, ins, dims, value_for):
    top_k = int(dims[op.attrs["top_k"]])
    experts = ws[0].rows
    return [
        value_for(op.outputs[0], top_k, dtype="i32"),
        value_for(op.outputs[1], top_k, dtype="f32"),
        value_for(f"{op.outputs[0]}.logits", experts, dtype="f32"),
    ]


@register("moe_router", bind=bind_router, wide="decode")
def lower_router(ctx, op, layer, mode, ins, outs, ws):
    ids, weights, logits = outs
    w = ws[0]
    if ins[0].width != w.cols:
        raise ConfigError(f"plan: moe_router reads {ins[0].name} of width {ins[0].width}, the router has {w.cols} columns")
    top_k = int(_dim(ctx, op, "top_k"))
    normalize = bool(_dim(ctx, op, "normalize", False))
    gemv = gemv_launch(ctx, op, layer, mode, ins, logits, w)
    k = mk.topk_kernel(w.rows, top_k, normalize, TOPK_WARPS)
    grid = (f"(n + {TOPK_WARPS - 1}) // {TOPK_WARPS}",)
    topk = Launch(k.spec, grid, k.block[:1], (val(ids), val(weights), val(logits), ROWS))
    return [gemv, topk]


def bind_experts(op, ws, ins, dims, value_for):
    return [value_for(op.outputs[0], ins[0].width)]


@register("moe_experts", bind=bind_experts, wide="decode")
def lower_experts(ctx, op, layer, mode, ins, outs, ws):
    if len(ws) != 3:
        raise ConfigError(
            f"plan: moe_experts with {len(ws)} weights (a shared expert) has no CUDA lowering yet; "
            "the reference backend runs it"
        )
    h, ids, weights = ins
    out = outs[0]
    wg, wu, wd = ws
    top_k, hidden, inter = ids.width, h.width, wd.cols
    experts = wg.rows // inter
    for w, n, k in ((wg, inter, hidden), (wu, inter, hidden), (wd, hidden, inter)):
        if w.rows != experts * n or w.cols != k:
            raise ConfigError(
                f"plan: expert weight {w.key} is [{w.rows}, {w.cols}], expected [{experts} x {n}, {k}]"
            )
    if wg.dtype != wu.dtype:
        raise ConfigError(f"plan: expert gate ({wg.dtype}) and up ({wu.dtype}) weights differ in storage type")
    res_name = op.attrs.get("residual")
    res = Arg("value", res_name) if res_name else NULL
    ctx.need_scratch(ScratchPlan("moe_act", fixed=ctx.max_tokens * top_k * inter * 2))
    act = Arg("scratch", "moe_act")
    if mode == "decode1":  # per (token, slot): only the chosen experts' rows are read
        glu = mk.expert_gemv_kernel("glu", wg.dtype, inter, hidden, top_k, RPB)
        down = mk.expert_gemv_kernel("down", wd.dtype, hidden, inter, top_k, RPB, residual=bool(res_name))
        return [
            Launch(glu.spec, (cdiv(inter, RPB), f"n * {top_k}"), glu.block[:1], (act, wgt(wg), wgt(wu), val(h), val(ids), ROWS)),
            Launch(
                down.spec,
                (cdiv(hidden, RPB), "n"),
                down.block[:1],
                (val(out), wgt(wd), act, val(ids), val(weights), res, ROWS),
            ),
        ]
    # grouped by expert: an expert's (token, slot) pairs number at most the step's rows
    slots = max(top_k, ctx.max_tokens)
    if slots > mk.MAX_SLOTS:
        raise ConfigError(f"plan: moe_experts over {slots} rows per step; the grouped kernels take {mk.MAX_SLOTS}")
    glu = mk.expert_gemv_kernel("glu_grouped", wg.dtype, inter, hidden, top_k, RPB, experts=experts, max_slots=slots, slot_batch=SLOT_BATCH)
    down = mk.expert_gemv_kernel("down_grouped", wd.dtype, hidden, inter, top_k, RPB, experts=experts, max_slots=slots, slot_batch=SLOT_BATCH)
    comb = mk.combine_kernel(hidden, top_k, residual=bool(res_name))
    ctx.need_scratch(ScratchPlan("moe_partial", fixed=ctx.max_tokens * top_k * hidden * 4))
    partial = Arg("scratch", "moe_partial")
    return [
        Launch(glu.spec, (cdiv(inter, RPB), experts), glu.block[:1], (act, wgt(wg), wgt(wu), val(h), val(ids), ROWS)),
        Launch(down.spec, (cdiv(hidden, RPB), experts), down.block[:1], (partial, wgt(wd), act, val(ids), ROWS)),
        Launch(comb.spec, (cdiv(hidden, comb.block[0]), "n"), comb.block[:1], (val(out), partial, val(weights), res, ROWS)),
    ]
