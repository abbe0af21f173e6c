"""engine.lowering: every op of every model family has a registered lowering unit, build_plan
dispatches through the registry (a replaced unit is what runs), and an op cannot be lowered twice."""

from __future__ import annotations

import dataclasses

import pytest

from engine.graph import load_family
from engine.lowering.registry import LOWERINGS, POST_PASSES, register
from engine.model import dims_for_size
from engine.plan import build_plan
from engine.profile import get_profile


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_op_of_every_family_has_a_lowering_unit(family):
    graph = load_family(family)
    ops = {op.op for op, _ in graph.ops()}
    assert ops <= set(LOWERINGS), ops - set(LOWERINGS)
    for op in ops:  # registered by the YAML op name, in its own module of engine.lowering
        assert LOWERINGS[op].lower.__module__.startswith("engine.lowering.")
    assert [order for order, _ in POST_PASSES] == sorted(order for order, _ in POST_PASSES)


def test_build_plan_dispatches_through_the_registry(monkeypatch):
    calls = []
    unit = LOWERINGS["silu_mul"]

    def spy(ctx, op, layer, mode, ins, outs, ws):
        calls.append(mode)
        return unit.lower(ctx, op, layer, mode, ins, outs, ws)

    monkeypatch.setitem(LOWERINGS, "silu_mul", dataclasses.replace(unit, lower=spy))
    graph = load_family("llama")
    dims = dims_for_size("llama", "smollm2-135m")
    build_plan(graph, dims, graph.quant("bf16"), get_profile("generic-sm80"))
    layers = dims["layers"]
    # decode1, decode, prefill, and the wide decode buckets (bf16: silu_mul materialised as in prefill)
    assert sorted(set(calls)) == ["decode", "decode1", "prefill"] and len(calls) == 4 * layers


def test_an_op_is_lowered_once():
    with pytest.raises(ValueError, match="lowered twice"):
        register("rope", bind=lambda *a: [])(lambda *a: [])
