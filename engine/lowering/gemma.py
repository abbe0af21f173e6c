"""Lowering units ``gelu_tanh_mul`` (``out = gelu_tanh(g) * u``: kernels/silu_mul.cu.j2 with act
gelu_tanh) and ``add`` (``out = a + b``, Gemma's residual sum after its post-norms:
kernels/add.cu.j2; ``a`` and the output f32 where the family keeps its residual stream in f32,
``numerics.f32_values``). Neither folds into a GEMV: each is one small elementwise launch, except
that the post-pass ``fold_add_into_rmsnorm`` moves an in-place ``x = x + o`` into the rmsnorm of x
right after it (the rmsnorm kernel's residual mode: the same roundings, one launch fewer). Must not
import CUDA or numpy."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from engine.ir import ROWS, Launch, Step, Value, WeightPlan, cdiv, val
from engine.kernel_catalog import ELEMENTWISE_THREADS
from engine.lowering.registry import post_pass, register, same_width
from engine.types import ConfigError


@register("gelu_tanh_mul", bind=same_width, wide="prefill")
def lower_gelu_tanh_mul(ctx, op, layer, mode, ins, outs, ws):
    g, u = ins
    if g.ld != u.ld or u.width != g.width:
        raise ConfigError("plan: gelu_tanh_mul needs its gate and up values of one width and row stride")
    t = ELEMENTWISE_THREADS
    spec = ctx.spec("silu_mul", inter=g.width, in_stride=g.ld, threads=t, act="gelu_tanh")
    return [Launch(spec, (cdiv(g.width, 8 * t), "n"), (t,), (val(outs[0]), val(g), val(u), ROWS))]


@register("add", bind=same_width, wide="prefill")
def lower_add(ctx, op, layer, mode, ins, outs, ws):
    a, b = ins
    out = outs[0]
    if b.width != a.width or out.ld != a.ld:
        raise ConfigError("plan: add needs inputs of one width and writes its output with the first one's row stride")
    if out.dtype != a.dtype or b.dtype != "bf16":
        raise ConfigError(
            f"plan: add writes its first input's dtype and reads a bf16 second one (got {a.dtype} + {b.dtype} -> {out.dtype})"
        )
    t = ELEMENTWISE_THREADS
    spec = ctx.spec("add", n=a.width, a_stride=a.ld, b_stride=b.ld, threads=t, a_dtype=a.dtype)
    return [Launch(spec, (cdiv(a.width, 8 * t), "n"), (t,), (val(out), val(a), val(b), ROWS))]


@post_pass(5)
def fold_add_into_rmsnorm(ctx, steps: list[Step], weights: Mapping[str, WeightPlan], values: Mapping[str, Value]) -> None:
    """An ``add`` writing x = x + o in place, directly followed (same head/layer part) by an rmsnorm
    of x: in every mode where each is one plain launch with rows of ``n`` elements, the rmsnorm runs
    with its residual (x += o, stored in x's dtype, then the norm of that stored sum: exactly the two
    launches' results) and the add has no launch."""
    for a, nrm in zip(steps, steps[1:], strict=False):
        if a.op.op != "add" or nrm.op.op != "rmsnorm" or nrm.head != a.head:
            continue
        x = a.op.outputs[0]
        if a.op.inputs[0] != x or nrm.op.inputs[0] != x:
            continue
        for mode, las in list(a.launches.items()):
            nl = nrm.launches.get(mode, ())
            if len(las) != 1 or len(nl) != 1:
                continue
            la, ln = las[0], nl[0]
            p = la.spec.params
            if la.spec.template != "add" or ln.spec.template != "rmsnorm" or ln.spec.params["residual"]:
                continue
            if p["a_dtype"] != ln.spec.params["x_dtype"]:
                continue
            if not p["n"] == p["a_stride"] == p["b_stride"] == ln.spec.params["n"]:
                continue  # (the rmsnorm kernel's rows are n elements apart)
            out, xin, _, w, rows = ln.args
            spec = ctx.spec("rmsnorm", **{**ln.spec.params, "residual": True})
            nrm.launches[mode] = (dataclasses.replace(ln, spec=spec, args=(out, xin, la.args[2], w, rows)),)
            a.launches[mode] = ()
