"""Lowering unit ``embed``: one row of the (possibly quantised) table per token, dequantised to
bf16 (kernels/embed.cu.j2; f32 where the output value is f32: a family's ``numerics.f32_values``),
times the op's ``scale`` (Gemma's sqrt(hidden)) where set. Must not import CUDA or numpy."""

from __future__ import annotations

from engine.ir import ROWS, Arg, Launch, val, wgt
from engine.kernel_catalog import ELEMENTWISE_THREADS
from engine.lowering.registry import register


def bind(op, ws, ins, dims, value_for):
    return [value_for(op.outputs[0], dims["hidden"])]


@register("embed", bind=bind, attrs=("scale",))
def lower(ctx, op, layer, mode, ins, outs, ws):
    w = ws[0]
    t = ELEMENTWISE_THREADS
    scale = float(ctx.attr_dim(op, "scale", 1.0))
    spec = ctx.spec("embed", quant=w.dtype, hidden=w.cols, threads=t, scale=scale, out_dtype=outs[0].dtype)
    return [Launch(spec, ("n",), (t,), (val(outs[0]), wgt(w), Arg("input", "tokens"), ROWS))]
