"""ReferenceRunner logits vs Hugging Face transformers on tiny random Qwen3/Llama checkpoints.

Runs only where torch and transformers import (test-only dependencies); the real-model
comparison without them is the committed golden file (test_reference_smollm2.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_reference import write_tiny_hf

from engine.model import load_model
from engine.reference import ReferenceRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [3, 77, 12, 12, 90, 5, 41, 127, 0, 66, 8, 19, 100, 54, 23, 31, 2, 9, 70, 44]


def hf_logits(path, token_ids) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=False).logits[0]
    return out.float().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "family,kwargs",
    [
        ("qwen3", {}),
        ("qwen3", {"tie": True, "heads": 4, "kv_heads": 1, "head_dim": 32}),  # head_dim != hidden/heads
        ("llama", {}),
        ("llama", {"tie": True, "kv_heads": 4}),
        (
            "llama",
            {
                "rope_theta": 500000.0,
                "context": 4096,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
    ],
)
def test_logits_match_transformers(tmp_path, family, kwargs):
    path = write_tiny_hf(tmp_path, family, seed=11, **kwargs)
    runner = ReferenceRunner(load_model(path), num_blocks=8, block_size=16, max_model_len=128)
    # positions far enough out that the llama3 scaling's low/medium/high bands all matter
    ids = PROMPT * 3
    ours = runner.forward_logits(ids)
    theirs = hf_logits(path, ids)
    assert ours.shape == theirs.shape
    err = rel_err(ours, theirs)
    assert err < 1e-4, f"{family} {kwargs}: max relative error {err:.2e}"


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_bf16_fixture_checkpoints_match_transformers(fixture, request):
    """The weights engineer's bf16 fixtures (tests/fixtures/checkpoints.py) through both stacks."""
    path = request.getfixturevalue(fixture)
    runner = ReferenceRunner(load_model(path), num_blocks=8, block_size=16, max_model_len=128)
    ids = [i % runner.vocab for i in PROMPT * 2]
    err = rel_err(runner.forward_logits(ids), hf_logits(path, ids))
    assert err < 1e-4, f"{fixture}: max relative error {err:.2e}"


def test_q8_0_gguf_fixture_matches_transformers_gguf(tiny_llama_gguf):
    """GGUF q8_0 llama: our dequant + interleaved RoPE vs transformers' GGUF loader (un-permutes q/k)."""
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    runner = ReferenceRunner(load_model(tiny_llama_gguf), num_blocks=8, block_size=16, max_model_len=128)
    ids = [i % runner.vocab for i in PROMPT * 2]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_gguf.parent), gguf_file=tiny_llama_gguf.name, dtype=torch.float32
    )
    with torch.no_grad():
        theirs = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    err = rel_err(runner.forward_logits(ids), theirs)
    assert err < 1e-4, f"max relative error {err:.2e}"
