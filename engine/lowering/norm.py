"""Lowering units ``rmsnorm`` and ``head_rmsnorm``.

rmsnorm: kernels/rmsnorm.cu.j2, or no launch in a decode mode where the GEMVs that read its output
normalise x while loading it (the Lowerer's ``prologue``). head_rmsnorm (Qwen3's per-head q / k
norm) never launches: the rope that follows applies it (its ``qk_norm``). A norm's ``offset``
(Gemma's (1 + w)) is in its weight: engine.plan sets WeightPlan.offset and the upload adds it. An
f32 x (a family's ``numerics.f32_values``: an f32 residual stream) is read as it is (``x_dtype``) and
never folded into a GEMV (whose x loader reads bf16). Must not import CUDA or numpy."""

from __future__ import annotations

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, Launch, val, wgt
from engine.lowering.context import PROLOGUE_MODES
from engine.lowering.registry import register, same_width
from engine.types import ConfigError


@register("rmsnorm", bind=same_width, wide="prefill", attrs=("offset",))
def lower_rmsnorm(ctx, op, layer, mode, ins, outs, ws):
    w = ws[0]
    t = kc.NORM_THREADS
    eps = float(ctx.dims["rms_eps"])
    ctx.prologue.pop((mode, outs[0].name), None)
    x = ins[0]
    if (
        mode in PROLOGUE_MODES
        and ctx.fused(op, layer, mode)
        and w.dtype == "f32"
        and x.dtype == "bf16"
        and x.width == w.cols
        and x.ld % 8 == 0
        and x.offset % 8 == 0
    ):  # fused into the GEMVs that read the output (they normalise x while loading it)
        ctx.prologue[(mode, outs[0].name)] = ("norm", x, w)
        return []
    if outs[0].dtype != "bf16" or x.dtype not in ("bf16", "f32"):
        raise ConfigError(f"plan: rmsnorm reads a bf16 or f32 x and writes bf16 (got {x.dtype} -> {outs[0].dtype})")
    spec = ctx.spec("rmsnorm", n=w.cols, eps=repr(eps), threads=t, residual=False, x_dtype=x.dtype)
    return [Launch(spec, ("n",), (t,), (val(outs[0]), val(ins[0]), NULL, wgt(w), ROWS))]


@register("head_rmsnorm", bind=same_width, short=True, attrs=("offset",))
def lower_head_rmsnorm(ctx, op, layer, mode, ins, outs, ws):
    # fused into the rope kernel that follows (qk_norm); remember which value it normalises
    if outs[0].name != ins[0].name:
        raise ConfigError("plan: head_rmsnorm must write its input in place (out == in) to fuse into rope")
    ctx.pending_norm[(layer, mode, ins[0].name)] = ws[0]
    return []
