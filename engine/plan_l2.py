"""Plan post-passes that add L2 prefetch ranges to a lowered plan's batch-1 launches.

The knobs (docs/kernels.md, "attention option l2_pf"; the h200 profile turns on the attention's o
prefetch and the o GEMV's, inside the o window): attention_decode.l2_prefetch_*
(the direct attention prefetches its layer's o weight and the gate|up's first bytes),
decode_graph.o_prefetch_next_kb (the o GEMV prefetches the gate|up's first bytes), both only on
layers inside decode_graph.o_window_min_kb / o_window_max_kb (the adapter's o_window), and
decode_graph.l2_stream_kb (every plain batch-1 q8x GEMV keeps the pass's weight stream D bytes
ahead). Each pass sets a kernel's ``l2_pf`` param (kernel_catalog.l2_pf_ranges) and appends the
weights it names to the launch's args as pointer args pf0, pf1 ... ``ad`` is engine.plan's
catalog adapter (its catalog, profile tuning and spec builder). Kept apart from engine/plan.py so
that the experiment, if it never pays, leaves with one module. Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.plan import SHORT1, Step, WeightPlan, _w
from engine.quant import row_bytes


def apply(ad: Any, steps: list[Step], weights: Mapping[str, WeightPlan]) -> None:
    """Every pass the profile's tuning asks for, in order (the stream replaces the o GEMV's)."""
    short1_attention(ad, steps, weights)
    o_gemv(ad, steps, weights)
    stream(ad, steps, weights)


def short1_attention(ad: Any, steps: list[Step], weights: Mapping[str, WeightPlan]) -> None:
    """Tuning attention_decode.l2_prefetch_o / l2_prefetch_next_kb: each attention step whose
    batch-1 short-context launch is the direct kernel (SHORT1 where it has one, else a new
    SHORT1 from its short launch) gets ``l2_pf`` ranges: the whole weight of the layer's next
    linear (the o projection) and the first l2_prefetch_next_kb KB of the one after it, its
    gate rows and its up rows half each where its batch-1 GEMV is the glu layout (tile t reads
    gate rows t * RPB / 2 .. and the up rows as far past the gate's first, so the first tiles
    of both halves come first). The weights are appended as pointer args pf0, pf1. Other batch
    sizes, and steps whose SHORT1 is empty (the pair launch runs the attention), keep theirs."""
    t = ad.tune("attention_decode") if ad.cat is not None else {}
    want_o, next_kb = bool(t.get("l2_prefetch_o")), int(t.get("l2_prefetch_next_kb") or 0)
    if not (want_o or next_kb):
        return
    for i, st in enumerate(steps):
        cur = st.launches.get(SHORT1, st.launches.get("short", ()))
        if st.op.op != "attention" or len(cur) != 1 or not cur[0].spec.params.get("direct"):
            continue
        if not ad.o_window(steps, i, weights):
            continue
        later = [s for s in steps[i + 1 :] if s.layer == st.layer and s.op.op == "linear"]
        targets: list[tuple[WeightPlan, list[tuple[int, int]]]] = []
        if want_o and later:
            o = _weight_of(ad, later[0], weights)
            if o is not None:
                targets.append((o, [(0, o.nbytes)]))
        if next_kb and len(later) > 1:
            first = _first_bytes(ad, later[1], weights, next_kb * 1024)
            if first is not None:
                targets.append(first)
        ranges = _l2_pf_ranges(targets)
        if not ranges:
            continue
        la = cur[0]
        params = {
            **la.spec.params,
            "l2_pf": ranges,
            "l2_pf_lines": bool(t.get("l2_prefetch_lines")),
            "l2_pf_late": bool(t.get("l2_prefetch_late")) and bool(la.spec.params.get("vec16")),
            "l2_pf_keep": bool(t.get("l2_prefetch_keep")),
        }
        spec = ad._spec("attention", {}, **params)
        args = la.args + tuple(_w(w) for w, _ in targets)
        st.launches[SHORT1] = (dataclasses.replace(la, spec=spec, args=args),)


def o_gemv(ad: Any, steps: list[Step], weights: Mapping[str, WeightPlan]) -> None:
    """Tuning decode_graph.o_prefetch_next_kb: the batch-1 GEMV of each layer's o projection
    (the linear after the attention; a batch-1 q8x coop GEMV) prefetches the first KB of the
    linear after it (gate|up, in its tiles' order: _first_bytes) into L2 once its own tile has
    landed, so they stream while it computes from shared memory (``l2_pf`` on its decode1
    launch, the weight appended as pointer arg pf0)."""
    kb = int(ad._graph_value("o_prefetch_next_kb") or 0)
    if not kb or ad.cat is None or ad._graph_value("l2_stream_kb"):
        return
    for i, st in enumerate(steps):
        if st.op.op != "attention" or not ad.o_window(steps, i, weights):
            continue
        later = [s for s in steps[i + 1 :] if s.layer == st.layer and s.op.op == "linear"]
        o = later[0].launches.get("decode1", ()) if later else ()
        if len(later) < 2 or len(o) != 1 or o[0].spec.template != "gemv" or not o[0].spec.params.get("q8x"):
            continue
        first = _first_bytes(ad, later[1], weights, kb * 1024)
        if first is None:
            continue
        la = o[0]
        spec = ad._spec("gemv", {}, **{**la.spec.params, "l2_pf": _l2_pf_ranges([first])})
        later[0].launches["decode1"] = (dataclasses.replace(la, spec=spec, args=la.args + (_w(first[0]),)),)


def stream(ad: Any, steps: list[Step], weights: Mapping[str, WeightPlan]) -> None:
    """Tuning decode_graph.l2_stream_kb = D: the batch-1 pass's weights as one circular stream
    in the order its GEMVs read them (each layer's q|k|v, o, gate|up, down, then the lm_head,
    then the next step's first layer), kept D bytes ahead in L2. Each batch-1 q8x GEMV launch
    that can carry ``l2_pf`` (a plain gemv: not a pair, not another kernel) prefetches the
    stream from where the one before it stopped (at least its own end) to its own end + D, so
    the stream's bytes are each prefetched once, at most D ahead. Its own bytes are not among
    them, and they go out once its tile has landed or its x is staged
    (kernels/_gemv_coop.cuh.j2). A launch that cannot carry it leaves its share to the next one.
    The gate|up of the glu layout is read as its gate and up halves side by side
    (_spans), so a stream offset in it is two ranges. Replaces o_prefetch_next_kb."""
    d = int(ad._graph_value("l2_stream_kb") or 0) * 1024
    if not d or ad.cat is None:
        return
    # the stream: per decode1 GEMV launch (step i, launch j), the matrices it reads
    reads: list[tuple[int, int, list[tuple[WeightPlan, int]]]] = []  # (step, launch, [(w, glu)])
    for i, st in enumerate(steps):
        if st.op.op != "linear":
            continue
        for j, la in enumerate(st.launches.get("decode1", ())):
            named = dict(zip((n for n, _ in ad.cat.kernel_args(la.spec)), la.args, strict=True))
            ws = []
            for name, glu_key in (("w", "glu"), ("a_w", None), ("b_w", None)):
                a = named.get(name)
                if a is not None and a.kind == "weight" and a.ref in weights:
                    ws.append((weights[a.ref], int(la.spec.params.get(glu_key, 0)) if glu_key else 0))
            if ws:
                reads.append((i, j, ws))
    pieces: list[tuple[WeightPlan, int, int]] = []  # the stream in order: (weight, glu, bytes)
    ends: list[int] = []  # the stream offset where each launch's reads end
    for _, _, ws in reads:
        for w, glu in ws:
            pieces.append((w, glu, w.nbytes))
        ends.append(sum(n for _, _, n in pieces))
    total = ends[-1] if ends else 0
    if not total:
        return

    def ranges(lo: int, hi: int) -> list[tuple[WeightPlan, int, int]]:
        """Stream bytes [lo, hi) (mod total) as (weight, offset, bytes) ranges."""
        out, pos = [], 0
        for lap in (0, 1):  # [lo, hi) may wrap past the end once
            pos = lap * total
            for w, glu, n in pieces:
                a, b = max(lo, pos), min(hi, pos + n)
                if a < b:
                    out += [(w, off, size) for off, size in _spans(w, glu, a - pos, b - pos)]
                pos += n
        return out

    def assign(done: int) -> tuple[int, list[tuple[int, int, dict]]]:
        """Each capable launch's ranges, the prefetches reaching stream offset ``done`` before
        the first; and where they reach after the last."""
        out = []
        for (i, j, _), end in zip(reads, ends, strict=True):
            la = steps[i].launches["decode1"][j]
            lo, hi = max(end, done), end + min(d, total)
            p = la.spec.params
            if la.spec.template != "gemv" or not p.get("q8x") or p.get("bmax") != 1 or lo >= hi:
                continue
            targets: dict[str, tuple[WeightPlan, list[tuple[int, int]]]] = {}
            for w, off, n in ranges(lo, hi):
                targets.setdefault(w.key, (w, []))[1].append((off // 16 * 16, n))
            if len(targets) > getattr(ad.cat, "L2_PF_MAX_ARGS", 1):
                continue
            out.append((i, j, targets))
            done = hi
        return done, out

    # the last launches' prefetches wrap into the next step's first bytes: the first launches
    # start where those end (a second pass from there)
    reach, _ = assign(0)
    for i, j, targets in assign(reach - total)[1]:
        la = steps[i].launches["decode1"][j]
        pf = _l2_pf_ranges(list(targets.values()))
        if not pf:
            continue
        spec = ad._spec("gemv", {}, **{**la.spec.params, "l2_pf": pf})
        new = dataclasses.replace(la, spec=spec, args=la.args + tuple(_w(w) for w, _ in targets.values()))
        steps[i].launches["decode1"] = tuple(new if k == j else x for k, x in enumerate(steps[i].launches["decode1"]))


def _first_bytes(
    ad: Any, step: Step, weights: Mapping[str, WeightPlan], nbytes: int
) -> tuple[WeightPlan, list[tuple[int, int]]] | None:
    """The first ``nbytes`` of a linear step's matrix in the order its batch-1 GEMV reads its
    row tiles (_spans), as (weight, [(offset, bytes)]). None where the step is not one gemv."""
    w = _weight_of(ad, step, weights)
    if w is None:
        return None
    glu = next((la.spec.params.get("glu", 0) for la in step.launches.get("decode1", ())), 0)
    return w, _spans(w, glu, 0, min(nbytes, w.nbytes))


def _spans(w: WeightPlan, glu: int, a: int, b: int) -> list[tuple[int, int]]:
    """Bytes [a, b) of matrix ``w`` in the order its batch-1 GEMV reads them, as (offset, bytes)
    spans: a glu gate|up (``glu`` gate rows, as many up rows after them) reads its gate and up
    halves side by side (tile t: gate rows t * RPB / 2 .., the up rows as far past the gate's
    first), so stream offset x is byte x / 2 of each half; any other matrix in row order."""
    if glu and w.rows == 2 * glu:
        half = glu * row_bytes(w.dtype, w.cols)
        return [(a // 2, (b - a) // 2), (half + a // 2, (b - a) // 2)]
    return [(a, b - a)]


def _weight_of(ad: Any, step: Step, weights: Mapping[str, WeightPlan]) -> WeightPlan | None:
    """The matrix a linear step's batch-1 GEMV reads (its arg ``w``; None where the step is not
    one gemv launch, as a q4_k_m q|k beside its v)."""
    launches = step.launches.get("decode1", ())
    if len(launches) != 1 or launches[0].spec.template != "gemv":
        return None
    named = dict(zip((n for n, _ in ad.cat.kernel_args(launches[0].spec)), launches[0].args, strict=True))
    w = named.get("w")
    return weights.get(w.ref) if w is not None and w.kind == "weight" else None


def _l2_pf_ranges(targets: list[tuple[WeightPlan, list[tuple[int, int]]]]) -> str:
    """An ``l2_pf`` param (kernel_catalog.l2_pf_ranges) over ``targets``: weight a's spans as
    "a:OFF:BYTES" items, the bytes cut to a multiple of 16, spans at an unaligned offset or under
    16 bytes left out."""
    return ",".join(
        f"{a}:{off}:{n // 16 * 16}" for a, (_, spans) in enumerate(targets) for off, n in spans if off % 16 == 0 and n >= 16
    )
