"""The CUDA lowering registry rejects op attributes its units do not implement (Gemma's embed scale,
norm offset, rope theta/scaling, attention window/scale) instead of lowering the op without them."""

from __future__ import annotations

import pytest

from engine import graph
from engine.lowering.registry import LOWERINGS, lowering_for
from engine.model import resolve_dims
from engine.ops import OPS
from engine.plan import build_plan
from engine.profile import get_profile
from engine.types import ConfigError

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
    g = graph.load_family("gemma3")
    hf = {
        "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "intermediate_size": 512, "vocab_size": 1024,
    }  # fmt: skip
    dims = resolve_dims(g, "hf", hf, "config.json")
    with pytest.raises(ConfigError, match=r"plan: no CUDA lowering for attribute 'scale' of op 'embed'"):
        build_plan(g, dims, g.quant("bf16"), get_profile("h200"))
