"""Lowering units ``moe_router`` and ``moe_experts``: a Qwen3-MoE sparse MLP on the device.

moe_router: in decode passes one moe_router launch (the router GEMV from a bf16 or f32 router
matrix, f32 logits [rows, E] into a value of their own, and the top-k routing by the last block of
each token group; the post-pass fold_router_norm folds the rmsnorm before it in, so x is then the
residual stream and the router stores h); in prefill (and for other router types) the dense gemv
kernel then moe_topk.
Both write the expert ids (i32) and weights (f32) into fixed-size [rows, top_k] values: no host
synchronisation, so decode stays in the CUDA graph.
moe_experts over the stacked [E, N, K] expert weights (uploaded as the file's blocks): at batch 1
(decode1) and in batched decode passes of up to SLOT_ROWS rows the per-slot moe_gemv
``glu`` then ``down`` (+ residual), which read only the chosen experts' rows; in larger decode
buckets and wide ones the grouped modes (one block per (row tile, chosen expert) reads the expert
once for all its tokens; grid y min(E, n * top_k)) and moe_combine (the router-weighted slot sum
+ residual); in prefill, and in decode buckets from GEMM_TOKENS_PER_EXPERT tokens per expert on
average, the tensor-core grouped GEMM (moe_sort groups the pairs by expert on the device, moe_gemm
glu and down per expert row tile) and moe_combine. A shared expert (seven weights: gate, up, down
and the f32 gate vector) runs after them through the dense linear paths (GEMVs in decode, the
GEMM in prefill), silu_mul and moe_shared (out += sigmoid(h . gate) * shared). ``shared_gate``
runs moe_shared for a shared expert the graph writes as plain ops; in decode passes the post-pass
shared_into_down folds it into the routed down / moe_combine. Kernel specs and argument lists come from
engine.moe_kernels. Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from engine import moe_kernels as mk
from engine.ir import NULL, ROWS, WIDE, Arg, Launch, ScratchPlan, cdiv, val, wgt
from engine.kernel_catalog import ELEMENTWISE_THREADS
from engine.lowering.gemv import gemv_launches
from engine.lowering.linear import linear_gemm
from engine.lowering.registry import post_pass, register, same_width
from engine.types import ConfigError

RPB = 4  # warps (output rows) per block of the expert GEMVs
TOPK_WARPS = 4  # tokens per block of moe_topk
ROUTER_ROWS, ROUTER_TOKENS = 2, 8  # moe_router (decode): router rows and tokens per block
SLOT_BATCH = 8  # (token, slot) pairs per pass over an expert row (grouped modes)
# batched decode passes of up to SLOT_ROWS rows take the per-slot kernels as batch 1 does: with
# few tokens two rarely share an expert (4 tokens x 8 of 128: ~8 % of the rows read twice), and the
# per-slot down sums a token's slots itself (no f32 partials, no moe_combine launch)
SLOT_ROWS = 4
GROUPED_ROWS_PER_WARP = 4  # the grouped expert GEMVs' output rows per warp (one scan of ids per 16 rows)
GEMM_TOKENS_PER_EXPERT = 4  # decode buckets with at least this many per expert on average take the GEMM
DECODE_TILE_M = 16  # the GEMM's row tile in decode buckets (a few tokens per expert)


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


@register("moe_router", bind=bind_router, wide="decode", attrs=("top_k", "normalize"))
def lower_router(ctx, op, layer, mode, ins, outs, ws):
    ids, weights, logits = outs
    w = ws[0]
    if ins[0].width != w.cols:
        raise ConfigError(f"plan: moe_router reads {ins[0].name} of width {ins[0].width}, the router has {w.cols} columns")
    top_k = int(_dim(ctx, op, "top_k"))
    normalize = bool(_dim(ctx, op, "normalize", False))
    if mode != "prefill" and w.dtype in ("f32", "bf16"):  # decode: GEMV and routing in one launch
        trigger = mode == "decode1" and ctx.graph_knob("early_trigger")
        r = mk.router_kernel(w.rows, w.cols, top_k, normalize, w.dtype, ins[0].ld, ROUTER_ROWS, ROUTER_TOKENS, trigger)
        ctx.need_scratch(ScratchPlan("moe_route_count", fixed=mk.router_counters(ctx.max_tokens, ROUTER_TOKENS), fill="zero"))
        grid = (cdiv(w.rows, ROUTER_ROWS), f"(n + {ROUTER_TOKENS - 1}) // {ROUTER_TOKENS}")
        args = (val(ids), val(weights), val(logits), val(ins[0]), wgt(w), Arg("scratch", "moe_route_count"), ROWS)
        return [Launch(r.spec, grid, r.block[:1], args)]
    gemv = gemv_launches(ctx, op, layer, mode, ins, logits, w)
    k = mk.topk_kernel(w.rows, top_k, normalize, TOPK_WARPS)
    grid = (f"(n + {TOPK_WARPS - 1}) // {TOPK_WARPS}",)
    topk = Launch(k.spec, grid, k.block[:1], (val(ids), val(weights), val(logits), ROWS))
    return [*gemv, topk]


@post_pass(10)
def fold_router_norm(ctx, steps, weights, values) -> None:
    """Decode passes (batch 1 and batched): an rmsnorm step right before a moe_router step of its
    layer that reads the norm's output as x, both one launch (rmsnorm without a residual, the
    fused moe_router): the rmsnorm launch goes and moe_router normalises x itself and stores h
    for the expert kernels (its ``eps`` form). Prefill and wide buckets keep both launches."""
    for prev, st in zip(steps, steps[1:], strict=False):
        if st.op.op != "moe_router" or prev.op.op != "rmsnorm" or prev.layer != st.layer:
            continue
        if list(prev.op.outputs) != [st.op.inputs[0]]:
            continue
        for mode in ("decode1", "decode"):
            norm, route = prev.launches.get(mode, ()), st.launches.get(mode, ())
            if len(norm) != 1 or len(route) != 1 or route[0].spec.template != "moe_router":
                continue
            n, r = norm[0], route[0]
            if n.spec.template != "rmsnorm" or n.spec.params["residual"]:
                continue
            h_arg, x_arg, _, nw_arg, _ = n.args
            x, h, p = values[x_arg.ref], values[h_arg.ref], r.spec.params
            if x.ld % 8 or x.offset % 8 or h.offset % 8 or r.args[3] != h_arg:
                continue
            k = mk.router_kernel(p["experts"], p["k"], p["top_k"], p["normalize"], p["wdtype"], x.ld,
                                 p["rows_per_block"], p["tokens"], p["trigger"], eps=float(ctx.dims["rms_eps"]), h_stride=h.ld)
            args = r.args[:3] + (x_arg,) + r.args[4:] + (nw_arg, h_arg)
            prev.launches[mode] = ()
            st.launches[mode] = (dataclasses.replace(r, spec=k.spec, args=args),)


@post_pass(12)
def route_in_glu(ctx, steps, weights, values) -> None:
    """Batch-1 decode: a moe_router launch whose ids and weights only the next moe_experts step of
    its layer reads, through a moe_gemv_q8 glu, stores only the logits (``route`` False: no
    counter, fence and last block) and that glu routes each token in its own blocks from them
    (``expert_q8_kernel`` route), writing the ids and weights the down after it reads."""
    for i, st in enumerate(steps):
        route = st.launches.get("decode1", ())
        if st.op.op != "moe_router" or len(route) != 1 or route[0].spec.template != "moe_router":
            continue
        nxt = next((s for s in steps[i + 1 :] if s.layer == st.layer and s.op.op == "moe_experts"), None)
        outs, readers = set(st.op.outputs), []
        for s in steps[i + 1 :]:  # (until a later step writes the values again: the next layer's router)
            if set(s.op.inputs) & outs:
                readers.append(s)
            if set(s.op.outputs) & outs:
                break
        if nxt is None or readers != [nxt] or list(nxt.op.inputs[1:3]) != list(st.op.outputs[:2]):
            continue
        r = route[0]
        glu = nxt.launches.get("decode1", ())[:1]
        if not glu or glu[0].spec.template != "moe_gemv_q8" or glu[0].spec.params["mode"] != "glu":
            continue
        g, p, q = glu[0], r.spec.params, glu[0].spec.params
        if g.args[4] != r.args[0]:
            continue
        rk = mk.router_kernel(p["experts"], p["k"], p["top_k"], p["normalize"], p["wdtype"], p["x_stride"],
                              p["rows_per_block"], p["tokens"], p["trigger"],
                              eps=float(p["eps"]) if p["norm"] else None, h_stride=p.get("h_stride", 0), route=False)
        gk = mk.expert_q8_kernel("glu", q["quant"], q["n"], q["k"], q["top_k"], trigger=q["trigger"],
                                 route=(int(p["experts"]), p["normalize"]), warps=q["warps"],
                                 rows_per_warp=q["rows_per_warp"], prefetch=q["prefetch"])
        extra = (r.args[1], r.args[2])
        st.launches["decode1"] = (dataclasses.replace(r, spec=rk.spec),)
        nxt.launches["decode1"] = (dataclasses.replace(g, spec=gk.spec, args=g.args + extra), *nxt.launches["decode1"][1:])


@post_pass(13)
def shared_into_down(ctx, steps, weights, values) -> None:
    """Decode passes: a shared_gate step (moe_shared) after the moe_experts step of its layer, no
    step between them reading or writing its output: the launches that store the routed sum into
    that value (moe_gemv_q8's per-slot down, moe_combine) move to the shared_gate step in their
    ``shared`` form (moe_shared's gate and add in their epilogue, the same bits) and moe_shared's
    launch goes, where the moved launches cover every row count of the pass (batch 1: the down;
    batched: the per-slot down up to SLOT_ROWS rows, moe_combine above)."""
    for i, st in enumerate(steps):
        if st.op.op != "shared_gate":
            continue
        j = next((j for j in range(i - 1, -1, -1) if steps[j].op.op == "moe_experts"), None)
        if j is None or steps[j].layer != st.layer:
            continue
        ex = steps[j]
        for mode in ("decode1", "decode"):
            gate = st.launches.get(mode, ())
            if len(gate) != 1 or gate[0].spec.template != "moe_shared" or gate[0].min_rows or gate[0].max_rows:
                continue
            g = gate[0]
            out = g.args[0]
            if any(out.ref in (*s.op.inputs, *s.op.outputs, s.op.attrs.get("residual")) for s in steps[j + 1 : i]):
                continue
            threads = int(g.spec.params["threads"])
            moved = {k: la for k, la in enumerate(ex.launches.get(mode, ())) if _shared_form(la, out, threads)}
            spans = sorted((la.min_rows, la.max_rows) for la in moved.values())
            if not spans or not _covers(spans):
                continue
            y, h, gw = g.args[1:4]
            ex.launches[mode] = tuple(la for k, la in enumerate(ex.launches[mode]) if k not in moved)
            st.launches[mode] = tuple(
                dataclasses.replace(la, spec=_shared_form(la, out, threads), args=la.args[:-1] + (y, h, gw, la.args[-1]))
                for la in moved.values()
            )


def _shared_form(la: Launch, out: Arg, threads: int):
    """The ``shared`` form's spec of a launch that stores the routed sum plus the residual into
    ``out`` (moe_gemv_q8 down, moe_combine) in blocks of moe_shared's ``threads``; else None."""
    p = la.spec.params
    if la.args[0] != out or la.args[-1] != ROWS:
        return None
    if la.spec.template == "moe_gemv_q8" and p["mode"] == "down" and p["residual"] and la.args[5] == out:
        if threads != 32 * int(p["warps"]):
            return None
        return mk.expert_q8_kernel("down", p["quant"], p["n"], p["k"], p["top_k"], residual=True, trigger=p["trigger"],
                                   shared=threads, warps=p["warps"], rows_per_warp=p["rows_per_warp"],
                                   prefetch=p["prefetch"]).spec
    if la.spec.template == "moe_combine" and p["residual"] and la.args[3] == out and int(p["threads"]) == threads:
        return mk.combine_kernel(p["n"], p["top_k"], True, threads, shared=threads).spec
    return None


def _covers(spans: list[tuple[int, int]]) -> bool:
    """Whether the (min_rows, max_rows) bounds (0: none), sorted, cover every row count from 1 up."""
    nxt = 1
    for lo, hi in spans:
        if lo > nxt:
            return False
        if not hi:
            return True
        nxt = max(nxt, hi + 1)
    return False


def bind_experts(op, ws, ins, dims, value_for):
    out = [value_for(op.outputs[0], ins[0].width)]
    if len(ws) == 7:  # the shared expert's gate, up, SwiGLU and down outputs
        shared = ws[3].rows
        out += [value_for(f"{op.outputs[0]}.shared_{p}", shared) for p in ("gate", "up", "act")]
        out.append(value_for(f"{op.outputs[0]}.shared_out", ins[0].width))
    return out


@register("moe_experts", bind=bind_experts, attrs=("residual",))
def lower_experts(ctx, op, layer, mode, ins, outs, ws):
    if len(ws) not in (3, 7):
        raise ConfigError(f"plan: moe_experts takes 3 weights (or 7 with a shared expert), got {len(ws)}")
    routed = routed_experts(ctx, op, mode, ins, outs[0], ws[:3])
    shared_mode = "decode" if mode == WIDE else mode  # (the shared expert's GEMVs as in batched decode)
    return routed + (shared_expert(ctx, layer, shared_mode, ins[0], outs, ws[3:]) if len(ws) == 7 else [])


@register("shared_gate", bind=same_width, attrs=("residual",))
def lower_shared_gate(ctx, op, layer, mode, ins, outs, ws):
    """out += sigmoid(h . gate) * y in place (moe_shared): the graph's ``residual`` is its output."""
    h, y = ins
    out, gate = outs[0], ws[0]
    if op.attrs.get("residual") != op.outputs[0]:
        raise ConfigError(f"plan: shared_gate adds into its output in place: residual must be {op.outputs[0]!r}")
    if y.width != h.width or out.width != h.width:
        raise ConfigError(f"plan: shared_gate reads h of width {h.width}, y of {y.width}, writes {out.width}")
    if gate.rows != 1 or gate.cols != h.width or gate.dtype != "f32":
        raise ConfigError(f"plan: the shared expert gate {gate.key} must be an f32 vector of {h.width}")
    if h.ld != h.width or y.ld != y.width or out.ld != out.width:
        raise ConfigError("plan: shared_gate reads and writes unstrided rows (moe_shared)")
    k = mk.shared_kernel(h.width)
    return [Launch(k.spec, ("n",), k.block[:1], (val(out), val(y), val(h), wgt(gate), ROWS))]


def shared_expert(ctx, layer, mode, h, outs, ws) -> list[Launch]:
    """out += sigmoid(h . gate_inp) * down(silu(gate h) * up h): the dense linear paths (GEMVs in
    decode, the GEMM in prefill), silu_mul, then moe_shared."""
    out, g, u, act, y = outs
    wg, wu, wd, gate = ws
    if gate.rows != 1 or gate.cols != h.width or gate.dtype != "f32":
        raise ConfigError(f"plan: the shared expert gate {gate.key} must be an f32 vector of {h.width}")
    plain = SimpleNamespace(op="linear", attrs={})  # the shared projections add no residual

    def linear(x, o, w):
        if mode == "prefill":
            return linear_gemm(ctx, plain, mode, [x], [o], [w])
        return gemv_launches(ctx, plain, layer, mode, [x], o, w)

    t = ELEMENTWISE_THREADS
    silu = ctx.spec("silu_mul", inter=g.width, in_stride=g.ld, threads=t)
    k = mk.shared_kernel(h.width)
    return [
        *linear(h, g, wg),
        *linear(h, u, wu),
        Launch(silu, (cdiv(g.width, 8 * t), "n"), (t,), (val(act), val(g), val(u), ROWS)),
        *linear(act, y, wd),
        Launch(k.spec, ("n",), k.block[:1], (val(out), val(y), val(h), wgt(gate), ROWS)),
    ]


def routed_experts(ctx, op, mode, ins, out, ws) -> list[Launch]:
    h, ids, weights = ins
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
    trigger = mode == "decode1" and ctx.graph_knob("early_trigger")  # (as the batch-1 GEMVs)
    solo = per_slot(ctx, h, ids, weights, out, res, act, (wg, wu, wd), trigger)
    if mode == "decode1":  # per (token, slot): only the chosen experts' rows are read
        return solo
    gemm = grouped_gemm(ctx, mode, h, ids, weights, out, res, act, (wg, wu, wd), experts)
    if mode == "prefill" and gemm:
        return gemm
    slot_rows = min(SLOT_ROWS, gemm[0].min_rows - 1) if gemm else SLOT_ROWS  # (never beside the GEMM)
    if mode == "decode":  # the smallest batched buckets: per slot too
        solo = [dataclasses.replace(la, max_rows=slot_rows) for la in solo]
        grouped_rows = {"min_rows": slot_rows + 1}
    else:
        solo, grouped_rows = [], {}
    # grouped by expert: an expert's (token, slot) pairs number at most the step's rows
    slots = max(top_k, ctx.max_tokens)
    if slots > mk.MAX_SLOTS:
        raise ConfigError(f"plan: moe_experts over {slots} rows per step; the grouped kernels take {mk.MAX_SLOTS}")
    rpw = GROUPED_ROWS_PER_WARP
    grouped = dict(experts=experts, max_slots=slots, slot_batch=SLOT_BATCH, rows_per_warp=rpw)
    # (x rounded as the per-slot q8x kernels stage it where those run: batched equal to solo)
    q8r = {m: mode != WIDE and q8_slots(ctx, m, w.dtype, k, top_k) for m, w, k in (("glu", wg, hidden), ("down", wd, inter))}
    glu = mk.expert_gemv_kernel("glu_grouped", wg.dtype, inter, hidden, top_k, RPB, **grouped, q8x_round=q8r["glu"])
    down = mk.expert_gemv_kernel("down_grouped", wd.dtype, hidden, inter, top_k, RPB, **grouped, q8x_round=q8r["down"])
    comb = mk.combine_kernel(hidden, top_k, residual=bool(res_name))
    ctx.need_scratch(ScratchPlan("moe_partial", fixed=ctx.max_tokens * top_k * hidden * 4))
    partial = Arg("scratch", "moe_partial")
    # batched / wide decode buckets: the grouped GEMVs below the GEMM's min_rows (one block row per
    # expert the step can choose), the GEMM from there
    cap = {**grouped_rows, **({"max_rows": gemm[0].min_rows - 1} if gemm else {})}
    gy = mk.grouped_grid_y(top_k, experts)
    # q8x_round: x (h) and act rounded once a step into f32 rows (moe_q8round), which the grouped
    # GEMVs read instead of rounding each (pair, group) again for every weight row
    x_in, act_in, rnd = val(h), act, []
    q_rows = cap.get("max_rows") or ctx.max_tokens  # (the rows these launches run at: below the GEMM's)
    if q8r["glu"]:
        ctx.need_scratch(ScratchPlan("moe_xq", fixed=q_rows * hidden * 4))
        x_in = Arg("scratch", "moe_xq")
        k = mk.q8round_kernel(hidden, h.ld)
        rnd.append(Launch(k.spec, (k.grid(1)[0], "n"), k.block[:1], (x_in, val(h), ROWS), **cap))
    glu_l = Launch(glu.spec, (cdiv(inter, RPB * rpw), gy), glu.block[:1], (act, wgt(wg), wgt(wu), x_in, val(ids), ROWS), **cap)
    if q8r["down"]:
        ctx.need_scratch(ScratchPlan("moe_actq", fixed=q_rows * top_k * inter * 4))
        act_in = Arg("scratch", "moe_actq")
        k = mk.q8round_kernel(inter, inter, row_mult=top_k)
        rnd_act = [Launch(k.spec, (k.grid(1)[0], f"n * {top_k}"), k.block[:1], (act_in, act, ROWS), **cap)]
    else:
        rnd_act = []
    gemv = [
        *rnd,
        glu_l,
        *rnd_act,
        Launch(down.spec, (cdiv(hidden, RPB * rpw), gy), down.block[:1], (partial, wgt(wd), act_in, val(ids), ROWS), **cap),
    ]
    combine = Launch(comb.spec, (cdiv(hidden, comb.block[0]), "n"), comb.block[:1], (val(out), partial, val(weights), res, ROWS), **grouped_rows)
    return solo + gemv + gemm[:-1] + [combine]


def q8_slots(ctx, mode: str, dtype: str, k: int, top_k: int) -> bool:
    """Whether the per-slot ``mode`` GEMV over a [*, k] ``dtype`` stack is moe_gemv_q8's: the
    profile's GEMVs take int8 x rows (gemv_coop.q8x) and the kernel takes the stack
    (engine.moe_kernels.q8_supported)."""
    return bool(ctx.tune("gemv_coop").get("q8x")) and mk.q8_supported(mode, dtype, k, top_k)


def per_slot(ctx, h, ids, weights, out, res, act, ws, trigger: bool = False) -> list[Launch]:
    """The per-(token, slot) expert GEMVs: glu (grid y n * top_k) then down, which sums each
    token's slots, router-weighted, and adds the residual: only the chosen experts' rows are
    read, no partials, no combine. Where the profile's GEMVs take int8 x rows (gemv_coop.q8x)
    and moe_gemv_q8 takes the stack's type (q4_k, q5_k, q6_k), that kernel; else
    moe_gemv's f32 ones. ``trigger``: both call pdl_trigger() once their first weight
    loads are out (tuning decode_graph.early_trigger, batch 1)."""
    wg, wu, wd = ws
    top_k, hidden, inter = ids.width, h.width, wd.cols
    if q8_slots(ctx, "glu", wg.dtype, hidden, top_k):
        glu = mk.expert_q8_kernel("glu", wg.dtype, inter, hidden, top_k, trigger=trigger)
    else:
        glu = mk.expert_gemv_kernel("glu", wg.dtype, inter, hidden, top_k, RPB, trigger=trigger)
    if q8_slots(ctx, "down", wd.dtype, inter, top_k):
        down = mk.expert_q8_kernel("down", wd.dtype, hidden, inter, top_k, residual=res is not NULL, trigger=trigger)
    else:
        down = mk.expert_gemv_kernel("down", wd.dtype, hidden, inter, top_k, RPB, residual=res is not NULL, trigger=trigger)
    gx_glu, gx_down = glu.grid(1)[0], down.grid(1)[0]
    return [
        Launch(glu.spec, (gx_glu, f"n * {top_k}"), glu.block[:1], (act, wgt(wg), wgt(wu), val(h), val(ids), ROWS)),
        Launch(down.spec, (gx_down, "n"), down.block[:1], (val(out), wgt(wd), act, val(ids), val(weights), res, ROWS)),
    ]


def grouped_gemm(ctx, mode, h, ids, weights, out, res, act, ws, experts) -> list[Launch]:
    """Prefill, and batched / wide decode buckets from GEMM_TOKENS_PER_EXPERT tokens per expert on
    average (``min_rows``; row tiles of DECODE_TILE_M): moe_sort groups the (token, slot) pairs by
    expert, the tensor-core moe_gemm runs glu then down per expert row tile, moe_combine sums each
    token's slots. [] where the GEMM does not fit the shapes or storage types (the grouped GEMVs
    serve)."""
    if mode not in ("prefill", "decode", WIDE):
        return []
    wg, wu, wd = ws
    top_k, hidden, inter = ids.width, h.width, wd.cols
    tiles = {} if mode == "prefill" else {"tile_m": DECODE_TILE_M, "warps_m": 1}
    try:
        glu = mk.expert_gemm_kernel("glu", wg.dtype, inter, hidden, top_k, experts, **tiles)
        down = mk.expert_gemm_kernel("down", wd.dtype, hidden, inter, top_k, experts, **tiles)
        sort = mk.sort_kernel(experts, top_k, glu.spec.params["tile_m"])
    except ConfigError:
        return []
    bm = glu.spec.params["tile_m"]
    slots = ctx.max_tokens * top_k
    ctx.need_scratch(ScratchPlan("moe_perm", fixed=slots * 4))
    ctx.need_scratch(ScratchPlan("moe_tiles", fixed=(1 + mk.gemm_max_tiles(ctx.max_tokens, top_k, experts, bm)) * 16))
    ctx.need_scratch(ScratchPlan("moe_partial", fixed=slots * hidden * 4))
    perm, tiles_arg, partial = Arg("scratch", "moe_perm"), Arg("scratch", "moe_tiles"), Arg("scratch", "moe_partial")
    comb = mk.combine_kernel(hidden, top_k, residual=res is not NULL)
    gy = mk.gemm_grid_y(top_k, experts, bm)
    least = int(ctx.tune("gemm_decode").get("moe_min_rows") or 0) or -(-GEMM_TOKENS_PER_EXPERT * experts // top_k)
    rows = {} if mode == "prefill" else {"min_rows": max(2, least)}
    return [
        Launch(sort.spec, (1,), sort.block[:1], (perm, tiles_arg, val(ids), ROWS), **rows),
        Launch(glu.spec, (cdiv(inter, glu.spec.params["tile_n"] // 2), gy), glu.block[:1],
               (act, wgt(wg), wgt(wu), val(h), perm, tiles_arg, ROWS), glu.smem, **rows),
        Launch(down.spec, (cdiv(hidden, down.spec.params["tile_n"]), gy), down.block[:1],
               (partial, wgt(wd), act, perm, tiles_arg, ROWS), down.smem, **rows),
        Launch(comb.spec, (cdiv(hidden, comb.block[0]), "n"), comb.block[:1], (val(out), partial, val(weights), res, ROWS)),
    ]
