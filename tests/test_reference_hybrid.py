"""The Qwen3.5 dense hybrid on the numpy reference: against transformers' Qwen3_5ForCausalLM on tiny
random checkpoints saved by the installed transformers (prefill, and chunked prefill + token-by-token
decode through state slots: f32 relative error < 1e-4), the llama.cpp-converted GGUF form against
the HF form, MTP tensors kept, and one-line errors for checkpoints that disagree with their config."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures.engine_probes import extra_tensors, run_logits
from fixtures.hybrid import qwen3_5_config, randomize_torch_hybrid, write_qwen3_5_gguf, write_qwen3_5_hf
from safetensors.numpy import load_file, save_file

from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.types import MemraError, SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _hf_model(path, seed, **cfg):
    """A random Qwen3_5ForCausalLM built and saved by the installed transformers (norms, A_log and
    dt_bias randomised too, so the zero-centred norms and the gates are exercised)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
    )
    base.update(cfg)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**base)).float().eval()
    randomize_torch_hybrid(model)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize(
    "cfg",
    [
        {},  # 3 linear + 1 full, v heads = 2 x k heads
        {"layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
         "linear_num_value_heads": 2, "partial_rotary_factor": 0.5},
    ],
)
def test_prefill_and_decode_match_transformers(tmp_path, cfg):
    torch = pytest.importorskip("torch")
    model = _hf_model(tmp_path, 7, **cfg)
    runner = ReferenceRunner(load_model(tmp_path), num_blocks=16, block_size=16, max_model_len=256, state_slots=2)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, 128, 72)]
    with torch.no_grad():
        full = model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    assert rel_err(runner.forward_logits(ids), full) < 1e-4
    # (the 72-token prefill above crosses the delta rule's 64-token chunk) chunked prefill (40 + 24
    # tokens) then token by token, through a state slot, vs HF's cache
    got, pos = [], 0
    for chunk in [ids[:40], ids[40:64], *([t] for t in ids[64:])]:
        item = StepItem(0, chunk, pos, list(range(16)), False, GREEDY, state_slot=1)
        got.append(run_logits(runner, item))
        pos += len(chunk)
    with torch.no_grad():
        cache = transformers_cache(model)
        rows = [model(torch.tensor([ids[:64]]), cache=cache, use_cache=True).logits[0]]
        rows += [model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0] for t in ids[64:]]
    assert rel_err(np.concatenate(got), torch.cat(rows).numpy()) < 1e-4


def transformers_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def test_gguf_form_equals_hf_form(tmp_path):
    """llama.cpp's qwen35 conversion (tiled v heads, -exp(A_log), norms + 1) runs the same model."""
    hf = ReferenceRunner(load_model(write_qwen3_5_hf(tmp_path / "hf", seed=3)), num_blocks=8, max_model_len=128)
    gg = ReferenceRunner(load_model(write_qwen3_5_gguf(tmp_path / "m.gguf", seed=3)), num_blocks=8, max_model_len=128)
    assert gg.model.dims["v_heads_tiled"] and not hf.model.dims["v_heads_tiled"]
    assert gg.model.dims["layer_types"] == hf.model.dims["layer_types"]
    ids = list(range(5, 70))
    assert rel_err(gg.forward_logits(ids), hf.forward_logits(ids)) < 1e-5


def test_mtp_weights_are_loaded_and_kept(tmp_path):
    path = write_qwen3_5_hf(tmp_path, seed=4, mtp_num_hidden_layers=1)
    runner = ReferenceRunner(load_model(path), num_blocks=8, max_model_len=64)
    kept = dict.fromkeys(extra_tensors(runner))
    assert ("mtp_fc", None) in kept and ("mtp_wq", 0) in kept and ("mtp_w_down", 0) in kept
    raw = load_file(str(path / "model.safetensors"))
    assert np.array_equal(runner.weight("mtp_fc", None), raw["mtp.fc.weight"])
    assert np.array_equal(runner.weight("mtp_final_norm", None), raw["mtp.norm.weight"] + 1.0)


def test_layer_pattern_disagreeing_with_config_is_one_line_error(tmp_path):
    path = write_qwen3_5_hf(tmp_path, seed=5, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]  # file: full at 1 and 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MemraError) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg and "layer 1" in msg and "layer_types[1] = linear_attention" in msg


def test_layer_types_length_and_names_are_checked(tmp_path):
    path = write_qwen3_5_hf(tmp_path, seed=5, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    for bad, want in ((cfg["layer_types"][:3], "has 3 entries but the model has 4 layers"),
                      (["linear_attention", "mamba", "linear_attention", "full_attention"], "'mamba' is not a block type")):
        (path / "config.json").write_text(json.dumps({**cfg, "layer_types": bad}))
        with pytest.raises(MemraError, match=want):
            load_model(path)


def test_state_sizes_disagreeing_with_config_are_one_line_errors(tmp_path):
    path = write_qwen3_5_hf(tmp_path, seed=6, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "linear_key_head_dim": 8}))
    with pytest.raises(MemraError) as e:
        load_model(path)
    assert "\n" not in str(e.value) and "in_proj_qkv" in str(e.value) and "expected" in str(e.value)
    (path / "config.json").write_text(json.dumps({**cfg, "linear_conv_kernel_dim": 3}))
    with pytest.raises(MemraError, match="conv1d.weight has shape"):
        load_model(path)
    # a missing linear-attention tensor names the layer's block type
    (path / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(path / "model.safetensors"))
    del t["model.layers.2.linear_attn.A_log"]
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(MemraError, match=r"A_log' \(la_A\) is missing \(its config says layer_types\[2\] = linear_attention\)"):
        load_model(path)


def test_config_defaults_layer_pattern_from_interval(tmp_path):
    path = write_qwen3_5_hf(tmp_path, seed=5, tokenizer=False, num_hidden_layers=4, full_attention_interval=4)
    cfg = qwen3_5_config(num_hidden_layers=4, full_attention_interval=4)
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 4
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model(path).dims["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


def test_streamed_full_size_writer_loads(tmp_path):
    """tools/make_checkpoint.py's hybrid writer (bf16, streamed), at tiny dims: loads and runs."""
    from fixtures.checkpoints import write_safetensors
    from fixtures.hybrid import qwen3_5_tensor_specs

    cfg = qwen3_5_config(tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(tmp_path / "model.safetensors", qwen3_5_tensor_specs(cfg, seed=1))
    model = load_model(tmp_path)
    assert model.quant.name == "bf16" and model.dims["tie_embeddings"]
    logits = ReferenceRunner(model, num_blocks=4, max_model_len=64).forward_logits([1, 2, 3])
    assert np.isfinite(logits).all()


def test_published_vl_checkpoint_text_model_matches_transformers(tmp_path):
    """Qwen3.5 as published (Qwen3_5ForConditionalGeneration: text_config, model.language_model.*,
    a vision tower we skip) saved by transformers: our logits = its text-only forward."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    ).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.normal_(1.0 if "linear_attn" in name else 0.0, 0.2)
            elif name.endswith("A_log"):
                p.uniform_(-2.0, 1.5)
    model.save_pretrained(str(tmp_path))
    loaded = load_model(tmp_path)
    assert loaded.graph.family == "qwen3_5_vl"
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 128, 40)]
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    ours = ReferenceRunner(loaded, num_blocks=4, max_model_len=64).forward_logits(ids)
    assert rel_err(ours, theirs) < 1e-4


def test_config_forms_and_unimplemented_keys(tmp_path):
    """Qwen3.5's rotary settings in the transformers 4 form (top-level rope_theta /
    partial_rotary_factor) load as the same dims as transformers 5's rope_parameters; a present pair
    that disagrees, or a math-changing key the family lacks (hf_expect), is a one-line error."""
    path = write_qwen3_5_hf(tmp_path, seed=5, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    v5 = load_model(path).dims
    rp = cfg.get("rope_parameters") or {}
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old |= {"rope_theta": rp.get("rope_theta", v5["rope_theta"]), "partial_rotary_factor": v5["partial_rotary_factor"]}
    (path / "config.json").write_text(json.dumps(old))
    v4 = load_model(path).dims
    assert {k: v4[k] for k in ("rope_theta", "partial_rotary_factor", "rope_dim", "rope_scaling")} == {
        k: v5[k] for k in ("rope_theta", "partial_rotary_factor", "rope_dim", "rope_scaling")
    }
    for bad, want in (
        ({**cfg, "rope_parameters": {**rp, "rope_theta": 5.0}, "rope_theta": 7.0}, "disagree"),
        ({**cfg, "hidden_act": "gelu"}, "'hidden_act' = 'gelu' changes the model"),
        ({**cfg, "rope_parameters": {**rp, "rope_type": "yarn", "factor": 4.0}}, "'rope_parameters.rope_type' = 'yarn'"),
    ):
        (path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(MemraError, match=want) as e:
            load_model(path)
        assert "\n" not in str(e.value)
