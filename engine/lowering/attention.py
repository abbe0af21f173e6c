"""Lowering unit ``attention``: paged causal GQA attention over the KV cache.

prefill: flash attention on tensor cores (kernels/attention_prefill.cu.j2; with the tuning's span,
the key split: short passes as one block per span + attention_combine's fold); decode: split-KV
partials + combine (kernels/attention.cu.j2, attention_combine.cu.j2); short (every row below
split_kv_tokens): the direct kernel, with the rope folded in where the rope unit left it; TAIL
(a prompt tail's decode pass past short_context, engine.runner_tail; dense plans with the span):
the key split's partial launch on the decode pass's rows + the fold. Post-passes:
``trigger_short1`` (tuning attention_decode.trigger_b1), ``tail_attention`` (the TAIL launches).
Must not import CUDA or numpy."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from engine import kernel_catalog as kc
from engine.ir import NULL, SHORT1, TAIL, VSHORT, Arg, Launch, ScratchPlan, Step, Value, WeightPlan, val
from engine.lowering.registry import post_pass, register, same_width
from engine.lowering.rope import vec16


@register("attention", bind=same_width, short=True, attrs=("window", "scale"))
def lower(ctx, op, layer, mode, ins, outs, ws):
    d = ctx.dims
    q, _k, _v_ = ins
    out = outs[0]
    heads, kvh, hd = d["heads"], d["kv_heads"], d["head_dim"]
    # window: sliding-window attention (keys p - window + 1 .. p; 0 / None: none), any family
    window = int(ctx.attr_dim(op, "window") or 0)
    common = dict(
        heads=heads,
        kv_heads=kvh,
        head_dim=hd,
        block_size=ctx.profile.kv_block_size,
        scale=repr(float(ctx.attr_dim(op, "scale") or float(hd) ** -0.5)),
        q_stride=q.ld,
        out_stride=out.ld,
        window=window,
    )
    # table_first stages the first chunk's table entries before the row's position is known:
    # from key 0, not the window's first key
    table_first = bool(ctx.tune("attention_decode").get("table_first")) and not window
    cache = (
        Arg("kv", "k", layer=layer),
        Arg("kv", "v", layer=layer),
        # a window layer reads its own tables (the runner's window pool, or the block tables)
        Arg("input", "window_tables" if window else "block_tables"),
        Arg("input", "positions"),
        Arg("shape", "max_blocks", "i32"),
    )
    v16 = vec16(ctx, q)
    if mode == "prefill":
        return _prefill(ctx, q, out, heads, hd, common, cache)
    if mode == TAIL:
        return _tail(ctx, q, out, heads, hd, common, cache)
    t = ctx.tune("attention_decode")
    # the direct kernel's warps in the split kernel too: a row below split then sums its keys in the
    # same order in either kernel (attention_combine passes a lone split's partial through), so a
    # verify or batch row gets the bits the same row decoded alone does, whichever of the two it takes
    warps = kc.attention_warps(t.get("direct_warps") or kc.DECODE_WARPS, heads // kvh, hd)
    if mode in ("short", VSHORT):
        # direct: one block per (row, kv head) covers the whole key range, no combine; the rope
        # before this op may be folded in (the rope unit set rope_fused); in a verify pass's
        # (VSHORT) each block then also writes the keys of its sequence's earlier rows (vfresh)
        rope, rope_args = ctx.rope_fused.get(layer, ({}, ()))
        if rope and mode == VSHORT:
            rope = {**rope, "vfresh": kc.VERIFY_FRESH_MAX}
        qsplit = kc.direct_qsplit(heads // kvh, ctx.profile.tuning)
        spec = ctx.spec(
            "attention",
            split=t["split_kv_tokens"],  # one staged table chunk
            direct=True,
            warps=warps,
            vec16=v16,
            qsplit=qsplit,
            **common,
            **rope,
            table_first=table_first,
            trigger=False,  # (trigger_short1 sets it at batch 1)
        )
        args = (val(out), NULL, NULL, val(q)) + cache + (Arg("const", 1, "i32"),) + rope_args
        return [Launch(spec, ("n", kvh, qsplit), (32 * warps,), args)]
    split = t["split_kv_tokens"]
    spec = ctx.spec(
        "attention",
        split=split,
        direct=False,
        warps=warps,
        vec16=v16,
        **common,
        table_first=table_first,
    )
    rows = ctx.max_rows
    ctx.need_scratch(ScratchPlan("attn_o", per_split=rows * heads * hd * 4, split=split))
    ctx.need_scratch(ScratchPlan("attn_ml", per_split=rows * heads * 2 * 4, split=split))
    splits = Arg("shape", f"splits:{split}", "i32")
    part = (Arg("scratch", "attn_o"), Arg("scratch", "attn_ml"))
    args = (NULL,) + part + (val(q),) + cache + (splits,)
    grid = ("n", kvh, f"(max_ctx + {split - 1}) // {split}")
    comb = ctx.spec("attention_combine", heads=heads, head_dim=hd, split=split, out_stride=out.ld, window=window)
    cargs = (val(out),) + part + (Arg("input", "positions"), splits)
    return [Launch(spec, grid, (32 * warps,), args), Launch(comb, ("n", heads), (hd,), cargs)]


def _prefill(ctx, q: Value, out: Value, heads: int, hd: int, common: dict, cache: tuple) -> list[Launch]:
    """Flash attention on tensor cores, varlen: grid (q tiles, heads, sequences of the pass). With
    the tuning's ``span`` (the key split, docs/kernels.md): passes of more than ``split_rows`` rows
    fold each row's spans in one block; shorter ones (a prefix hit's tail at depth) run a block per
    (q tile, head, sequence, span) writing partials, and attention_combine folds them in the same
    order: the same bits for a row either way, so warm equals cold."""
    pt = ctx.tune("attention_prefill")
    bq, pw = kc.PREFILL_BLOCK_Q, kc.PREFILL_WARPS
    bkv = kc.prefill_block_kv(bq, pt["block_kv"], hd)
    span = int(pt.get("span") or 0)
    spec = ctx.spec("attention_prefill", block_q=bq, block_kv=bkv, warps=pw, span=span, **common)
    args = (val(out), val(q)) + cache[:4] + (Arg("input", "seq_starts"), cache[4])
    grid = (f"(max_q + {bq - 1}) // {bq}", heads, "nseq")
    smem = kc.attention_prefill_smem(spec.params)
    if not span:
        return [Launch(spec, grid, (32 * pw,), args, smem)]
    rows = int(pt["split_rows"])
    pspec, pgx, pgy, pthreads = _span_partial(ctx, hd, common, "max_q")
    part, splits, comb = _span_scratch(ctx, out, heads, hd, common["window"])
    pgrid = (pgx, pgy, f"nseq * ((max_ctx + {span - 1}) // {span})")
    return [
        Launch(spec, grid, (32 * pw,), args, smem, min_rows=rows + 1),
        Launch(pspec, pgrid, (pthreads,), args + part + (splits,), kc.attention_prefill_smem(pspec.params), max_rows=rows),
        comb,
    ]


def _span_partial(ctx, hd: int, common: dict, rows_expr: str, **extra) -> tuple:
    """The key split's partial launch (a block per (query tile, head, sequence, span), or with the
    tuning's ``split_gqa`` a block per kv head where the group fits): (spec, grid x, grid y, threads)
    for a pass whose sequences have at most ``rows_expr`` rows."""
    pt = ctx.tune("attention_prefill")
    bq, pw = kc.PREFILL_BLOCK_Q, kc.PREFILL_WARPS
    bkv = kc.prefill_block_kv(bq, pt["block_kv"], hd)
    span = int(pt["span"])
    heads, kvh = common["heads"], common["kv_heads"]
    group = heads // kvh
    gq = dict(block_q=16 * group, block_kv=bkv, warps=group, span=span, partial=True, gqa=True, **extra)
    if pt["split_gqa"] and group <= 8 and kc.attention_prefill_smem({**gq, "head_dim": hd}) <= 99 * 1024:
        # a block per kv head, its warps the group's query heads over 16 rows: K/V loaded once per group
        return ctx.spec("attention_prefill", **gq, **common), f"({rows_expr} + 15) // 16", kvh, 32 * group
    spec = ctx.spec("attention_prefill", block_q=bq, block_kv=bkv, warps=pw, span=span, partial=True, **extra, **common)
    return spec, f"({rows_expr} + {bq - 1}) // {bq}", heads, 32 * pw


def _span_scratch(ctx, out: Value, heads: int, hd: int, window: int) -> tuple[tuple[Arg, ...], Arg, Launch]:
    """The partials' scratch (``split_rows`` rows), the splits argument and the fold's launch."""
    pt = ctx.tune("attention_prefill")
    span, rows = int(pt["span"]), int(pt["split_rows"])
    ctx.need_scratch(ScratchPlan("pattn_o", per_split=rows * heads * hd * 4, split=span))
    ctx.need_scratch(ScratchPlan("pattn_ml", per_split=rows * heads * 2 * 4, split=span))
    part = (Arg("scratch", "pattn_o"), Arg("scratch", "pattn_ml"))
    splits = Arg("shape", f"splits:{span}", "i32")
    comb = ctx.spec("attention_combine", heads=heads, head_dim=hd, split=span, out_stride=out.ld, window=window, fold=True)
    cargs = (val(out),) + part + (Arg("input", "positions"), splits)
    return part, splits, Launch(comb, ("n", heads), (hd,), cargs, max_rows=rows)


def _tail(ctx, q: Value, out: Value, heads: int, hd: int, common: dict, cache: tuple) -> list[Launch]:
    """TAIL: a prompt tail's decode pass past short_context (engine.runner_tail) through the key
    split's partial launch + the fold, as a prefix hit's tail prefill runs them: a sequence's K/V
    read once per span for all of its rows (the decode kernel reads them once a row). The pass is
    a decode pass: block tables one per row (``row_tables``: a sequence reads its first row's),
    ``seq_starts`` filled by the runner (engine.runner_steps ``_fill_seq_starts``), a grid over the
    ``n`` rows as ``nseq`` sequences (a TAIL pass binds min(n, engine.ir.TAIL_SEQS); empty ones
    exit). At most ``split_rows`` rows (the partials' scratch): the runner packs tail passes up to
    that (``max_rows``)."""
    rows = int(ctx.tune("attention_prefill")["split_rows"])
    pspec, pgx, pgy, threads = _span_partial(ctx, hd, common, "n", row_tables=True)
    part, splits, comb = _span_scratch(ctx, out, heads, hd, common["window"])
    span = pspec.params["span"]
    args = (val(out), val(q)) + cache[:4] + (Arg("input", "seq_starts"), cache[4]) + part + (splits,)
    grid = (pgx, pgy, f"nseq * ((max_ctx + {span - 1}) // {span})")
    return [Launch(pspec, grid, (threads,), args, kc.attention_prefill_smem(pspec.params), max_rows=rows), comb]


@post_pass(25)
def tail_attention(ctx, steps: list[Step], weights: Mapping[str, WeightPlan], values: Mapping[str, Value]) -> None:
    """A dense plan (no recurrent state) with the prefill key split (attention_prefill.span) gets
    each attention step's TAIL launches (``_tail``): a prompt tail's pass past short_context
    (engine.runner_tail) runs them instead of the split decode attention. A hybrid's tails keep the
    decode launches (its stateful launches run a row at a time, engine.runner_tail)."""
    if ctx.states or not int(ctx.tune("attention_prefill").get("span") or 0):
        return
    for st in steps:
        if st.op.op != "attention":
            continue
        ins = [values[n] for n in st.op.inputs if n in values]
        st.launches[TAIL] = tuple(lower(ctx, st.op, st.layer, TAIL, ins, [values[st.op.outputs[0]]], []))


@post_pass(20)
def trigger_short1(ctx, steps: list[Step], weights: Mapping[str, WeightPlan], values: Mapping[str, Value]) -> None:
    """Tuning attention_decode.trigger_b1: each attention step whose short-context launch is
    the direct kernel gets a SHORT1 launch, the same kernel with ``trigger`` (pdl_trigger() at
    its start, so the o GEMV's blocks launch beside it and fetch their weights early); the
    other batch sizes keep the launch without it. Not outside the o window (o_window)."""
    if not ctx.tune("attention_decode").get("trigger_b1"):
        return
    for i, st in enumerate(steps):
        short = st.launches.get("short", ())
        if st.op.op != "attention" or len(short) != 1:
            continue
        if not ctx.o_window(steps, i, weights):
            continue
        la = short[0]
        if not la.spec.params.get("direct") or la.spec.params.get("trigger"):
            continue
        spec = ctx.spec("attention", **{**la.spec.params, "trigger": True})
        st.launches[SHORT1] = (dataclasses.replace(la, spec=spec),)
