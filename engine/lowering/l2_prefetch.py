"""Lowering post-passes that add L2 prefetch ranges to a lowered plan's batch-1 launches (tuning
attention_decode.l2_prefetch_o and decode_graph.o_prefetch_next_kb, inside the o window:
docs/kernels.md, "The o window" and the ``l2_pf`` option before it). Each pass sets a kernel's
``l2_pf`` param (kernel_catalog.l2_pf_ranges) and appends the weights it names to the launch's
args as pointer args pf0, pf1 ... Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from engine.ir import SHORT1, Step, Value, WeightPlan, wgt
from engine.lowering.context import linears_after, weight_of
from engine.lowering.registry import post_pass
from engine.storage import row_bytes


@post_pass(30)
def short1_attention(ctx, steps: list[Step], weights: Mapping[str, WeightPlan], values: Mapping[str, Value]) -> None:
    """Tuning attention_decode.l2_prefetch_o: each attention step whose batch-1 short-context
    launch is the direct kernel (SHORT1 where it has one, else a new SHORT1 from its short
    launch) gets an ``l2_pf`` range over the whole weight of the layer's next linear (the o
    projection), appended as pointer arg pf0. Other batch sizes keep theirs."""
    t = ctx.tune("attention_decode")
    if not t.get("l2_prefetch_o"):
        return
    for i, st in enumerate(steps):
        cur = st.launches.get(SHORT1, st.launches.get("short", ()))
        if st.op.op != "attention" or len(cur) != 1 or not cur[0].spec.params.get("direct"):
            continue
        if not ctx.o_window(steps, i, weights):
            continue
        later = linears_after(steps, i)
        targets: list[tuple[WeightPlan, list[tuple[int, int]]]] = []
        o = weight_of(later[0], weights) if later else None
        if o is not None:
            targets.append((o, [(0, o.nbytes)]))
        ranges = _l2_pf_ranges(targets)
        if not ranges:
            continue
        la = cur[0]
        spec = ctx.spec("attention", **{**la.spec.params, "l2_pf": ranges})
        args = la.args + tuple(wgt(w) for w, _ in targets)
        st.launches[SHORT1] = (dataclasses.replace(la, spec=spec, args=args),)


@post_pass(40)
def o_gemv(ctx, steps: list[Step], weights: Mapping[str, WeightPlan], values: Mapping[str, Value]) -> None:
    """Tuning decode_graph.o_prefetch_next_kb: the batch-1 GEMV of each layer's o projection
    (the linear after the attention; a batch-1 q8x coop GEMV) prefetches the first KB of the
    linear after it (gate|up, in its tiles' order: _first_bytes) into L2 once its own tile has
    landed, so they stream while it computes from shared memory (``l2_pf`` on its decode1
    launch, the weight appended as pointer arg pf0)."""
    kb = int(ctx.graph_value("o_prefetch_next_kb") or 0)
    if not kb:
        return
    for i, st in enumerate(steps):
        if st.op.op != "attention" or not ctx.o_window(steps, i, weights):
            continue
        later = linears_after(steps, i)
        o = later[0].launches.get("decode1", ()) if later else ()
        if len(later) < 2 or len(o) != 1 or o[0].spec.template != "gemv" or not o[0].spec.params.get("q8x"):
            continue
        first = _first_bytes(later[1], weights, kb * 1024)
        if first is None:
            continue
        la = o[0]
        spec = ctx.spec("gemv", **{**la.spec.params, "l2_pf": _l2_pf_ranges([first])})
        later[0].launches["decode1"] = (dataclasses.replace(la, spec=spec, args=la.args + (wgt(first[0]),)),)


def _first_bytes(
    step: Step, weights: Mapping[str, WeightPlan], nbytes: int
) -> tuple[WeightPlan, list[tuple[int, int]]] | None:
    """The first ``nbytes`` of a linear step's matrix in the order its batch-1 GEMV reads its
    row tiles (_spans), as (weight, [(offset, bytes)]). None where the step is not one gemv."""
    w = weight_of(step, weights)
    if w is None:
        return None
    glu = next((la.spec.params.get("glu", 0) for la in step.launches.get("decode1", ())), 0)
    return w, _spans(w, glu, 0, min(nbytes, w.nbytes))


def _spans(w: WeightPlan, glu: int, a: int, b: int) -> list[tuple[int, int]]:
    """Bytes [a, b) of matrix ``w`` in the order its batch-1 GEMV reads them, as (offset, bytes)
    spans: a glu gate|up (``glu`` gate rows, as many up rows after them) reads its gate and up
    halves side by side (tile t: gate rows t * RPB / 2 .., the up rows as far past the gate's
    first), so their offset x is byte x / 2 of each half; any other matrix in row order."""
    if glu and w.rows == 2 * glu:
        half = glu * row_bytes(w.dtype, w.cols)
        return [(a // 2, (b - a) // 2), (half + a // 2, (b - a) // 2)]
    return [(a, b - a)]


def _l2_pf_ranges(targets: list[tuple[WeightPlan, list[tuple[int, int]]]]) -> str:
    """An ``l2_pf`` param (kernel_catalog.l2_pf_ranges) over ``targets``: weight a's spans as
    "a:OFF:BYTES" items, the bytes cut to a multiple of 16, spans at an unaligned offset or under
    16 bytes left out."""
    return ",".join(
        f"{a}:{off}:{n // 16 * 16}" for a, (_, spans) in enumerate(targets) for off, n in spans if off % 16 == 0 and n >= 16
    )
