"""Lowering unit ``rope``: in-place RoPE of q and k, the head norms before it (a pending
head_rmsnorm), and the k / v write to the paged cache (kernels/rope.cu.j2). In a short-context
decode pass it has no launch where the direct attention kernel that follows does its work
(tuning attention_decode.fuse_rope): it leaves the attention the params and args for that in the
Lowerer's ``rope_fused``. ``theta`` / ``scaling`` attributes give a layer type its own RoPE base
and scaling (Gemma 3: 10k on local layers, 1M on global ones). Must not import CUDA or numpy."""

from __future__ import annotations

from engine import kernel_catalog as kc
from engine.ir import NULL, ROWS, VSHORT, Arg, Launch, Value, val, wgt
from engine.lowering.registry import register
from engine.types import ConfigError


def bind(op, ws, ins, dims, value_for):
    return list(ins)


def vec16(ctx, q: Value) -> bool:
    """16-byte K/V loads in decode attention (profile attention_decode.vec16) for this q."""
    hd = ctx.dims["head_dim"]
    return bool(ctx.tune("attention_decode").get("vec16")) and hd in (32, 64, 128, 256) and q.ld % 8 == 0


def rope_fuses(ctx, q: Value, k: Value) -> bool:
    """Whether short-context decode rope folds into the direct attention kernel (tuning
    attention_decode.fuse_rope, on the vec16 path the fused kernel is written for)."""
    return bool(ctx.tune("attention_decode").get("fuse_rope")) and vec16(ctx, q) and k.ld % 8 == 0


def rope_freq(ctx, op, theta: float):
    """The frequency-factor weight this rope op reads, or None. ``theta`` / ``scaling`` attributes
    (Gemma's local and global layers) pick the op's base and scaling; the plan's one factor table
    (ctx.freq, from the model's rope_scaling or a GGUF rope_freqs tensor) serves only ops with the
    model's own base and scaling; an op whose scaling attribute is unscaled reads none."""
    d = ctx.dims
    if "scaling" in op.attrs:
        scaling = ctx.attr_dim(op, "scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            return None
        if scaling != (d.get("rope_scaling") or {}) or ctx.freq is None:
            raise ConfigError(
                f"plan: rope scaling {scaling} of one layer type differs from the model's rope_scaling "
                f"(the CUDA plan has one frequency-factor table)"
            )
    if ctx.freq is not None and theta != float(d["rope_theta"]):
        raise ConfigError(
            f"plan: rope theta {theta} with frequency factors made for rope_theta {d['rope_theta']} "
            f"(the CUDA plan has one frequency-factor table)"
        )
    return ctx.freq


@register("rope", bind=bind, short=True, attrs=("freq_factors", "theta", "scaling"))
def lower(ctx, op, layer, mode, ins, outs, ws):
    d = ctx.dims
    theta = float(ctx.attr_dim(op, "theta") or d["rope_theta"])  # a layer type's own base (Gemma)
    freq_w = rope_freq(ctx, op, theta)
    q, k = ins
    v = ctx.rope_v.get(layer)
    if v is None:
        raise ConfigError("plan: rope is not followed by an attention op (the KV write needs its v)")
    qn = ctx.pending_norm.pop((layer, mode, q.name), None)
    kn = ctx.pending_norm.pop((layer, mode, k.name), None)
    if (qn is None) != (kn is None):
        raise ConfigError("plan: head_rmsnorm on only one of q and k is not supported by the CUDA plan")
    t = kc.ELEMENTWISE_THREADS
    params = dict(
        heads=d["heads"],
        kv_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        rope_dim=d["rope_dim"],
        theta=repr(theta),
        style=ctx.rope_style,
        q_stride=q.ld,
        kv_stride=k.ld,
        qk_norm=qn is not None,
        eps=repr(float(d["rms_eps"])),
        freq_factors=freq_w is not None,
        threads=t,
        **({"v_stride": v.ld} if v.ld != k.ld else {}),
    )
    norms = (wgt(qn) if qn else NULL, wgt(kn) if kn else NULL)
    # a window layer writes its KV through its own slots (the runner's window pool, or the slots)
    slots = Arg("input", "window_slots" if ctx.rope_window.get(layer) else "slots")
    freq = wgt(freq_w) if freq_w is not None else NULL
    if mode in ("short", VSHORT) and rope_fuses(ctx, q, k) and v.ld % 8 == 0:
        # short-context decode: the direct attention kernel that follows rotates q / k itself
        # and writes the cache (the split kernels do not: every split block would redo the rope);
        # in a verify pass (VSHORT) also its earlier rows' keys (the attention's vfresh)
        fused = {key: params[key] for key in kc.ATTENTION_ROPE_PARAMS if key in params}
        extra = (val(k), val(v), *norms, freq, slots)
        ctx.rope_fused[layer] = ({"rope": True, **fused}, extra)
        return []
    spec = ctx.spec("rope", **params)
    args = (
        val(q),
        val(k),
        val(v),
        Arg("input", "positions"),
        *norms,
        freq,
        Arg("kv", "k", layer=layer),
        Arg("kv", "v", layer=layer),
        slots,
        ROWS,
    )
    return [Launch(spec, ("n", kc.rope_head_blocks(params)), (t,), args)]
