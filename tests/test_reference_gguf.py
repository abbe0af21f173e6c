"""GGUF llama path of the ReferenceRunner: interleaved RoPE on permuted q/k and the rope_freqs tensor.

A tiny random HF Llama checkpoint is converted the way llama.cpp's converter does it (q/k rows
permuted, Llama-3 ``rope_scaling`` turned into a ``rope_freqs`` factor tensor) and written as an
f32 GGUF; both files must give the same logits. The HF side is itself checked against
transformers in test_reference_hf.py.
"""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
from fixtures.engine_probes import permute_for_interleaved
from safetensors.numpy import load_file
from test_reference import write_tiny_hf

from engine.model import load_model
from engine.reference import ReferenceRunner

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def llama_cpp_rope_factors(head_dim: int, theta: float, cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama-3 rope_freqs (restated here, independent of ops_ref)."""
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old = cfg["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_to_gguf(hf_dir, out_path, with_rope_freqs: bool) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(str(hf_dir / "model.safetensors"))
    n, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = gguf.GGUFWriter(str(out_path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    if with_rope_freqs:
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(hd, cfg["rope_theta"], cfg["rope_scaling"]))
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            a = t[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                a = permute_for_interleaved(a, n)
            elif hf == "self_attn.k_proj":
                a = permute_for_interleaved(a, kv)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("scaled", [False, True])
def test_gguf_llama_matches_hf_layout(tmp_path, scaled):
    hf_dir = write_tiny_hf(
        tmp_path / "hf", "llama", seed=5, rope_theta=500000.0, rope_scaling=LLAMA3 if scaled else None
    )
    path = tmp_path / "tiny.gguf"
    hf_to_gguf(hf_dir, path, with_rope_freqs=scaled)
    gm = load_model(path)
    assert gm.rope_style == "interleaved" and gm.has("rope_freqs") == scaled
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 128, 70)]
    hf = ReferenceRunner(load_model(hf_dir), num_blocks=8, max_model_len=128).forward_logits(ids)
    gg = ReferenceRunner(gm, num_blocks=8, max_model_len=128).forward_logits(ids)
    err = float(np.abs(gg - hf).max() / np.abs(hf).max())
    assert err < 1e-5, err
    if scaled:  # the factors matter at these positions: dropping them changes the logits
        unscaled = write_tiny_hf(tmp_path / "plain", "llama", seed=5, rope_theta=500000.0)
        plain = ReferenceRunner(load_model(unscaled), num_blocks=8, max_model_len=128).forward_logits(ids)
        assert float(np.abs(plain - hf).max() / np.abs(hf).max()) > 1e-3
