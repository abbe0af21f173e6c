"""engine.lowering: every op of every model family has a registered lowering unit, build_plan
dispatches through the registry (a replaced unit is what runs), an op cannot be lowered twice, an
op attribute no unit implements is rejected instead of lowered as if absent, and Gemma 3's attributes
(embed scale, norm offset, rope theta/scaling, attention window/scale) all lower."""

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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
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


def test_units_declare_only_attributes_their_op_has():
    for op, unit in LOWERINGS.items():
        assert unit.attrs <= set(OPS[op].attrs), op
    assert LOWERINGS["rope"].attrs == {"freq_factors", "theta", "scaling"}
    assert LOWERINGS["attention"].attrs == {"window", "scale"}
    assert lowering_for("linear", {"residual": "x"}) is LOWERINGS["linear"]


def test_an_attribute_without_a_lowering_is_rejected(monkeypatch):
    unit = LOWERINGS["attention"]
    monkeypatch.setitem(LOWERINGS, "attention", dataclasses.replace(unit, attrs=frozenset({"scale"})))
    assert "window" in OPS["attention"].attrs  # the reference implements it
    with pytest.raises(ConfigError, match=r"plan: no CUDA lowering for attribute 'window' of op 'attention'"):
        lowering_for("attention", {"window": "some_dim"})


def test_a_gemma3_plan_lowers_every_attribute():
    """Gemma 3's ops and attributes all lower: the embed scale, the norm offsets (in the uploaded
    norm weights), each layer type's RoPE base, the window and scale of the attention kernels."""
    g = load_family("gemma3")
    hf = {
        "hidden_size": 256, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 512, "vocab_size": 1024, "sliding_window": 512,
        "query_pre_attn_scalar": 144, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
    }  # fmt: skip
    dims = resolve_dims(g, "hf", hf, "config.json")
    plan = build_plan(g, dims, g.quant("bf16"), get_profile("h200"))
    assert {w.offset for w in plan.weights if w.rows == 1} == {1.0}
    specs = [la.spec for st in plan.steps for las in st.launches.values() for la in las]
    windows = {(s.template, s.params["window"]) for s in specs if "window" in s.params}
    assert windows == {(t, w) for t in ("attention", "attention_prefill", "attention_combine") for w in (0, 512)}
    assert {s.params["scale"] for s in specs if s.template.startswith("attention") and "scale" in s.params} == {
        repr(144**-0.5)
    }
    assert {s.params["theta"] for s in specs if s.template == "rope" or s.params.get("rope")} == {"10000.0", "1000000.0"}
    assert {s.params["scale"] for s in specs if s.template == "embed"} >= {repr(256**0.5)}
    assert any(s.template == "silu_mul" and s.params["act"] == "gelu_tanh" for s in specs)
    assert any(s.template == "add" for s in specs)
    # each residual add but the last (before the head's final norm) folds into the rmsnorm after it
    steps = list(plan.steps)
    adds = [i for i, st in enumerate(steps) if st.op.op == "add"]
    for i in adds[:-1]:
        for mode in ("decode1", "decode", "prefill"):
            assert steps[i].launches[mode] == ()
            (norm,) = steps[i + 1].launches[mode]
            assert norm.spec.params["residual"] and norm.args[2].ref == "o" and norm.args[1].ref == "x"
    assert all(len(steps[adds[-1]].launches[m]) == 1 for m in ("decode1", "decode", "prefill"))
    by_layer = {st.layer: st for st in plan.steps if st.op.op == "attention"}
    assert by_layer[5].launches["prefill"][0].spec.params["window"] == 0  # the global layer
    assert by_layer[0].launches["prefill"][0].spec.params["window"] == 512


def test_a_window_on_any_familys_attention_lowers(tmp_path, monkeypatch):
    """The window is the attention op's, not Gemma's: a llama delta (Mistral-style `sliding_window`
    on every layer) lowers to windowed prefill, decode and combine launches, reading the window
    tables, and its rope writes through the window slots."""
    import shutil
    from pathlib import Path

    from engine import graph as graph_mod
    from engine import paths

    root = tmp_path / "models"
    shutil.copytree(Path(graph_mod.__file__).resolve().parent.parent / "models", root)
    (root / "mistral_swa.yaml").write_text(
        "family: mistral_swa\nextends: llama\n"
        "matches: {hf_architectures: [MistralForCausalLM], gguf_architectures: []}\n"
        "dims:\n  sliding_window: {hf: sliding_window, default: 0}\n"
        "hf_expect: {sliding_window: null}\n"
        "graph_edits:\n  - replace: {op: attention}\n"
        "    with: {op: attention, in: [q, k, v], out: a, window: sliding_window}\n"
    )
    monkeypatch.setattr(paths, "models_dir", lambda: root)
    g = load_family("mistral_swa")
    hf = {
        "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "intermediate_size": 1024, "vocab_size": 1000, "sliding_window": 4096,
    }  # fmt: skip
    plan = build_plan(g, resolve_dims(g, "hf", hf, "config.json"), g.quant("bf16"), get_profile("h200"))
    att = [la for st in plan.steps if st.op.op == "attention" for las in st.launches.values() for la in las]
    assert att and all(la.spec.params["window"] == 4096 for la in att)
    assert all(any(a.ref == "window_tables" for a in la.args) for la in att if la.spec.template != "attention_combine")
    rope = [la for st in plan.steps if st.op.op == "rope" for las in st.launches.values() for la in las]
    assert rope and all(any(a.ref == "window_slots" for a in la.args) for la in rope)
