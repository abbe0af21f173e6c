"""engine.lowering: every op of every model family has a registered lowering unit, build_plan
dispatches through the registry (a replaced unit is what runs), an op cannot be lowered twice, and an
op attribute no unit implements (Gemma's embed scale, norm offset, rope theta/scaling, attention
window/scale) is rejected instead of lowered as if absent."""

from __future__ import annotations

import dataclasses

import pytest

from engine.graph import load_family
from engine.lowering.registry import LOWERINGS, POST_PASSES, lowering_for, register
from engine.model import dims_for_size, resolve_dims
from engine.ops import OPS
from engine.plan import build_plan
from engine.profile import get_profile
from engine.types import ConfigError


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


UNLOWERED = [
    ("embed", "scale"),
    ("rmsnorm", "offset"),
    ("head_rmsnorm", "offset"),
    ("rope", "theta"),
    ("rope", "scaling"),
    ("attention", "window"),
    ("attention", "scale"),
]


def test_units_declare_only_attributes_their_op_has():
    for op, unit in LOWERINGS.items():
        assert unit.attrs <= set(OPS[op].attrs), op
    assert LOWERINGS["linear"].attrs == {"residual"} and LOWERINGS["rope"].attrs == {"freq_factors"}
    assert lowering_for("linear", {"residual": "x"}) is LOWERINGS["linear"]


@pytest.mark.parametrize("op,attr", UNLOWERED)
def test_an_attribute_without_a_lowering_is_rejected(op, attr):
    assert attr in OPS[op].attrs  # the reference implements it
    with pytest.raises(ConfigError, match=rf"plan: no CUDA lowering for attribute '{attr}' of op '{op}'"):
        lowering_for(op, {attr: "some_dim"})


def test_a_gemma3_plan_fails_on_its_first_unlowered_attribute():
    g = load_family("gemma3")
    hf = {
        "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "intermediate_size": 512, "vocab_size": 1024,
    }  # fmt: skip
    dims = resolve_dims(g, "hf", hf, "config.json")
    with pytest.raises(ConfigError, match=r"plan: no CUDA lowering for attribute 'scale' of op 'embed'"):
        build_plan(g, dims, g.quant("bf16"), get_profile("h200"))
