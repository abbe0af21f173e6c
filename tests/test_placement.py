"""engine.placement: PP layer ranges balanced by bytes, TP shards and their bytes, the K/V head
rules, quantised-block alignment, and the one-line errors (no fit, no rule, bad --devices)."""

from __future__ import annotations

import pytest

from engine.graph import load_family
from engine.model import dims_for_size
from engine.placement import even_bounds, parse_devices, plan_placement
from engine.types import MemraError
from engine.weight_memory import GIB, weight_bytes


def _model(family, size):
    g = load_family(family)
    return g, dims_for_size(family, size)


def test_pp_ranges_are_contiguous_balanced_and_sum_to_the_model():
    g, d = _model("qwen3", "qwen3-8b")
    combo = g.quant("bf16")
    pl = plan_placement(g, d, "pp", [0, 1], combo, kv_tokens=0)
    layers = [i for p in pl.parts for i in p.layers]
    assert layers == list(range(36))
    assert pl.parts[0].embed and not pl.parts[0].head and pl.parts[1].head and not pl.parts[1].embed
    assert sum(p.weight_bytes for p in pl.parts) == weight_bytes(g, d, combo).total  # untied: no copy
    a, b = (p.weight_bytes for p in pl.parts)
    per_layer = (weight_bytes(g, d, combo).total - 2 * 151936 * 4096 * 2) / 36
    assert abs(a - b) <= per_layer  # no better contiguous cut exists
    assert pl.parts[0].kv_bytes_per_token == 2 * len(pl.parts[0].layers) * 8 * 128 * 2


def test_pp_weighs_kv_into_the_balance_and_copies_a_tied_head():
    g, d = _model("qwen3", "qwen3-0.6b")  # tied head: the last device needs the table too
    combo = g.quant("bf16")
    plain = plan_placement(g, d, "pp", [0, 1], combo, kv_tokens=0)
    assert sum(p.weight_bytes for p in plain.parts) == weight_bytes(g, d, combo).total + 151936 * 1024 * 2
    assert len(plan_placement(g, d, "pp", [0, 1, 2, 3], combo, kv_tokens=10**6).parts[1].layers) >= 7


def test_tp_shards_heads_columns_and_vocab():
    g, d = _model("qwen3", "qwen3-8b")
    combo = g.quant("bf16")
    pl = plan_placement(g, d, "tp", [0, 1], combo)
    assert pl.shard("wq", 1) == (0, 16 * 128, 32 * 128)
    assert pl.shard("wk", 0) == (0, 0, 4 * 128)
    assert pl.shard("wo", 1) == (1, 16 * 128, 32 * 128)
    assert pl.shard("w_down", 0) == (1, 0, 6144)
    assert pl.shard("lm_head", 1) == (0, 75968, 151936)
    assert pl.shard("attn_norm", 0) is None and pl.shard("embed", 1) is None
    total = weight_bytes(g, d, combo)
    replicated = total.embedding + total.vectors
    assert sum(p.weight_bytes for p in pl.parts) == total.total + replicated  # embed + norms on both
    assert pl.parts[0].kv_bytes_per_token == 2 * 36 * 4 * 128 * 2
    assert pl.reduces(("wo",)) and pl.reduces(("w_down",)) and not pl.reduces(("wq", "wk", "wv"))


def test_tp_moe_by_expert_or_by_column():
    g, d = _model("qwen3_moe", "qwen3-30b-a3b")
    ep = plan_placement(g, d, "tp", [0, 1], g.quant("bf16"))
    cols = plan_placement(g, d, "tp", [0, 1], g.quant("bf16"), moe="cols")
    assert ep.shard("exp_down", 1) == (0, 64, 128)
    assert cols.shard("exp_down", 1) == (2, 384, 768) and cols.shard("exp_gate", 0) == (1, 0, 384)
    assert ep.parts[0].weight_bytes == cols.parts[0].weight_bytes
    assert ep.shard("router", 0) is None


def test_kv_heads_replicated_or_refused():
    g, d = _model("qwen3_moe", "qwen3-30b-a3b")  # 32 heads, 4 K/V heads
    pl = plan_placement(g, d, "tp", list(range(8)), g.quant("bf16"))
    assert [pl.shard("wk", r) for r in (0, 1, 2, 7)] == [(0, 0, 128), (0, 0, 128), (0, 128, 256), (0, 384, 512)]
    assert pl.parts[0].kv_heads == 1
    d6 = dict(d, heads=24, kv_heads=4)
    with pytest.raises(MemraError, match="4 K/V heads; they must divide by 6, or 6 by them"):
        plan_placement(g, d6, "tp", list(range(6)), g.quant("bf16"))
    with pytest.raises(MemraError, match="heads = 32 is not divisible by 3"):
        plan_placement(g, d, "tp", [0, 1, 2], g.quant("bf16"))


def test_tp_refuses_a_split_inside_a_quant_block():
    g, d = _model("qwen3", "qwen3-0.6b")  # intermediate 3072 / 8 = 384: not whole q4_k blocks
    with pytest.raises(MemraError, match=r"w_down \(q4_k\) would be split at 384 of 3072 input columns"):
        plan_placement(g, d, "tp", list(range(8)), g.quant("q4_k_m"))
    plan_placement(g, d, "tp", list(range(8)), g.quant("q8_0"))  # 32-element blocks divide


def test_fit_error_names_the_device_and_bytes():
    g, d = _model("qwen3_moe", "qwen3-30b-a3b")
    pl = plan_placement(g, d, "pp", [2, 5], g.quant("bf16"), kv_tokens=4096)
    pl.check_fits([80 * GIB, 80 * GIB], kv_tokens=4096)
    with pytest.raises(MemraError, match=r"^device 5 \(rank 1 of pp-2\): needs .* GiB .* only 20.00 GiB free$") as e:
        pl.check_fits([80 * GIB, 20 * GIB], kv_tokens=4096)
    assert e.value.code == "out_of_memory"


def test_errors_for_bad_splits():
    g, d = _model("qwen3", "qwen3-0.6b")
    with pytest.raises(MemraError, match="needs at least 2 devices"):
        plan_placement(g, d, "tp", [0], g.quant("bf16"))
    with pytest.raises(MemraError, match="choose one of pp, tp"):
        plan_placement(g, d, "dp", [0, 1], g.quant("bf16"))
    with pytest.raises(MemraError, match="29 devices but the model has only 28 layers"):
        plan_placement(g, d, "pp", list(range(29)), g.quant("bf16"))
    g5, d5 = _model("qwen3_5", next(iter(load_family("qwen3_5").sizes)))
    with pytest.raises(MemraError, match="no tensor-parallel rule yet; use --split pp"):
        plan_placement(g5, d5, "tp", [0, 1], g5.quant("bf16"))


def test_parse_devices_and_even_bounds():
    assert parse_devices("0,1") == (0, 1) and parse_devices("3") == (3,)
    for bad in ("", "0,0", "a,1", "-1,0"):
        with pytest.raises(MemraError, match="--devices"):
            parse_devices(bad)
    assert even_bounds(10, 3) == ((0, 4), (4, 7), (7, 10))
