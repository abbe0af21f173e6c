"""Lowering units of the hybrid families' ops (Qwen3.5 / Qwen3-Next): ``causal_conv1d`` and
``gated_delta_rule`` (stateful: each declares its per-slot f32 state, a ``StatePlan``, and reads the
step inputs state_in / state_out / state_snap, so decode stays in the replayed graph; prefill passes
walk each sequence's tokens through seq_starts: token by token, or in chunks with
gated_delta_chunk where the prefill form is "chunked" (the default; see
engine.linear_attn_kernels.delta_prefill_form) and delta_chunk_fits the head shape with a chunk
that divides the KV block size: its chunks end at absolute multiples of the chunk, so every
prefix-cache snapshot ends one), ``gated_rmsnorm``, ``split_heads``, ``sigmoid_mul`` and
``unpack_qkvz_ba``. The post-pass ``fold_delta_neighbours`` folds a decode pass's causal_conv1d and
gated_rmsnorm into the gated_delta_rule launch between them. Kernel specs and argument lists come from
engine.linear_attn_kernels. Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses

from engine import linear_attn_kernels as lk
from engine.ir import Arg, Launch, ScratchPlan, StatePlan, val, wgt
from engine.kernel_catalog import ELEMENTWISE_THREADS
from engine.lowering.registry import post_pass, register, same_width
from engine.types import ConfigError

PREFILL = "prefill"


def _grid(k: lk.HybridKernel, rows: str) -> tuple:
    """The kernel's grid with its row-count dimension(s) as the shape name ``rows``."""
    one, two = k.grid(1), k.grid(2)
    return tuple(rows if a != b else a for a, b in zip(one, two, strict=True))


def _launch(k: lk.HybridKernel, rows: str, named: dict[str, Arg]) -> Launch:
    args = tuple(named[name] for name, _ in k.args)
    return Launch(k.spec, _grid(k, rows), k.block[:1], args, k.smem)


def _state_args(name: str) -> dict[str, Arg]:
    return {
        "state": Arg("state", name),
        "state_in": Arg("input", "state_in"),
        "state_out": Arg("input", "state_out"),
        "state_snap": Arg("input", "state_snap"),
        "seq_starts": Arg("input", "seq_starts"),
    }


def _rows(mode: str) -> str:
    """The stateful kernels run one block row per sequence: prefill's sequences, else decode rows."""
    return "nseq" if mode == PREFILL else "n"


def _trigger(ctx, mode: str) -> bool:
    """Batch-1 decode's early pdl_trigger() (decode_graph.early_trigger, as the GEMVs: bit-neutral)."""
    return mode == "decode1" and ctx.graph_knob("early_trigger")


def _d(ctx, key: str) -> int:
    if key not in ctx.dims:
        raise ConfigError(f"plan: the hybrid ops need the dim {key!r}")
    return int(ctx.dims[key])


@register("causal_conv1d", bind=same_width, wide="decode")
def lower_conv(ctx, op, layer, mode, ins, outs, ws):
    x, out = ins[0], outs[0]
    kernel, channels = _d(ctx, "lin_conv_kernel"), _d(ctx, "lin_conv_dim")
    w = ws[0]
    if x.width != channels or w.rows * w.cols != channels * kernel or w.dtype != "f32":
        raise ConfigError(
            f"plan: causal_conv1d reads {x.name} of width {x.width} with a {w.dtype} [{w.rows}, {w.cols}] "
            f"weight; expected {channels} channels and f32 [{channels}, {kernel}]"
        )
    name = f"L{layer}.causal_conv1d"
    ctx.need_state(StatePlan(name, int(layer), 4 * channels * (kernel - 1)))
    k = lk.conv1d_kernel(channels, kernel, x.ld, out.ld, mode == PREFILL, ELEMENTWISE_THREADS)
    rows = _rows(mode)
    named = {"out": val(out), "x": val(x), "w": wgt(w), **_state_args(name), "rows": Arg("shape", rows, "i32")}
    return [_launch(k, rows, named)]


def bind_delta(op, ws, ins, dims, value_for):
    return [value_for(op.outputs[0], int(dims["lin_v_heads"]) * int(dims["lin_v_dim"]))]


@register("gated_delta_rule", bind=bind_delta, wide="decode")
def lower_delta(ctx, op, layer, mode, ins, outs, ws):
    qkv, b, a = ins
    out = outs[0]
    kh, vh, kd, vd = (_d(ctx, x) for x in ("lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim"))
    A, dt_bias = ws
    if qkv.width != 2 * kh * kd + vh * vd or b.width != vh or a.width != vh or A.cols != vh or dt_bias.cols != vh:
        raise ConfigError(
            f"plan: gated_delta_rule widths qkv {qkv.width}, b {b.width}, a {a.width}, A {A.cols}, dt_bias "
            f"{dt_bias.cols} do not fit k_heads {kh} x {kd}, v_heads {vh} x {vd}"
        )
    name = f"L{layer}.gated_delta_rule"
    ctx.need_state(StatePlan(name, int(layer), 4 * vh * kd * vd))
    tiled = bool(ctx.dims.get("v_heads_tiled"))
    block = int(ctx.profile.kv_block_size)
    if mode == PREFILL and lk.delta_prefill_form(ctx.delta_prefill) == "chunked" and lk.delta_chunk_fits(kh, vh, kd, vd, block):
        k = lk.delta_chunk_kernel(kh, vh, kd, vd, qkv.ld, b.ld, a.ld, out.ld, tiled, True, block=block)
    else:
        threads = lk.DELTA_PREFILL_THREADS if mode == PREFILL else lk.DELTA_DECODE_THREADS
        k = lk.delta_rule_kernel(kh, vh, kd, vd, qkv.ld, b.ld, a.ld, out.ld, tiled, mode == PREFILL, threads,
                                 trigger=_trigger(ctx, mode))
    rows = _rows(mode)
    named = {
        "out": val(out),
        "qkv": val(qkv),
        "b": val(b),
        "a": val(a),
        "A": wgt(A),
        "dt_bias": wgt(dt_bias),
        **_state_args(name),
        "positions": Arg("input", "positions"),
        "rows": Arg("shape", rows, "i32"),
    }
    return [_launch(k, rows, named)]


@register("gated_rmsnorm", bind=same_width, wide="decode")
def lower_gated_rmsnorm(ctx, op, layer, mode, ins, outs, ws):
    x, z = ins
    out, w = outs[0], ws[0]
    hd = _d(ctx, "lin_v_dim")
    if x.width % hd or z.width != x.width or w.cols != hd:
        raise ConfigError(f"plan: gated_rmsnorm over {x.width} / {z.width} values with a [{w.cols}] weight, head {hd}")
    k = lk.gated_rmsnorm_kernel(x.width // hd, hd, x.ld, z.ld, out.ld, float(ctx.dims["rms_eps"]))
    named = {"out": val(out), "x": val(x), "z": val(z), "w": wgt(w), "rows": Arg("shape", "n", "i32")}
    return [_launch(k, "n", named)]


DECODE_MODES = ("decode1", "decode")  # (wide decode buckets take the decode launches)


def _readers(steps, i: int, name: str) -> list:
    """The steps after steps[i] that read value ``name`` before a step writes it again."""
    out = []
    for st in steps[i + 1 :]:
        if name in st.op.inputs or name == st.op.attrs.get("residual"):
            out.append(st)
        if name in st.op.outputs:
            break
    return out


@post_pass(14)
def fold_delta_neighbours(ctx, steps, weights, values) -> None:
    """Decode passes: the gated_delta_rule launch takes in the causal_conv1d right before it (in
    place on the q|k|v it alone reads) and the gated_rmsnorm right after it (of its output), each
    one launch in its own step: the rule's ``conv`` and ``norm`` forms, which apply those kernels'
    arithmetic to the same values (the same bits), two launches fewer per layer. Prefill keeps
    all three."""
    for i, st in enumerate(steps):
        if st.op.op != "gated_delta_rule":
            continue
        prev, nxt = steps[i - 1] if i else None, steps[i + 1] if i + 1 < len(steps) else None
        conv_ok = (prev is not None and prev.op.op == "causal_conv1d" and prev.layer == st.layer
                   and prev.op.outputs[0] == st.op.inputs[0] and _readers(steps, i - 1, prev.op.outputs[0]) == [st])
        norm_ok = (nxt is not None and nxt.op.op == "gated_rmsnorm" and nxt.layer == st.layer
                   and nxt.op.inputs[0] == st.op.outputs[0])
        for mode in DECODE_MODES:
            own = st.launches.get(mode, ())
            if len(own) != 1 or own[0].spec.template != "gated_delta_rule" or own[0].spec.params["varlen"]:
                continue
            d = own[0]
            p = d.spec.params
            conv = _conv_fold(prev.launches.get(mode, ()), d) if conv_ok else None
            norm = _norm_fold(nxt.launches.get(mode, ()), d) if norm_ok else None
            if conv is None and norm is None:
                continue
            k = lk.delta_rule_kernel(p["k_heads"], p["v_heads"], p["k_dim"], p["v_dim"], p["qkv_stride"], p["b_stride"],
                                     p["a_stride"], p["out_stride"], p["v_tiled"], False, d.block[0],
                                     norm=norm[0] if norm else None, conv=conv[0] if conv else 0, trigger=p["trigger"])
            if k.block[:1] != tuple(d.block):
                continue
            args = d.args[:-1]
            if conv:
                ctx.need_scratch(ScratchPlan("delta_conv_count", fixed=4 * ctx.max_tokens * p["k_heads"], fill="zero"))
                args += (*conv[1], Arg("scratch", "delta_conv_count"))
                prev.launches[mode] = ()
            if norm:
                ctx.need_scratch(ScratchPlan("delta_norm_count", fixed=4 * ctx.max_tokens * p["v_heads"], fill="zero"))
                args += (*norm[1], Arg("scratch", "delta_norm_count"))
                nxt.launches[mode] = ()
            st.launches[mode] = (dataclasses.replace(d, spec=k.spec, args=args + d.args[-1:]),)


def _conv_fold(launches, d):
    """(taps, (weight, state) args) of a decode causal_conv1d launch the delta rule ``d`` can take
    in: in place on the q|k|v columns the rule reads, at its stride, over its channels; else None."""
    if len(launches) != 1 or launches[0].spec.template != "causal_conv1d":
        return None
    c, p = launches[0], d.spec.params
    q = c.spec.params
    out_, x, w, state, sin, sout, snap, starts, _rows = c.args
    channels = 2 * p["k_heads"] * p["k_dim"] + p["v_heads"] * p["v_dim"]
    if q["varlen"] or out_ != x or x != d.args[1] or q["x_stride"] != p["qkv_stride"] or q["out_stride"] != p["qkv_stride"]:
        return None
    if q["channels"] != channels or (sin, sout, snap, starts) != d.args[7:11]:
        return None
    return int(q["kernel"]), (w, state)


def _norm_fold(launches, d):
    """((z_stride, out_stride, eps), (out, z, weight) args) of a decode gated_rmsnorm launch over
    the delta rule ``d``'s output, heads and head size; else None."""
    if len(launches) != 1 or launches[0].spec.template != "gated_rmsnorm":
        return None
    n, p = launches[0], d.spec.params
    q = n.spec.params
    if q["heads"] != p["v_heads"] or q["head_dim"] != p["v_dim"] or n.args[1] != d.args[0] or q["x_stride"] != p["out_stride"]:
        return None
    out_, _x, z, w, _rows = n.args
    return (q["z_stride"], q["out_stride"], float(q["eps"])), (out_, z, w)


def bind_split(op, ws, ins, dims, value_for):
    parts = len(op.outputs)
    if parts != 2 or ins[0].width % 2:
        raise ConfigError(f"plan: split_heads splits into 2 outputs (got {parts}) of an even width ({ins[0].width})")
    return [value_for(name, ins[0].width // 2) for name in op.outputs]


@register("split_heads", bind=bind_split, wide="decode")
def lower_split(ctx, op, layer, mode, ins, outs, ws):
    x = ins[0]
    hd = _d(ctx, "head_dim")
    a, b = outs
    if a.width % hd:
        raise ConfigError(f"plan: split_heads output width {a.width} is not a whole number of heads of {hd}")
    k = lk.split_heads_kernel(a.width // hd, hd, x.ld, a.ld, b.ld, ELEMENTWISE_THREADS, trigger=_trigger(ctx, mode))
    named = {"a": val(a), "b": val(b), "x": val(x), "rows": Arg("shape", "n", "i32")}
    return [_launch(k, "n", named)]


@register("sigmoid_mul", bind=same_width, wide="decode")
def lower_sigmoid_mul(ctx, op, layer, mode, ins, outs, ws):
    x, g = ins
    out = outs[0]
    if g.width != x.width:
        raise ConfigError(f"plan: sigmoid_mul of {x.name} ({x.width}) by {g.name} ({g.width})")
    k = lk.sigmoid_mul_kernel(x.width, x.ld, g.ld, out.ld, ELEMENTWISE_THREADS, trigger=_trigger(ctx, mode))
    named = {"out": val(out), "x": val(x), "gate": val(g), "rows": Arg("shape", "n", "i32")}
    return [_launch(k, "n", named)]


def bind_unpack(op, ws, ins, dims, value_for):
    vh, inner = int(dims["lin_v_heads"]), int(dims["lin_inner"])
    widths = (int(dims["lin_conv_dim"]), inner, vh, vh)
    return [value_for(name, w) for name, w in zip(op.outputs, widths, strict=True)]


@register("unpack_qkvz_ba", bind=bind_unpack, wide="decode")
def lower_unpack(ctx, op, layer, mode, ins, outs, ws):
    kh, vh, kd, vd = (_d(ctx, x) for x in ("lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim"))
    qkvz, ba = ins
    qkv, z, b, a = outs
    if qkvz.width != kh * (2 * kd + 2 * (vh // kh) * vd) or ba.width != 2 * vh:
        raise ConfigError(f"plan: unpack_qkvz_ba widths {qkvz.width} / {ba.width} do not fit the head dims")
    strides = {"qkvz": qkvz.ld, "ba": ba.ld, "qkv": qkv.ld, "z": z.ld, "b": b.ld, "a": a.ld}
    k = lk.unpack_kernel(kh, vh, kd, vd, strides, ELEMENTWISE_THREADS)
    named = {n: val(v) for n, v in zip(("qkv", "z", "b", "a", "qkvz", "ba"), (qkv, z, b, a, qkvz, ba), strict=True)}
    named["rows"] = Arg("shape", "n", "i32")
    return [_launch(k, "n", named)]
