"""Qwen3-MoE loading: the DSL pieces it added (per-layer `when`, list dims, config field
alternatives, stacked tensors), one-line errors for malformed MoE checkpoints, the weight-memory count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures.checkpoints import write_qwen3_moe_gguf, write_qwen3_moe_safetensors
from fixtures.engine_probes import decode_read_bytes
from safetensors.numpy import save_file

from engine import graph, hf_config
from engine.dsl_expr import evaluate
from engine.model import dims_for_size, load_model, resolve_dims
from engine.ops import OPS
from engine.types import ConfigError, MemraError
from engine.weight_memory import WeightBytes, check_fits, weight_bytes
from engine.weights import open_weights

MIXED = dict(num_hidden_layers=3, mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return write_qwen3_moe_safetensors(tmp_path_factory.mktemp("moe"), seed=1, **MIXED)


def _rewrite(src: Path, dst: Path, drop=(), replace=None, config=None, shards: int = 2) -> Path:
    """A copy of HF dir ``src`` as f32 ``shards`` shards + index, minus ``drop``, with ``replace``d
    tensors and ``config`` fields overridden."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    s = open_weights(src)
    tensors = {n: s.dequantize(n) for n in s.tensor_names() if n not in drop}
    tensors.update(replace or {})
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def _one_line(fn) -> str:
    with pytest.raises(MemraError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# --- the family and the DSL ------------------------------------------------------------------


def test_family_graph_mixes_dense_and_sparse_layers():
    g = graph.load_family("qwen3_moe")
    d = dims_for_size("qwen3_moe", "qwen3-30b-a3b")
    assert (d["experts"], d["experts_used"], d["moe_intermediate"]) == (128, 8, 768)
    assert all(op.op != "silu_mul" for op in g.layer_ops(d, 0))
    d2 = dict(d, mlp_only_layers=[0], decoder_sparse_step=2)
    ops = [[op.op for op in g.layer_ops(d2, i)] for i in range(4)]
    # layer 0: mlp_only; layer 1: (1+1) % 2 == 0 sparse; 2: dense; 3: sparse
    assert ["moe_experts" in o for o in ops] == [False, True, False, True]
    assert ["silu_mul" in o for o in ops] == [True, False, True, False]
    layers = g.tensor_layers(d2 | {"layers": 4})
    assert layers["exp_gate"] == [1, 3] and layers["w_gate"] == [0, 2] and layers["wq"] == [0, 1, 2, 3]
    assert OPS["moe_experts"].weight_counts == (3, 7)


def test_expressions():
    v = {"i": 3, "skip": [1, 3], "step": 2, "kinds": ["a", "b", "c", "d"]}
    assert evaluate("i in skip and (i + 1) % step == 0", v) is True
    assert evaluate("not (i not in skip)", v) is True
    assert evaluate("kinds[i] == 'd'", v) is True
    assert evaluate("1 if i > 2 else 0", v) == 1
    assert evaluate("i ** 2", v) == 9 and evaluate("4 ** -0.5", v) == 0.5 and evaluate("-i", v) == -3
    for bad in ("__import__('os')", "i.real", "lambda: 1", "i << 2", "2 ** 100"):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate(bad, v)


def _family(tmp_path: Path, text: str) -> str:
    root = tmp_path / "models"
    root.mkdir()
    for f in ("llama", "qwen3"):
        shutil.copy(Path(graph.__file__).parent.parent / "models" / f"{f}.yaml", root / f"{f}.yaml")
    (root / "fam.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        graph.load_family("fam", root)
    return str(e.value)


HEAD = "family: fam\nextends: qwen3\n"


@pytest.mark.parametrize(
    "body,needle",
    [
        (  # a value produced only in some layers, read in every layer
            "graph_edits:\n  - replace: {op: silu_mul}\n    with: {op: silu_mul, in: [g, u], out: m, when: 'i > 0'}\n",
            "value 'm' is produced only when 'i > 0' but read by an op that runs when 'always'",
        ),
        (
            "graph_edits:\n  - replace: {op: silu_mul}\n    with: {op: silu_mul, in: [g, u], out: m, when: 'nope'}\n",
            "fam.yaml: graph[1].body[9].when: 'nope' is not a dim, a predicate or `i`",
        ),
        (
            "graph_edits:\n  - replace: {op: embed}\n    with: {op: embed, in: tokens, weight: embed, out: x, when: 'i > 0'}\n",
            "fam.yaml: graph[0].when: a `when` predicate needs a per-layer op",
        ),
        ("predicates: {p: 'hidden.real'}\n", "fam.yaml: predicates.p: invalid expression"),
        (
            "tensors:\n  e: {hf: 'a.{i}.{e}.w', kind: matrix, shape: [hidden, hidden]}\n",
            "fam.yaml: tensors.e.hf: a pattern with {e} needs `stack: <dim>`",
        ),
        (
            "graph_edits:\n  - after: {op: silu_mul}\n    insert: [{op: moe_experts, in: [h, h, h], weight: [wq, wk, wv, wo], out: y}]\n",
            "op moe_experts takes 3 or 7 weights, got 4",
        ),
        (
            "graph_edits:\n  - after: {op: silu_mul}\n    insert: [{op: moe_router, in: h, weight: wq, out: [a, b], top_k: nope}]\n",
            "top_k: 'nope' is not a dim of this family",
        ),
    ],
)
def test_dsl_errors_name_file_and_key(tmp_path, body, needle):
    msg = _family(tmp_path, HEAD + body)
    assert needle in msg, msg


def test_config_field_alternatives_and_gguf_defaults():
    g = graph.load_family("qwen3_moe")
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 8,
            "vocab_size": 10, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    new = resolve_dims(g, "hf", base | {"num_local_experts": 6, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, "c")
    old = resolve_dims(g, "hf", base | {"num_experts": 6, "rope_theta": 5e5}, "c")
    both = resolve_dims(g, "hf", base | {"num_local_experts": 6, "num_experts": 6}, "c")
    for d in (new, old):
        assert (d["experts"], d["rope_theta"], d["norm_topk_prob"], d["mlp_only_layers"]) == (6, 5e5, False, [])
    assert both["experts"] == 6
    # the forms of one dim are read by engine.hf_config: present paths must agree
    with pytest.raises(MemraError, match=r"'num_experts' \(6\) and 'num_local_experts' \(8\) disagree \(dim experts\)"):
        resolve_dims(g, "hf", base | {"num_local_experts": 8, "num_experts": 6}, "c")
    text = base | {"num_experts": 6}  # nested under text_config, as multimodal configs write it
    assert resolve_dims(g, "hf", {"text_config": text}, "c")["experts"] == 6
    # hf_expect is inherited through extends (qwen3 <- llama): math the family lacks is an error
    hf_config.check_expected(base | {"hidden_act": "silu", "use_sliding_window": False}, g.hf_expect, "c", g.family)
    with pytest.raises(MemraError, match="'use_sliding_window' = True changes the model in a way family qwen3_moe"):
        hf_config.check_expected(base | {"use_sliding_window": True}, g.hf_expect, "c", g.family)
    gg = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64, "qwen3moe.block_count": 2,
          "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 8, "qwen3moe.vocab_size": 10,
          "qwen3moe.expert_count": 6, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 8}
    d = resolve_dims(g, "gguf", gg, "f.gguf", has_tensor=lambda key, layer=None: layer != 1)
    assert d["norm_topk_prob"] is True and d["mlp_only_layers"] == [1]  # llama.cpp's qwen3moe rule
    d = resolve_dims(g, "gguf", gg | {"qwen3moe.expert_weights_norm": False}, "f.gguf")
    assert d["norm_topk_prob"] is False


# --- stacked tensors and malformed checkpoints --------------------------------------------------


def test_per_expert_tensors_are_presented_stacked(moe_dir, tmp_path):
    m = load_model(_rewrite(moe_dir, tmp_path / "sharded"))
    info = m.info("exp_up", 2)
    assert info.shape == (4, 32, 64) and info.dtype == "f32" and info.nbytes == 4 * 32 * 64 * 4
    full = m.dequantize("exp_up", 2)
    one = m.weights.base.dequantize("model.layers.2.mlp.experts.3.up_proj.weight")
    np.testing.assert_array_equal(full[3], one)
    assert not m.has("exp_up", 1) and m.has("w_up", 1)
    raw = m.weights.raw(m.file_name("exp_down", 0))
    assert raw.nbytes == info.nbytes and m.weights.members(m.file_name("exp_down", 0))[1].endswith("experts.1.down_proj.weight")


def test_missing_expert_names_file_and_tensor(moe_dir, tmp_path):
    gone = "model.layers.2.mlp.experts.1.up_proj.weight"
    d = _rewrite(moe_dir, tmp_path / "m", drop=[gone])
    msg = _one_line(lambda: load_model(d))
    assert f"tensor {gone!r} is missing" in msg and ".safetensors" in msg, msg


def test_more_experts_than_config_says(moe_dir, tmp_path):
    d = _rewrite(moe_dir, tmp_path / "m", config={"num_experts": 3})
    msg = _one_line(lambda: load_model(d))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in msg and "'num_experts'" in msg, msg
    assert "-of-00002.safetensors" in msg, msg


def test_fewer_experts_than_config_says(moe_dir, tmp_path):
    d = _rewrite(moe_dir, tmp_path / "m", config={"num_experts": 5})
    msg = _one_line(lambda: load_model(d))
    assert "tensor 'model.layers.0.mlp.experts.4.gate_proj.weight' is missing" in msg, msg


def test_router_shape_mismatch(moe_dir, tmp_path):
    bad = {"model.layers.0.mlp.gate.weight": np.zeros((3, 64), np.float32)}
    d = _rewrite(moe_dir, tmp_path / "m", replace=bad)
    msg = _one_line(lambda: load_model(d))
    assert "model.layers.0.mlp.gate.weight has shape (3, 64), expected (4, 64) (router" in msg, msg
    assert "-of-00002.safetensors" in msg, msg


def test_gguf_expert_count_disagrees_with_metadata(tmp_path):
    import gguf

    path = write_qwen3_moe_gguf(tmp_path / "m.gguf", quant="q8_0", seed=1, **MIXED)
    r = gguf.GGUFReader(path, "r+")
    r.fields["qwen3moe.expert_count"].parts[-1][0] = 5  # the file's tensors stack 4
    del r
    msg = _one_line(lambda: load_model(path))
    assert str(path) in msg and "ffn_gate_inp.weight has shape (4, 64), expected (5, 64)" in msg, msg


# --- weight memory ------------------------------------------------------------------------------


def test_weight_bytes_count_every_expert(moe_dir):
    m = load_model(moe_dir)
    wb = weight_bytes(m.graph, m.dims, m.quant, m.tensor_dtypes)
    per_layer_experts = 3 * 4 * 32 * 64 * 2  # gate, up, down x 4 experts, bf16
    assert wb.experts == 2 * per_layer_experts  # layers 0 and 2 are sparse
    assert m.weight_bytes() == sum(m.weights.info(n).nbytes for n in m.weights.base.tensor_names()
                                   if ".experts." not in n and n != "model.embed_tokens.weight") + wb.experts // 2
    in_file = sum(m.weights.info(n).nbytes for n in m.weights.base.tensor_names() if n.count(".") > 2 and ".experts." in n)
    assert wb.experts == in_file
    q4 = weight_bytes(m.graph, dims_for_size("qwen3_moe", "qwen3-30b-a3b"), m.graph.quant("q4_k_m"))
    assert 15 * 2**30 < q4.experts < 16 * 2**30  # 48 x 128 experts x 3 x 768 x 2048 x 4.5 bits
    d30 = dims_for_size("qwen3_moe", "qwen3-30b-a3b")
    bf = weight_bytes(m.graph, d30, m.graph.quant("bf16"))
    assert abs(bf.total / 2 - 30.53e9) < 0.05e9  # Qwen3-30B-A3B: 30.5 B parameters
    active = decode_read_bytes(bf, d30) / 2  # the "A3B": ~3.3 B parameters read per token, less the 0.3 B embedding
    assert 2.9e9 < active < 3.1e9, active


def test_check_fits_says_needed_and_free():
    wb = WeightBytes(experts=15 * 2**30, dense=2**30, embedding=2**29, vectors=0)
    check_fits("m.gguf", wb, free=20 * 2**30)
    msg = _one_line(lambda: check_fits("m.gguf", wb, free=12 * 2**30, reserve=2**30))
    assert msg.startswith("m.gguf: the weights need 16.50 GiB on the device (experts 15.00 GiB"), msg
    assert "17.50 GiB in all, but only 12.00 GiB is free" in msg, msg


# --- random-block GGUFs (benchmarks) and the tool's shape ----------------------------------------


@pytest.mark.parametrize("q", ["q4_k_m", "q5_k_m", "q6_k", "q8_0"])
def test_random_moe_gguf_quant_mixes(tmp_path, q):
    from fixtures.checkpoints import Dims, write_random_gguf

    from engine.reference import ReferenceRunner

    d = Dims(256, 2, 4, 2, 64, 512, 512, 1e6, 1e-6, 256, False, 4, 2, 256, True)
    m = load_model(write_random_gguf(tmp_path / f"m.{q}.gguf", "qwen3_moe", d, q))
    assert m.quant.name == q and m.tensor_dtypes["router"] == "f32"
    base = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}.get(q, q)
    assert m.tensor_dtypes["exp_gate@1"] == base and m.info("exp_up", 1).shape == (4, 256, 256)
    assert m.tensor_dtypes["exp_down@0"] == ("q6_k" if q.endswith("_m") else base)
    logits = ReferenceRunner(m, num_blocks=2, block_size=4, max_model_len=8).forward_logits([5, 6])
    assert np.isfinite(logits).all()


def test_make_checkpoint_has_the_qwen3_30b_a3b_shape():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_checkpoint", Path(__file__).parent.parent / "tools" / "make_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    family, d = mod.SHAPES["qwen3-30b-a3b"]
    want = dims_for_size("qwen3_moe", "qwen3-30b-a3b")
    assert family == "qwen3_moe"
    got = {"hidden": d.hidden_size, "layers": d.num_hidden_layers, "heads": d.num_attention_heads,
           "kv_heads": d.num_key_value_heads, "head_dim": d.head_dim, "intermediate": d.intermediate_size,
           "vocab": d.vocab_size, "experts": d.num_experts, "experts_used": d.num_experts_per_tok,
           "moe_intermediate": d.moe_intermediate_size, "norm_topk_prob": d.norm_topk_prob}
    assert got == {k: want[k] for k in got}


# --- the shared expert through a family YAML (how Qwen3-Next / Qwen3.5-MoE families use the op) ---

SHARED_FAMILY = """
family: moe_shared
extends: qwen3_moe
matches: {hf_architectures: [SharedExpertTestForCausalLM], gguf_architectures: []}
dims:
  shared_intermediate: {hf: shared_expert_intermediate_size, gguf: "{arch}.expert_shared_feed_forward_length"}
tensors:
  sh_gate: {hf: "model.layers.{i}.mlp.shared_expert.gate_proj.weight", gguf: "blk.{i}.ffn_gate_shexp.weight", kind: matrix, shape: [shared_intermediate, hidden]}
  sh_up: {hf: "model.layers.{i}.mlp.shared_expert.up_proj.weight", gguf: "blk.{i}.ffn_up_shexp.weight", kind: matrix, shape: [shared_intermediate, hidden]}
  sh_down: {hf: "model.layers.{i}.mlp.shared_expert.down_proj.weight", gguf: "blk.{i}.ffn_down_shexp.weight", kind: matrix, shape: [hidden, shared_intermediate]}
  sh_gate_inp: {hf: "model.layers.{i}.mlp.shared_expert_gate.weight", gguf: "blk.{i}.ffn_gate_inp_shexp.weight", kind: vector, shape: [hidden]}
graph_edits:
  - replace: {op: moe_experts}
    with: {op: moe_experts, in: [h, expert_ids, expert_weights], weight: [exp_gate, exp_up, exp_down, sh_gate, sh_up, sh_down, sh_gate_inp], out: x, residual: x, when: sparse_mlp}
"""


def test_shared_expert_wiring_through_yaml(moe_dir, tmp_path, monkeypatch):
    from engine import paths
    from engine.ops import REFERENCE
    from engine.ops_ref_moe import moe_experts, sigmoid, swiglu_ffn
    from engine.reference import ReferenceRunner

    root = tmp_path / "models"
    shutil.copytree(paths.models_dir(), root)
    (root / "moe_shared.yaml").write_text(SHARED_FAMILY)
    monkeypatch.setattr(paths, "models_dir", lambda: root)
    rng = np.random.default_rng(4)
    extra = {}
    for i in (0, 2):  # the sparse layers
        p = f"model.layers.{i}.mlp."
        extra[p + "shared_expert.gate_proj.weight"] = rng.standard_normal((24, 64)).astype(np.float32) * 0.2
        extra[p + "shared_expert.up_proj.weight"] = rng.standard_normal((24, 64)).astype(np.float32) * 0.2
        extra[p + "shared_expert.down_proj.weight"] = rng.standard_normal((64, 24)).astype(np.float32) * 0.2
        extra[p + "shared_expert_gate.weight"] = rng.standard_normal((1, 64)).astype(np.float32) * 0.2  # HF [1, H]
    cfg = {"architectures": ["SharedExpertTestForCausalLM"], "shared_expert_intermediate_size": 24}
    m = load_model(_rewrite(moe_dir, tmp_path / "ckpt", replace=extra, config=cfg))
    assert m.graph.family == "moe_shared" and m.quant.name == "f32"
    seen = []
    real = REFERENCE["moe_experts"]

    def spy(step, op, layer):
        h, ids, w = (step.env[n] for n in op.inputs)
        before = step.env["x"].copy()
        real(step, op, layer)
        seen.append((layer, h, ids, w, before, step.env["x"].copy()))

    monkeypatch.setitem(REFERENCE, "moe_experts", spy)
    ReferenceRunner(m, num_blocks=4, block_size=4, max_model_len=16).forward_logits([5, 9, 11, 3])
    assert [s[0] for s in seen] == [0, 2]
    for layer, h, ids, w, before, after in seen:
        p = f"model.layers.{layer}.mlp."
        sg, su, sd, gi = (extra[p + n] for n in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                                                   "shared_expert.down_proj.weight", "shared_expert_gate.weight"))
        routed = moe_experts(h, ids, w, m.dequantize("exp_gate", layer), m.dequantize("exp_up", layer),
                             m.dequantize("exp_down", layer), residual=before)
        shared = sigmoid(h @ gi[0])[:, None] * swiglu_ffn(h, sg, su, sd)
        np.testing.assert_allclose(after, routed + shared, rtol=1e-5, atol=1e-6)
        assert np.abs(shared).max() > 0.05 * np.abs(routed - before).max()


def test_gguf_names_are_the_gguf_packages():
    """The family's GGUF metadata keys and tensor names are gguf's own constants for qwen3moe."""
    import gguf

    g = graph.load_family("qwen3_moe")
    keys = gguf.Keys.LLM
    assert g.dims["experts"].gguf == keys.EXPERT_COUNT
    assert g.dims["experts_used"].gguf == keys.EXPERT_USED_COUNT
    assert g.dims["moe_intermediate"].gguf == keys.EXPERT_FEED_FORWARD_LENGTH
    assert g.dims["norm_topk_prob"].gguf == keys.EXPERT_WEIGHTS_NORM
    arch = gguf.MODEL_ARCH.QWEN3MOE
    assert gguf.MODEL_ARCH_NAMES[arch] in g.gguf_architectures
    names = {gguf.TENSOR_NAMES[t].replace("{bid}", "{i}") + ".weight" for t in gguf.MODEL_TENSORS[arch]}
    names |= {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}  # token_embd etc. name the tensor whole
    ours = {t.gguf for t in g.tensors.values() if t.gguf}
    dense_mlp = {"blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight", "blk.{i}.ffn_down.weight"}  # mlp_only_layers
    assert ours - dense_mlp <= names, sorted(ours - dense_mlp - names)
    for key in ("router", "exp_gate", "exp_up", "exp_down"):
        assert g.tensors[key].gguf in names
