"""Gemma 3 on the reference backend: sliding-window attention (op level, paged, past the window), the
family's per-layer ops (`when` predicates), and a tiny random Gemma3ForCausalLM saved by the installed transformers
against transformers' own fp32 logits. The real 270M GGUF is tests/test_reference_gemma3_real.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from fixtures.engine_probes import run_logits

from engine import graph, ops_ref
from engine.model import _check_pattern_dims, load_model, resolve_dims
from engine.reference import ReferenceRunner
from engine.types import ConfigError, MemraError, SamplingParams, StepItem

RNG = np.random.default_rng(37)


def per_layer(g, d, op: str, attr: str) -> tuple:
    """Each layer's value of ``op``'s attribute ``attr`` (the dim it names; None where unset), with
    the op the family's `when` predicates run in that layer."""
    out = []
    for i in range(int(d["layers"])):
        (o,) = [o for o in g.layer_ops(d, i) if o.op == op]
        out.append(d[o.attrs[attr]] if attr in o.attrs else None)
    return tuple(out)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _window_loop(q, k, v, start_pos, heads, kv_heads, hd, window, scale):
    """Explicit per-query, per-head softmax over keys max(0, p-window+1)..p."""
    t = q.shape[0]
    out = np.zeros((t, heads * hd))
    g = heads // kv_heads
    for i in range(t):
        p = start_pos + i
        keys = range(max(0, p - window + 1) if window else 0, p + 1)
        for h in range(heads):
            kvh = h // g
            qv = q[i, h * hd : (h + 1) * hd].astype(np.float64)
            s = [float(qv @ k[j, kvh * hd : (kvh + 1) * hd]) * scale for j in keys]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = sum(e)
            out[i, h * hd : (h + 1) * hd] = sum(
                e[n] / z * v[j, kvh * hd : (kvh + 1) * hd] for n, j in enumerate(keys)
            )
    return out


@pytest.mark.parametrize("window,start,t", [(5, 0, 13), (5, 9, 4), (5, 17, 1), (1, 6, 3), (64, 3, 9)])
def test_paged_window_attention_matches_loop_and_skips_released_blocks(window, start, t):
    heads, kv_heads, hd, bs = 4, 2, 4, 4
    total = start + t
    k_all, v_all = rand(total, kv_heads * hd), rand(total, kv_heads * hd)
    q = rand(t, heads * hd)
    nb = -(-total // bs)
    table = list(RNG.permutation(32)[:nb])
    kc, vc = np.zeros((32, bs, kv_heads, hd), np.float32), np.zeros((32, bs, kv_heads, hd), np.float32)
    ops_ref.write_kv(kc, vc, k_all[:start], v_all[:start], table, 0)
    # blocks wholly before the first query's window may be released: poison their table entries
    first = ops_ref.window_start(start, window) // bs
    poisoned = [10**9] * first + table[first:]
    got = ops_ref.attention(
        q, k_all[start:], v_all[start:], kc, vc, poisoned, start,
        heads=heads, kv_heads=kv_heads, head_dim=hd, scale=0.3, window=window,
    )  # fmt: skip
    want = _window_loop(q, k_all, v_all, start, heads, kv_heads, hd, window, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_window_query_chunks_are_exact(monkeypatch):
    heads, kv_heads, hd, t, start, window = 2, 1, 4, 11, 2, 3
    q = rand(t, heads, hd)
    k, v = rand(start + t, kv_heads, hd), rand(start + t, kv_heads, hd)
    want = _window_loop(q.reshape(t, -1), k.reshape(start + t, -1), v.reshape(start + t, -1), start, heads, kv_heads, hd, window, 0.5)
    for chunk in (1, 3, 256):
        monkeypatch.setattr(ops_ref, "ATTN_QUERY_CHUNK", chunk)
        got = ops_ref.attention_dense(q, k, v, start, 0.5, window)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"chunk {chunk}")
    with pytest.raises(ValueError, match="past the window"):
        ops_ref.attention_dense(q, k[3:], v[3:], start, 0.5, window, key_start=3)


def test_gelu_tanh_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.concatenate([rand(200) * 4, np.array([-30.0, -8.0, 0.0, 8.0, 30.0], np.float32)])
    want = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(ops_ref.gelu_tanh(x), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ops_ref.gelu_tanh_mul(x, 2 * x), want * 2 * x, rtol=1e-5, atol=1e-5)


# ---- the family's dims ----------------------------------------------------------------------------

GGUF_META = {
    "general.architecture": "gemma3",
    "gemma3.embedding_length": 64,
    "gemma3.block_count": 7,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 32,
    "gemma3.feed_forward_length": 128,
    "gemma3.vocab_size": 384,
    "gemma3.attention.sliding_window": 16,
    "gemma3.rope.freq_base": 1e6,
}


def test_gguf_dims_use_the_default_pattern_and_local_base():
    g = graph.load_family("gemma3")
    d = resolve_dims(g, "gguf", GGUF_META, "x.gguf", has_tensor=lambda k, *a: False)
    assert d["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert per_layer(g, d, "attention", "window") == (16,) * 5 + (None, 16)
    assert per_layer(g, d, "rope", "theta") == (1e4,) * 5 + (1e6, 1e4)
    assert d["norm_offset"] == 0.0 and d["attn_scale"] == 32**-0.5 and d["embed_scale"] == 8.0
    assert d["tie_embeddings"] is True
    # llama.cpp's array form of the pattern: true marks a sliding-window layer
    meta = dict(GGUF_META, **{"gemma3.attention.sliding_window_pattern": [True, False] * 3 + [True]})
    meta["gemma3.rope.freq_base_swa"] = 5e4
    meta["gemma3.rope.scaling.type"], meta["gemma3.rope.scaling.factor"] = "linear", 8.0
    d = resolve_dims(g, "gguf", meta, "x.gguf", has_tensor=lambda k, *a: False)
    assert per_layer(g, d, "attention", "window") == (16, None, 16, None, 16, None, 16)
    assert per_layer(g, d, "rope", "theta") == (5e4, 1e6) * 3 + (5e4,)
    scaling = per_layer(g, d, "rope", "scaling")
    assert scaling[1] == {"type": "linear", "factor": 8.0} and scaling[0] is None
    inv = ops_ref.rope_inv_freq(32, 1e6, scaling[1])
    np.testing.assert_allclose(inv, ops_ref.rope_inv_freq(32, 1e6) / 8.0)
    np.testing.assert_array_equal(ops_ref.rope_inv_freq(32, 1e6, {"type": "none"}), ops_ref.rope_inv_freq(32, 1e6))


def test_unknown_layer_type_is_a_clear_error():
    from types import SimpleNamespace

    g = graph.load_family("gemma3")
    hf = {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 384, "layer_types": ["sliding_attention", "chunked_attention"],
    }  # fmt: skip
    d = resolve_dims(g, "hf", hf, "config.json")
    with pytest.raises(MemraError, match=r"config.json: layer_types\[1\] = 'chunked_attention' is not a block type of family gemma3"):
        _check_pattern_dims(SimpleNamespace(graph=g, dims=d), "config.json")
    d = resolve_dims(g, "hf", dict(hf, layer_types=["full_attention"]), "config.json")
    with pytest.raises(MemraError, match="config.json: layer_types has 1 entries but the model has 2 layers"):
        _check_pattern_dims(SimpleNamespace(graph=g, dims=d), "config.json")
    # a GGUF pattern array shorter than the layers: the predicate names the layer
    meta = dict(GGUF_META, **{"gemma3.attention.sliding_window_pattern": [True, False]})
    d = resolve_dims(g, "gguf", meta, "x.gguf", has_tensor=lambda k, *a: False)
    with pytest.raises(MemraError, match=r"gemma3.yaml: layer 2: the `when` predicate 'sliding' cannot be evaluated"):
        g.tensor_layers(d)


def test_dsl_checks_gemma3_attributes_and_predicates(tmp_path: Path):
    import shutil

    root = tmp_path / "models"
    shutil.copytree(Path(graph.__file__).resolve().parent.parent / "models", root)
    text = (root / "gemma3.yaml").read_text()
    (root / "gemma3.yaml").write_text(text.replace("scale: embed_scale}", "scale: nope}"))
    with pytest.raises(ConfigError, match=r"graph\[0\].scale: 'nope' is not a dim of this family"):
        graph.load_family("gemma3", root)
    lines = [ln for ln in text.splitlines() if not ln.startswith("  layer_types:")]
    (root / "gemma3.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"'layer_types' is not a dim"):
        graph.load_family("gemma3", root)
    # the full layers' attention reading a value only the sliding layers produce
    bad = text.replace("out: a, scale: attn_scale, when: not sliding}", "out: a, scale: attn_scale, when: not sliding}\n      - {op: add, in: [a, q], out: z, when: sliding}\n      - {op: add, in: [z, a], out: a, when: not sliding}")
    (root / "gemma3.yaml").write_text(bad)
    with pytest.raises(ConfigError, match=r"value 'z' is produced only when 'sliding' but read by an op that runs when 'not sliding'"):
        graph.load_family("gemma3", root)


# ---- a tiny random Gemma 3 saved by transformers ----------------------------------------------------

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """A 7-layer Gemma3ForCausalLM (window 8, GQA 4/2, head_dim 32 != hidden/heads, linear RoPE
    scaling on the global layer, non-zero norm weights) saved by the installed transformers, and
    its fp32 logits on a 40-token sequence."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, max_position_embeddings=256,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers initialises them to 0: make (1 + w) matter
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny_gemma3")
    model.save_pretrained(path)
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 384, 40)]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    return path, ids, logits


def test_tiny_gemma3_matches_transformers(tiny_gemma3):
    path, ids, want = tiny_gemma3
    m = load_model(path)
    assert m.graph.family == "gemma3" and m.quant.name == "f32"
    assert m.dims["layer_types"][5] == "full_attention"
    assert per_layer(m.graph, m.dims, "attention", "window")[:6] == (8,) * 5 + (None,)
    got = ReferenceRunner(m, max_model_len=64).forward_logits(ids)
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel < 1e-4, rel
    np.testing.assert_array_equal(got.argmax(1), want.argmax(1))


def test_a_layer_type_without_rope_scaling_gets_none(tiny_gemma3):
    """A layer type's scaling of None (GGUF: only the global layers carry rope.scaling) means no
    scaling for that layer, not the model-wide rope_scaling (here the global layers' linear x2)."""
    import dataclasses

    path, ids, want = tiny_gemma3
    m = load_model(path)
    assert m.dims["rope_scaling"]["rope_type"] == "linear" and m.dims["rope_local_scaling"] is not None
    m2 = dataclasses.replace(m, dims=dict(m.dims, rope_local_scaling=None))
    got = ReferenceRunner(m2, max_model_len=64).forward_logits(ids)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4


def test_tiny_gemma3_chunked_and_decode_past_the_window_equal_one_pass(tiny_gemma3):
    path, ids, _ = tiny_gemma3
    runner = ReferenceRunner(load_model(path), num_blocks=64, block_size=4, max_model_len=64)
    whole = runner.forward_logits(ids)
    table = list(np.random.default_rng(1).permutation(64)[:10])
    rows, pos = [], 0
    for chunk in (5, 7, 9, 1, 1, 1, 16):  # chunks straddling the window edge, then decode steps
        item = StepItem(seq_id=1, token_ids=ids[pos : pos + chunk], start_pos=pos, block_table=table, sample=False, sampling=SamplingParams())
        rows.append(run_logits(runner, item))
        pos += chunk
    np.testing.assert_allclose(np.concatenate(rows), whole, rtol=1e-5, atol=1e-5)
    out = runner.generate(ids[:3], 30, SamplingParams(temperature=0.0))  # greedy well past the window
    assert len(out) == 30
    ref = ReferenceRunner(load_model(path), max_model_len=64).forward_logits(ids[:3] + out[:-1])
    assert out == [int(i) for i in ref[2:].argmax(1)]


def test_engine_batched_prefix_hits_and_preemption_past_the_window_equal_solo(tiny_gemma3):
    """Through the engine loop (block size 4, window 8): prompts sharing a prefix longer than the window,
    chunked prefill, preemption and a second wave served from the prefix cache give the solo tokens."""
    from fixtures.engine_waves import serve_waves

    model = load_model(tiny_gemma3[0])
    shared = [int(i) for i in np.random.default_rng(5).integers(0, 128, 14)]
    prompts = [shared + [7, 8, 9], shared + [40], shared[:6], [3] * 13]

    def run(waves, num_blocks, **cfg):
        runner = ReferenceRunner(model, num_blocks=num_blocks, block_size=4, max_model_len=64)
        return serve_waves(runner, waves, max_tokens=10, **cfg)

    solo = [run([[p]], 32)[0][0][0] for p in prompts]
    batched, stats = run([prompts], 14, max_running=4, prefill_chunk_tokens=6, max_step_tokens=16)
    assert [t for t, _ in batched] == solo and stats.preemptions > 0
    again, _ = run([prompts, prompts], 64, max_running=8)
    assert [t for t, _ in again] == solo + solo
    assert [c for _, c in again][4:] == [16, 12, 4, 12]  # prefix hits past the window


def test_completions_prompt_gets_the_models_bos():
    """A raw /v1/completions prompt is encoded with the model's BOS (Gemma answers "Paris" with it and
    "\\nA\\nA..." without); a chat prompt is the rendered template's own."""
    import falcon.testing
    from server_fakes import FakeEngine, FakeTokenizer

    from engine.server.app import create_app
    from engine.server.model_info import ModelInfo
    from engine.server_config import ServerConfig

    class BosTokenizer(FakeTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False, scope=None) -> list[int]:
            return ([2] if add_special_tokens else []) + super().encode(text)

    engine = FakeEngine()
    info = ModelInfo("g", context_length=2048, backend="fake", created=1, aliases=())
    client = falcon.testing.TestClient(create_app(engine, BosTokenizer(), info, ServerConfig(keepalive_s=0.3)))
    r = client.simulate_post("/v1/completions", json={"model": "g", "prompt": "ab"})
    assert r.status_code == 200 and engine.submitted[-1].prompt_ids == [2, 97, 98]
    r = client.simulate_post("/v1/chat/completions", json={"model": "g", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and engine.submitted[-1].prompt_ids[0] != 2


def test_window_is_general_a_mistral_with_sliding_window_matches_transformers(tmp_path, monkeypatch):
    """Any family can take the window: a llama delta whose attention reads config.json `sliding_window`
    runs a transformers-saved MistralForCausalLM (window 6) like transformers over 24 tokens."""
    import shutil

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine import paths

    root = tmp_path / "models"
    shutil.copytree(Path(graph.__file__).resolve().parent.parent / "models", root)
    (root / "mistral_swa.yaml").write_text(
        "family: mistral_swa\nextends: llama\n"
        "matches: {hf_architectures: [MistralForCausalLM], gguf_architectures: []}\n"
        "dims:\n  sliding_window: {hf: sliding_window, default: 0}\n"
        "hf_expect: {sliding_window: null}\n"  # llama's "no window" rule: this delta implements one
        "rope_style: {hf: neox, gguf: interleaved}\n"
        "graph_edits:\n  - replace: {op: attention}\n"
        "    with: {op: attention, in: [q, k, v], out: a, window: sliding_window}\n"
    )
    monkeypatch.setattr(paths, "models_dir", lambda: root)
    torch.manual_seed(1)
    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6, max_position_embeddings=64,
    )  # fmt: skip
    hf = transformers.MistralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "mistral")
    ids = [int(i) for i in np.random.default_rng(4).integers(0, 256, 24)]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    m = load_model(tmp_path / "mistral", family="mistral_swa")
    assert m.dims["sliding_window"] == 6
    got = ReferenceRunner(m, max_model_len=32).forward_logits(ids)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4
    import dataclasses

    no_window = dataclasses.replace(m, dims=dict(m.dims, sliding_window=0))
    full = ReferenceRunner(no_window, max_model_len=32).forward_logits(ids)
    assert float(np.abs(full - want).max() / np.abs(want).max()) > 1e-3  # the window matters here
    with pytest.raises(MemraError, match="field 'sliding_window' = 6 changes the model in a way family llama"):
        load_model(tmp_path / "mistral", family="llama")  # plain llama refuses it rather than drop the window


def test_tiny_gemma3_pipeline_split_equals_one_runner_and_tp_is_refused(tiny_gemma3):
    """--split pp runs Gemma's layers (both attention kinds) across two ranks exactly as one runner;
    --split tp has no rule for Gemma's `add` yet and says so rather than mis-sum a partial."""
    from engine.placement import plan_placement
    from engine.sharded_reference import ShardedReference

    path, ids, want = tiny_gemma3
    m = load_model(path)
    pl = plan_placement(m.graph, m.dims, "pp", [0, 1], tensor_dtypes=m.tensor_dtypes)
    got = ShardedReference(m, pl, max_model_len=64).forward_logits(ids)
    np.testing.assert_array_equal(got, ReferenceRunner(m, max_model_len=64).forward_logits(ids))
    with pytest.raises(MemraError, match="family gemma3 has op 'add', which has no tensor-parallel rule yet"):
        plan_placement(m.graph, m.dims, "tp", [0, 1], tensor_dtypes=m.tensor_dtypes)
