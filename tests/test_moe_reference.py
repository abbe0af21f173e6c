"""Qwen3-MoE on the numpy reference: logits vs transformers' Qwen3MoeForCausalLM, GGUF = safetensors.

The transformers comparisons build a tiny random Qwen3MoeConfig, save it with the installed
transformers (its config.json says ``num_local_experts`` and ``rope_parameters``; its tensors are
per-expert ``mlp.experts.{e}.*_proj``) and compare f32 logits (bound 1e-4 relative), prefill and
token-by-token decode through the paged cache, over a layer mix of dense and sparse MLPs. They
run only where torch and transformers import; the GGUF tests need neither.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures.checkpoints import write_qwen3_moe_gguf, write_qwen3_moe_safetensors
from fixtures.engine_probes import run_logits

from engine import quant
from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.types import SamplingParams, StepItem

PROMPT = [3, 77, 12, 12, 90, 5, 41, 127, 0, 66, 8, 19, 100, 54, 23, 31, 2, 9, 70, 44]
MIXED = dict(num_hidden_layers=3, mlp_only_layers=(1,))  # sparse, dense, sparse


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _runner(path) -> ReferenceRunner:
    return ReferenceRunner(load_model(path), num_blocks=8, block_size=4, max_model_len=64)


def _save_transformers_moe(directory, **over):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[2],
        decoder_sparse_step=1,
        max_position_embeddings=256,
        initializer_range=0.1,  # routing well away from ties; activations of order 1
    )
    cfg.update(over)
    torch.manual_seed(7)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).float().eval()
    model.save_pretrained(directory)
    return model


def _hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


@pytest.mark.parametrize(
    "over",
    [
        {},  # layers: sparse, sparse, dense (mlp_only_layers), sparse
        {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2},  # dense, sparse, dense, sparse
    ],
)
def test_prefill_and_decode_match_transformers(tmp_path, over):
    model = _save_transformers_moe(tmp_path, **over)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in saved and "rope_parameters" in saved  # the transformers 5 form
    loaded = load_model(tmp_path)
    assert loaded.graph.family == "qwen3_moe"
    assert loaded.dims["experts"] == 8 and loaded.dims["experts_used"] == 3
    runner = ReferenceRunner(loaded, num_blocks=16, block_size=4, max_model_len=64)
    sparse = [op.op for op, lay in runner._schedule if op.op in ("moe_experts", "silu_mul")]
    expect = ["moe_experts" if loaded.graph.op_runs(op, loaded.dims, i) else "silu_mul"
              for i in range(4) for op, _ in loaded.graph.ops() if op.op == "moe_experts"]
    assert sparse == expect and "silu_mul" in sparse and "moe_experts" in sparse
    ids = PROMPT * 2
    theirs = _hf_logits(model, ids)
    err = rel_err(runner.forward_logits(ids), theirs)
    assert err < 1e-4, f"prefill: max relative error {err:.2e}"
    # prefill 7 tokens, then decode one token per step through the paged cache
    table = list(range(16))
    sp = SamplingParams(temperature=0.0)
    rows = [run_logits(runner, StepItem(1, ids[:7], 0, table, True, sp))]
    for pos in range(7, len(ids)):
        rows.append(run_logits(runner, StepItem(1, [ids[pos]], pos, table, True, sp)))
    err = rel_err(np.concatenate(rows), theirs)
    assert err < 1e-4, f"decode: max relative error {err:.2e}"


def test_bf16_fixture_matches_transformers(tmp_path):
    """The fixture writer's per-expert bf16 checkpoint (config says num_experts, as published)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = write_qwen3_moe_safetensors(tmp_path, seed=3, **MIXED)
    runner = _runner(path)
    ids = [i % runner.vocab for i in PROMPT]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    err = rel_err(runner.forward_logits(ids), _hf_logits(model, ids))
    assert err < 1e-4, f"max relative error {err:.2e}"


def test_gguf_loads_to_the_same_logits_as_safetensors(tmp_path):
    st = write_qwen3_moe_safetensors(tmp_path / "st", seed=5, **MIXED)
    gg = write_qwen3_moe_gguf(tmp_path / "m.bf16.gguf", quant="bf16", seed=5, **MIXED)
    a, b = load_model(st), load_model(gg)
    assert (a.quant.name, b.quant.name) == ("bf16", "bf16")
    for key in ("experts", "experts_used", "moe_intermediate", "norm_topk_prob", "mlp_only_layers"):
        assert a.dims[key] == b.dims[key], key
    assert b.info("exp_down", 0).shape == (4, 64, 32) == a.info("exp_down", 0).shape
    assert b.info("router", 2).dtype == "f32"  # as llama.cpp writes it
    ids = [i % 300 for i in PROMPT]
    err = rel_err(_runner(gg).forward_logits(ids), _runner(st).forward_logits(ids))
    assert err < 1e-5, f"max relative error {err:.2e}"


def test_q8_0_gguf_experts_are_the_quantised_stack(tmp_path):
    st = load_model(write_qwen3_moe_safetensors(tmp_path / "st", seed=5, **MIXED))
    gg = load_model(write_qwen3_moe_gguf(tmp_path / "m.q8_0.gguf", quant="q8_0", seed=5, **MIXED))
    assert gg.quant.name == "q8_0" and gg.tensor_dtypes["exp_gate"] == "q8_0"
    assert gg.tensor_dtypes["router"] == "f32"
    for key in ("exp_gate", "exp_up", "exp_down"):
        for layer in (0, 2):
            ref = st.dequantize(key, layer)
            want = quant.dequantize(quant.quantize_reference(ref, "q8_0"), "q8_0", ref.shape)
            np.testing.assert_array_equal(gg.dequantize(key, layer), want)
    assert not gg.has("exp_gate", 1) and gg.has("w_gate", 1)
    logits = ReferenceRunner(gg, num_blocks=4, block_size=4, max_model_len=16).forward_logits([5, 6, 7])
    assert np.isfinite(logits).all()
