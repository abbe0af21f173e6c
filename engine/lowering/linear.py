"""Lowering unit ``linear``: ``out = x @ W.T (+ residual)`` for each weight allocation of the op.

decode / decode1: GEMVs (engine.lowering.gemv); prefill: the tensor-core GEMM (kernels/gemm.cu.j2,
GGUF rows decoded in the tile loads), or on sm_90a profiles with gemm_wgmma the TMA + wgmma GEMM
(bf16 weights; quantised ones dequantised to a bf16 scratch first for long chunks); wide decode
buckets: the gemm kernel with the gemm_decode tuning. Logits (f32, no residual) always take the
GEMV. The op's outputs are column views of one buffer per fused allocation. Must not import CUDA
or numpy.
"""

from __future__ import annotations

import dataclasses

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, WIDE, Arg, Launch, ScratchPlan, cdiv, val, wgt
from engine.lowering.gemv import linear_gemv
from engine.lowering.registry import register
from engine.types import ConfigError


def bind(op, ws, ins, dims, value_for):
    outs, col = [], 0
    for w in ws:  # a fused allocation's outputs are column views of one buffer
        names = op.outputs[col : col + len(w.parts)]
        col += len(w.parts)
        if len(names) == 1:
            outs.append(value_for(names[0], w.rows))
            continue
        buf, off = "+".join(names), 0
        for name, rows in zip(names, w.part_rows, strict=True):
            outs.append(value_for(name, rows, buffer=buf, offset=off, ld=w.rows))
            off += rows
    if col != len(op.outputs):
        raise ConfigError(f"plan: the weights of linear {op.outputs} cover {col} of its {len(op.outputs)} outputs")
    return outs


@register("linear", bind=bind, attrs=("residual",))
def lower(ctx, op, layer, mode, ins, outs, ws):
    if mode == WIDE:
        return linear_gemm(ctx, op, mode, ins, outs, ws, section="gemm_decode")
    if mode == "prefill":
        return linear_gemm(ctx, op, mode, ins, outs, ws)
    return linear_gemv(ctx, op, mode, ins, outs, ws, layer)


def linear_gemm(ctx, op, mode, ins, outs, ws, section="gemm"):
    # section: the profile tuning ("gemm" for prefill, "gemm_decode" for wide decode buckets)
    res_name = op.attrs.get("residual")
    residual = res_name is not None
    launches = []
    col = 0
    for w in ws:
        out = outs[col]
        col += len(w.parts)
        out_dtype = ctx.act_dtype(out.name)
        # f32 outputs without a residual are the logits: the GEMV handles them (one row in prefill)
        if out_dtype != "bf16" and not residual:
            return linear_gemv(ctx, op, mode, ins, outs, ws)
        quant = w.dtype
        if section == "gemm" and quant == "bf16":
            wg = gemm_wgmma(ctx, w, ins[0], out, residual, out_dtype, res_name)
            if wg is not None:
                launches.append(wg)
                continue
        p = gemm_params(ctx, w, section, residual, out_dtype, quant)  # bf16, or GGUF decoded in the GEMM
        wptr = wgt(w)
        long_rows = dequant_wgmma_rows(ctx, w, section, quant)
        wg = None
        if long_rows:  # long chunks: the whole matrix dequantised to bf16, then the wgmma GEMM
            wg = gemm_wgmma(ctx, w, ins[0], out, residual, out_dtype, res_name, source="dequant")
        if wg is not None:
            if p is None or long_rows <= 1:  # (no fused decoder) the dequantised path at every length
                launches += [dequantise(ctx, w), wg]
                continue
            launches += [dataclasses.replace(la, min_rows=long_rows) for la in (dequantise(ctx, w), wg)]
        if p is None and section != "gemm":  # decode never dequantises a whole matrix per step
            return linear_gemv(ctx, op, mode, ins, outs, ws)
        if p is None and quant != "bf16":  # fallback: dequantise into a bf16 scratch (embed, ids 0..n-1)
            launches.append(dequantise(ctx, w))
            wptr = Arg("scratch", "dequant")
            quant = "bf16"
            p = gemm_params(ctx, w, section, residual, out_dtype, quant)
        if p is None:  # odd k: the GEMV handles it
            return linear_gemv(ctx, op, mode, ins, outs, ws)
        spec = ctx.spec("gemm", **p)
        max_rows = long_rows - 1 if wg is not None else 0  # the dequantised path above takes the rest
        smem = kc.gemm_smem(p)
        res = Arg("value", res_name) if residual else NULL
        args = (val(out), val(ins[0]), wptr, res, ROWS)
        grid = (cdiv(w.rows, p["tile_n"]), f"(n + {p['tile_m'] - 1}) // {p['tile_m']}")
        launches.append(Launch(spec, grid, (32 * p["warps"],), args, smem, max_rows=max_rows))
    return launches


def dequant_wgmma_rows(ctx, w, section, quant) -> int:
    """The fewest prefill rows from which quantised weight ``w`` is dequantised to bf16 and
    multiplied by the wgmma GEMM (profile gemm_wgmma.dequant_min_rows; 0: never)."""
    if section != "gemm" or quant == "bf16":
        return 0
    return int(ctx.tune("gemm_wgmma").get("dequant_min_rows") or 0)


def dequantise(ctx, w) -> Launch:
    """The whole of quantised weight ``w`` dequantised into the bf16 "dequant" scratch (the embed
    kernel gathering rows 0..rows-1)."""
    t = kc.ELEMENTWISE_THREADS
    deq = ctx.spec("embed", quant=w.dtype, hidden=w.cols, threads=t)
    ctx.need_scratch(ScratchPlan("dequant", fixed=w.rows * w.cols * 2))
    ctx.need_scratch(ScratchPlan("iota", fixed=w.rows * 4, fill="iota"))
    dargs = (Arg("scratch", "dequant"), wgt(w), Arg("scratch", "iota"), Arg("const", w.rows, "i32"))
    return Launch(deq, (w.rows,), (t,), dargs)


def gemm_wgmma(ctx, w, x, out, residual, out_dtype, res_name, source="weight"):
    """The Hopper TMA + wgmma GEMM launch for bf16 weight ``w`` (profile tuning gemm_wgmma), or
    None where it does not apply. A and W reach the kernel as device tensor maps (Arg kind
    "tmap": source, name, box rows), built by the runner at bind time."""
    if x.width != w.cols:
        return None
    p = kc.gemm_wgmma_params(w.rows, w.cols, ctx.profile.tuning, residual=residual, out_dtype=out_dtype)
    if p is None:
        return None
    spec = ctx.spec("gemm_wgmma", **p)
    tile_m = kc.gemm_wgmma_tile_m(p)
    args = (
        val(out),
        Arg("tmap", ("value", x.name, tile_m)),
        Arg("tmap", ("weight", w.key, p["tile_n"]))
        if source == "weight"
        else Arg("tmap", ("scratch", source, p["tile_n"], w.rows, w.cols)),
        Arg("value", res_name) if residual else NULL,
        ROWS,
    )
    grid = (cdiv(w.rows, p["tile_n"]), f"(n + {tile_m - 1}) // {tile_m}")
    return Launch(spec, grid, (128 * (p["consumers"] + 1),), args, kc.gemm_wgmma_smem(p))


def gemm_params(ctx, w, section, residual, out_dtype, quant):
    """The gemm params for weight ``w`` from tuning ``section``, or None when no gemm variant fits
    (a storage type without a fused decoder, a k no tile divides: the caller falls back)."""
    if quant not in kc.QUANTS:
        return None
    try:
        p = kc.gemm_params(
            w.rows, w.cols, ctx.profile.tuning, residual=residual, out_dtype=out_dtype, quant=quant, section=section
        )
        kc.spec("gemm", **p)
    except ConfigError:
        return None
    return p
