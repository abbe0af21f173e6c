"""Lowering unit ``silu_mul``: ``out = silu(g) * u`` (kernels/silu_mul.cu.j2), or no launch in a
decode mode where the gate|up GEMV already stored it (glu) or the down GEMV computes it while
loading x (the Lowerer's ``prologue``). Must not import CUDA or numpy."""

from __future__ import annotations

from engine.ir import ROWS, Launch, cdiv, val
from engine.kernel_catalog import ELEMENTWISE_THREADS
from engine.lowering.context import PROLOGUE_MODES
from engine.lowering.registry import register, same_width


@register("silu_mul", bind=same_width, wide="prefill")
def lower(ctx, op, layer, mode, ins, outs, ws):
    g, u = ins
    t = ELEMENTWISE_THREADS
    inter = g.width
    ctx.prologue.pop((mode, outs[0].name), None)
    off = u.offset - g.offset
    if mode in PROLOGUE_MODES and (mode, g.name) in ctx.glu_done:
        ctx.glu_done.discard((mode, g.name))
        # the gate|up GEMV stored silu(gate) * up in the gate half: the down GEMV reads it there
        ctx.prologue[(mode, outs[0].name)] = ("glu", g, 0)
        return []
    if (
        mode in PROLOGUE_MODES
        and ctx.fused(op, layer, mode)
        and g.buffer == u.buffer
        and g.ld == u.ld
        and u.width == inter
        and off >= inter
        and off + inter <= g.ld
        and off % 8 == 0
        and g.offset % 8 == 0
        and g.ld % 8 == 0
    ):  # fused into the down projection's GEMV (x = silu(gate) * up while loading)
        ctx.prologue[(mode, outs[0].name)] = ("silu", g, off)
        return []
    spec = ctx.spec("silu_mul", inter=inter, in_stride=g.ld, threads=t)
    return [Launch(spec, (cdiv(inter, 8 * t), "n"), (t,), (val(outs[0]), val(g), val(u), ROWS))]
