"""ReferenceRunner on tiny random checkpoints: paged-cache invariance, step contract, errors.

``write_tiny_hf`` (also used by test_reference_hf.py) writes a random float32 Llama or Qwen3
checkpoint (config.json + model.safetensors) that both engine.model.load_model and transformers
can load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fixtures.engine_probes import run_logits
from safetensors.numpy import save_file

from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.types import MemraError, Runner, SamplingParams, StepItem

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=128)


def write_tiny_hf(
    directory: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    tie: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    **over,
) -> Path:
    """A random f32 HF checkpoint of ``family`` (llama | qwen3) with TINY dims (overridable)."""
    d = {**TINY, **over}
    rng = np.random.default_rng(seed)
    h, hd, n, kv, ff, v = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"], d["intermediate"], d["vocab"]

    def mat(o, i, scale=None):
        return (rng.standard_normal((o, i)) * (scale or 1 / np.sqrt(i))).astype(np.float32)

    def norm(k):
        return (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(v, h, 1.0), "model.norm.weight": norm(h)}
    if not tie:
        t["lm_head.weight"] = mat(v, h)
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = mat(n * hd, h)
        t[p + "self_attn.k_proj.weight"] = mat(kv * hd, h)
        t[p + "self_attn.v_proj.weight"] = mat(kv * hd, h)
        t[p + "self_attn.o_proj.weight"] = mat(h, n * hd)
        t[p + "mlp.gate_proj.weight"] = mat(ff, h)
        t[p + "mlp.up_proj.weight"] = mat(ff, h)
        t[p + "mlp.down_proj.weight"] = mat(h, ff)
        if family == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    config = {
        "architectures": [arch],
        "model_type": family,
        "hidden_size": h,
        "intermediate_size": ff,
        "num_hidden_layers": d["layers"],
        "num_attention_heads": n,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": v,
        "max_position_embeddings": d.get("context", 512),
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(t, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def qwen_runner(tmp_path_factory):
    path = write_tiny_hf(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=1)
    return ReferenceRunner(load_model(path), num_blocks=64, block_size=4, max_model_len=128)


@pytest.fixture(scope="module")
def llama_runner(tmp_path_factory):
    path = write_tiny_hf(tmp_path_factory.mktemp("llama"), "llama", seed=2, tie=True)
    return ReferenceRunner(load_model(path), num_blocks=64, block_size=4, max_model_len=128)


GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 17, 99, 3, 64, 64, 12, 101, 7, 45, 88, 2, 19, 30]


def item(tokens, start, table, sample=False, seq_id=0, sampling=GREEDY, history=()):
    return StepItem(seq_id, list(tokens), start, list(table), sample, sampling, list(history), len(PROMPT), 0)


def chunked_logits(runner, tokens, table, sizes):
    out, pos = [], 0
    for n in sizes:
        out.append(run_logits(runner, item(tokens[pos : pos + n], pos, table)))
        pos += n
    assert pos == len(tokens)
    return np.concatenate(out)


@pytest.mark.parametrize("fixture", ["qwen_runner", "llama_runner"])
def test_chunking_does_not_change_logits(fixture, request):
    r = request.getfixturevalue(fixture)
    whole = r.forward_logits(PROMPT)
    assert whole.shape == (len(PROMPT), r.vocab) and whole.dtype == np.float32
    table = list(range(4))
    for sizes in ([len(PROMPT)], [5, 9], [3, 4, 1, 6], [1] * len(PROMPT)):
        got = chunked_logits(r, PROMPT, table, sizes)
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5, err_msg=str(sizes))


def test_random_block_tables_match_contiguous(qwen_runner):
    r = qwen_runner
    whole = r.forward_logits(PROMPT)
    rng = np.random.default_rng(7)
    for _ in range(3):
        table = [int(b) for b in rng.permutation(r.num_blocks)[:4]]
        got = chunked_logits(r, PROMPT, table, [6, 1, 7])
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)


def test_logits_depend_on_earlier_tokens(qwen_runner):
    """The cache is really read: changing an early token changes the last position's logits."""
    a = qwen_runner.forward_logits(PROMPT)
    b = qwen_runner.forward_logits([PROMPT[0] + 1] + PROMPT[1:])
    assert np.abs(a[-1] - b[-1]).max() > 1e-3
    np.testing.assert_allclose(a[:, :], qwen_runner.forward_logits(PROMPT), rtol=0, atol=0)


def test_step_is_the_runner_protocol_and_batch_independent(qwen_runner):
    r = qwen_runner
    assert isinstance(r, Runner) and r.backend == "reference"
    hot = SamplingParams(temperature=0.8, seed=3)
    # alone
    alone_g = r.step([item(PROMPT, 0, [0, 1, 2, 3], sample=True)])
    alone_s = r.step([item(PROMPT[:9], 0, [4, 5, 6], sample=True, sampling=hot, history=PROMPT[:9])])
    # together with other work in the same step, different blocks
    mixed = r.step(
        [
            item(PROMPT[:3], 0, [10], sample=False, seq_id=9),
            item(PROMPT[:9], 0, [20, 21, 22], sample=True, sampling=hot, history=PROMPT[:9], seq_id=4),
            item(PROMPT, 0, [30, 31, 32, 33], sample=True, seq_id=5),
        ]
    )
    assert mixed[0] is None
    assert mixed[1] == alone_s[0]
    assert mixed[2] == alone_g[0] == int(np.argmax(r.forward_logits(PROMPT)[-1]))


def test_generate_greedy_matches_forward_argmax(llama_runner):
    r = llama_runner
    out = r.generate(PROMPT, 6)
    seq = list(PROMPT)
    for _ in range(6):
        seq.append(int(np.argmax(r.forward_logits(seq)[-1])))
    assert out == seq[len(PROMPT) :]
    stop = out[1]
    assert r.generate(PROMPT, 6, stop_token_ids=[stop]) == out[: out.index(stop) + 1]
    seeded = SamplingParams(temperature=1.0, seed=42)
    assert r.generate(PROMPT, 5, seeded) == r.generate(PROMPT, 5, seeded)


def test_step_errors_are_clear(qwen_runner):
    r = qwen_runner
    with pytest.raises(MemraError, match="maximum context length") as exc:
        r.step([item([1] * 10, 125, list(range(33)))])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(MemraError, match="block_table has 1 blocks"):
        r.step([item(PROMPT, 0, [0])])
    with pytest.raises(MemraError, match="out of range"):
        r.step([item([1, 2], 0, [64])])
    with pytest.raises(MemraError, match="token id 500"):
        r.step([item([1, 500], 0, [0])])


def test_default_sizes(tmp_path):
    m = load_model(write_tiny_hf(tmp_path, "llama", context=256))
    r = ReferenceRunner(m)
    assert r.max_model_len == 256 and r.block_size == 16
    assert r.num_blocks * r.block_size >= 256
    assert r.k_cache.shape == (2, r.num_blocks, 16, 2, 16) and r.k_cache.dtype == np.float32
