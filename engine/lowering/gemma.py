"""Lowering units ``gelu_tanh_mul`` (``out = gelu_tanh(g) * u``: kernels/silu_mul.cu.j2 with act
gelu_tanh) and ``add`` (``out = a + b``, Gemma's residual sum after its post-norms:
kernels/add.cu.j2). Neither folds into a GEMV: each is one small elementwise launch in every mode.
Must not import CUDA or numpy."""

from __future__ import annotations

from engine.ir import ROWS, Launch, cdiv, val
from engine.lowering.registry import register, same_width
from engine.types import ConfigError


@register("gelu_tanh_mul", bind=same_width, wide="prefill")
def lower_gelu_tanh_mul(ctx, op, layer, mode, ins, outs, ws):
    g, u = ins
    if g.ld != u.ld or u.width != g.width:
        raise ConfigError("plan: gelu_tanh_mul needs its gate and up values of one width and row stride")
    t = ctx.tune("elementwise")["threads"]
    spec = ctx.spec("silu_mul", inter=g.width, in_stride=g.ld, threads=t, act="gelu_tanh")
    return [Launch(spec, (cdiv(g.width, 8 * t), "n"), (t,), (val(outs[0]), val(g), val(u), ROWS))]


@register("add", bind=same_width, wide="prefill")
def lower_add(ctx, op, layer, mode, ins, outs, ws):
    a, b = ins
    out = outs[0]
    if b.width != a.width or out.ld != a.ld:
        raise ConfigError("plan: add needs inputs of one width and writes its output with the first one's row stride")
    t = ctx.tune("elementwise")["threads"]
    spec = ctx.spec("add", n=a.width, a_stride=a.ld, b_stride=b.ld, threads=t)
    return [Launch(spec, (cdiv(a.width, 8 * t), "n"), (t,), (val(out), val(a), val(b), ROWS))]
