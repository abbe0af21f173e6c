"""The MoE hybrids (Qwen3.5-MoE / Qwen3.6-35B-A3B, Qwen3-Next) on the numpy reference against
transformers on tiny random checkpoints it saves: prefill and chunked prefill + decode through a
state slot (f32 rel err < 1e-4), and the published VL checkpoint form."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.engine_probes import run_logits
from fixtures.hybrid import randomize_torch_hybrid

from engine.types import SamplingParams, StepItem

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, full_attention_interval=2,
    max_position_embeddings=512,
)


def _random(model, seed):
    torch.manual_seed(seed)
    randomize_torch_hybrid(model)
    return model.float().eval()


@pytest.mark.parametrize(
    "cls,config,extra",
    [
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", {}),
        ("Qwen3NextForCausalLM", "Qwen3NextConfig", {"intermediate_size": 96, "norm_topk_prob": True}),
    ],
)
def test_moe_hybrid_matches_transformers(tmp_path, cls, config, extra):
    cfg = getattr(transformers, config)(**BASE, **extra)
    _check(tmp_path, _random(getattr(transformers, cls)(cfg), 3))


def test_published_moe_vl_checkpoint_matches_transformers(tmp_path):
    """Qwen3.6-35B-A3B as published (Qwen3_5MoeForConditionalGeneration, model.language_model.*)."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=BASE, vision_config=vision)
    model = _random(transformers.Qwen3_5MoeForConditionalGeneration(cfg), 4)
    assert _check(tmp_path, model).graph.family == "qwen3_5_moe_vl"


def _check(tmp_path, model):
    from engine.model import load_model
    from engine.reference import ReferenceRunner

    model.save_pretrained(str(tmp_path / "ckpt"))
    runner = ReferenceRunner(load_model(tmp_path / "ckpt"), num_blocks=16, block_size=16, max_model_len=256,
                             state_slots=2)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 128, 60)]
    with torch.no_grad():
        full = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    ours = runner.forward_logits(ids)
    assert np.abs(ours - full).max() / np.abs(full).max() < 1e-4
    got, pos = [], 0
    for chunk in [ids[:40], *([t] for t in ids[40:])]:
        got.append(run_logits(runner, StepItem(0, chunk, pos, list(range(16)), False, SamplingParams(temperature=0),
                                              state_slot=1)))
        pos += len(chunk)
    assert np.abs(np.concatenate(got) - full).max() / np.abs(full).max() < 1e-4
    return runner.model
