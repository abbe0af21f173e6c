"""engine.weights: safetensors (single/sharded), GGUF (single/split), shapes, dtypes and error messages."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from fixtures.checkpoints import Dims, bf16_round, hf_tensor_specs, permute_qk, write_safetensors

from engine.types import ConfigError, MemraError
from engine.weights import open_weights


def test_safetensors_dir(tiny_qwen3_dir: Path) -> None:
    src = open_weights(tiny_qwen3_dir)
    assert src.format == "safetensors" and src.files == [tiny_qwen3_dir / "model.safetensors"]
    assert src.metadata["architectures"] == ["Qwen3ForCausalLM"]
    assert src.metadata["_generation_config"]["eos_token_id"] == [2, 0]
    info = src.info("model.layers.0.self_attn.k_proj.weight")
    assert (info.dtype, info.shape, info.nbytes) == ("bf16", (32, 64), 32 * 64 * 2)
    assert src.info("model.layers.1.self_attn.q_norm.weight").shape == (16,)
    assert src.has("lm_head.weight") and not src.has("nope")
    raw = src.raw("model.norm.weight")
    assert raw.dtype == np.uint8 and raw.size == 128 and not raw.flags.owndata
    bits = src.array("model.norm.weight")
    assert bits.dtype == np.uint16 and bits.shape == (64,)
    specs = {n: g for n, _, g in hf_tensor_specs(Dims(), "qwen3")}
    np.testing.assert_array_equal(
        src.dequantize("model.norm.weight"), bf16_round(specs["model.norm.weight"]())
    )
    with pytest.raises(MemraError, match="no tensor named 'nope'"):
        src.info("nope")


def test_sharded_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", d)
    specs = hf_tensor_specs(Dims(), "llama")
    half = len(specs) // 2
    write_safetensors(d / "model-00001-of-00002.safetensors", specs[:half])
    write_safetensors(d / "model-00002-of-00002.safetensors", specs[half:])
    wm = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, (n, _, _) in enumerate(specs)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    src, ref = open_weights(d), open_weights(tiny_llama_dir)
    assert len(src.files) == 2 and sorted(src.tensor_names()) == sorted(ref.tensor_names())
    for name in ref.tensor_names():
        np.testing.assert_array_equal(src.array(name), ref.array(name))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        MemraError, match="model-00002-of-00002.safetensors: shard listed in the index is missing"
    ):
        open_weights(d)


def test_gguf_matches_safetensors(tiny_llama_dir: Path, tiny_llama_gguf: Path) -> None:
    hf, gg = open_weights(tiny_llama_dir), open_weights(tiny_llama_gguf)
    assert gg.format == "gguf" and gg.metadata["llama.block_count"] == 2
    assert gg.metadata["llama.attention.head_count_kv"] == 2
    assert gg.info("blk.0.attn_q.weight").shape == (64, 64)
    assert gg.info("blk.0.ffn_down.weight").shape == (64, 128)
    assert gg.info("blk.0.ffn_down.weight").dtype == "q8_0"
    assert gg.info("blk.0.attn_norm.weight").dtype == "f32"
    down = gg.dequantize("blk.0.ffn_down.weight")
    np.testing.assert_allclose(down, hf.dequantize("model.layers.0.mlp.down_proj.weight"), atol=5e-4)
    k = hf.dequantize("model.layers.0.self_attn.k_proj.weight")
    np.testing.assert_allclose(gg.dequantize("blk.0.attn_k.weight"), permute_qk(k, 2), atol=5e-4)
    with pytest.raises(MemraError, match="use dequantize"):
        gg.array("blk.0.ffn_down.weight")


def test_smollm2_gguf(smollm2_source) -> None:
    src = smollm2_source
    md = src.metadata
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 30
    assert md["tokenizer.ggml.pre"] == "smollm" and md["tokenizer.ggml.add_bos_token"] is False
    toks = md["tokenizer.ggml.tokens"]
    assert md["tokenizer.ggml.tokens"] is toks and len(toks) == 49152  # converted once, cached
    assert src.info("token_embd.weight") == src.info("token_embd.weight")
    assert (src.info("token_embd.weight").dtype, src.info("token_embd.weight").shape) == (
        "q8_0",
        (49152, 576),
    )
    assert (src.info("blk.0.attn_k.weight").dtype, src.info("blk.0.attn_k.weight").shape) == (
        "q4_1",
        (192, 576),
    )
    assert src.info("blk.0.ffn_up.weight").shape == (1536, 576) and not src.has("output.weight")
    assert src.array("output_norm.weight").dtype == np.float32


def test_split_gguf(tmp_path: Path) -> None:
    import gguf

    parts = []
    for i in range(2):
        p = tmp_path / f"m-{i + 1:05d}-of-00002.gguf"
        w = gguf.GGUFWriter(str(p), "llama")
        w.add_uint16("split.no", i)
        w.add_tensor(f"t{i}.weight", np.full((2, 3), i, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        parts.append(p)
    src = open_weights(parts[1])
    assert src.files == parts and src.tensor_names() == ["t0.weight", "t1.weight"]
    assert src.info("t1.weight").shape == (2, 3)
    np.testing.assert_array_equal(src.dequantize("t1.weight"), np.ones((2, 3), np.float32))
    parts[1].unlink()
    with pytest.raises(MemraError, match="missing shard.*m-00002-of-00002.gguf"):
        open_weights(parts[0])


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(MemraError, match="no such file or directory"):
        open_weights(tmp_path / "absent.gguf")
    with pytest.raises(MemraError, match="not a model directory"):
        open_weights(tmp_path)


def test_bad_config_json(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: config.json is not valid JSON"):
        open_weights(d)


def test_truncated_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(MemraError, match=r"model.safetensors: truncated file: tensor 'lm_head.weight'"):
        open_weights(d)
    f.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(MemraError, match="corrupt safetensors header"):
        open_weights(d)
    f.write_bytes(struct.pack("<Q", 4) + b"{x]}")
    with pytest.raises(MemraError, match="corrupt safetensors header"):
        open_weights(d)


def test_truncated_and_corrupt_gguf(tmp_path: Path, tiny_llama_gguf: Path) -> None:
    data = tiny_llama_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:-5000])
    with pytest.raises(MemraError, match=r"bad.gguf: .*truncated"):
        open_weights(bad)
    bad.write_bytes(data[:200])
    with pytest.raises(MemraError, match=r"bad.gguf: cannot read GGUF file"):
        open_weights(bad)
    bad.write_bytes(b"XXXX" + data[4:])
    with pytest.raises(MemraError, match=r"bad.gguf: cannot read GGUF file.*magic"):
        open_weights(bad)


def test_fixture_writers_are_deterministic(
    tmp_path: Path, tiny_llama_dir: Path, tiny_llama_gguf: Path
) -> None:
    from fixtures.checkpoints import write_llama_gguf, write_llama_safetensors

    again = write_llama_safetensors(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()
    assert (
        write_llama_gguf(tmp_path / "again.gguf", quant="q8_0").read_bytes() == tiny_llama_gguf.read_bytes()
    )
    other = write_llama_safetensors(tmp_path / "other", seed=1, num_hidden_layers=1, tie_word_embeddings=True)
    src = open_weights(other)
    assert src.metadata["num_hidden_layers"] == 1 and not src.has("lm_head.weight")
    assert src.info("model.embed_tokens.weight").shape == (384, 64)


@pytest.mark.parametrize("quant", ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_llama_gguf_quants(tmp_path: Path, tiny_llama_dir: Path, quant: str) -> None:
    from fixtures.checkpoints import write_llama_gguf

    gg = open_weights(write_llama_gguf(tmp_path / f"m.{quant}.gguf", quant=quant))
    assert gg.info("blk.1.ffn_gate.weight").dtype == quant and gg.info("output.weight").shape == (384, 64)
    ref = open_weights(tiny_llama_dir).dequantize("model.layers.1.mlp.gate_proj.weight")
    tol = {"f32": 0, "f16": 1e-4, "bf16": 0}.get(quant, 0.01)
    np.testing.assert_allclose(gg.dequantize("blk.1.ffn_gate.weight"), ref, atol=tol)


def test_make_checkpoint_tool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", Path(__file__).parent.parent / "tools" / "make_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--shape", "smollm2-135m", "--layers", "1", "--out", str(tmp_path / "m")]) == 0
    src = open_weights(tmp_path / "m")
    assert src.metadata["hidden_size"] == 576 and src.metadata["num_key_value_heads"] == 3
    assert src.info("model.embed_tokens.weight").shape == (49152, 576)
    assert src.info("model.layers.0.mlp.down_proj.weight").shape == (576, 1536) and not src.has(
        "lm_head.weight"
    )
    w = src.dequantize("model.layers.0.self_attn.q_proj.weight")
    assert abs(float(w.std()) - 0.02) < 0.001
    assert "0.0" in capsys.readouterr().out
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(src)  # the word-level tokenizer: every id decodes to text
    assert tok.decode([49151]) == "w49151" and tok.encode("<|im_start|>user alpha") == [1, 3, 6]


def test_qwen3_gguf_matches_safetensors(tiny_qwen3_dir: Path, tiny_qwen3_gguf: Path) -> None:
    hf, gg = open_weights(tiny_qwen3_dir), open_weights(tiny_qwen3_gguf)
    assert gg.metadata["general.architecture"] == "qwen3" and gg.metadata["qwen3.attention.key_length"] == 16
    assert len(gg.tensor_names()) == len(hf.tensor_names())
    np.testing.assert_array_equal(
        gg.dequantize("blk.1.attn_k_norm.weight"), hf.dequantize("model.layers.1.self_attn.k_norm.weight")
    )
    q = hf.dequantize("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_allclose(gg.dequantize("blk.0.attn_q.weight"), q, atol=5e-4)  # not permuted


def test_make_checkpoint_random_gguf_mix(tmp_path: Path) -> None:
    import importlib.util

    from engine.model import load_model

    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", Path(__file__).parent.parent / "tools" / "make_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "q.gguf"
    assert mod.main(["--shape", "qwen3-0.6b", "--layers", "2", "--gguf", "q4_k_m", "--out", str(out)]) == 0
    m = load_model(out)
    assert m.quant.name == "q4_k_m"
    assert m.info("wq", 0).dtype == "q4_k" and m.info("wv", 0).dtype == "q6_k" and m.info("wv", 1).dtype == "q4_k"
    w = m.dequantize("w_down", 1)
    assert np.isfinite(w).all() and 1e-3 < float(np.abs(w).mean()) < 0.1
