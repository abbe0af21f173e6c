"""ReferenceRunner on the real SmolLM2-135M-Instruct Q4_1 GGUF: golden logits, transformers, a chat answer.

The golden file (tests/golden/smollm2_logits.npz, made by tools/make_golden.py from transformers)
is checked always; the live transformers comparison runs where torch+transformers+accelerate
import. The model comes from conftest's ``smollm2_path`` (skipped when it cannot be had).
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
GOLDEN = REPO / "tests" / "golden" / "smollm2_logits.npz"


@pytest.fixture(scope="module")
def smol(smollm2_path):
    path = smollm2_path
    model = load_model(path)
    return path, model, ReferenceRunner(model, max_model_len=256)


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def check_against(golden, logits) -> None:
    rows = golden["full_positions"]
    assert rel_err(logits[rows], golden["full_logits"]) < 1e-4
    top = np.take_along_axis(logits, golden["top_ids"].astype(np.int64), axis=1)
    assert rel_err(top, golden["top_logits"]) < 1e-4
    np.testing.assert_array_equal(logits.argmax(axis=1), golden["top_ids"][:, 0])


def test_golden_file_is_small_and_complete():
    assert GOLDEN.stat().st_size < 1_000_000
    g = np.load(GOLDEN)
    n = len(g["token_ids"])
    assert g["top_ids"].shape == g["top_logits"].shape == (n, 64)
    assert g["full_logits"].shape[0] == len(g["full_positions"])


def test_logits_match_golden(smol):
    _, _, runner = smol
    g = np.load(GOLDEN)
    check_against(g, runner.forward_logits(g["token_ids"].tolist()))


@pytest.mark.slow
@pytest.mark.long  # (transformers dequantising the GGUF: in .ci/run's long step; test_logits_match_golden stays in README's run)
def test_logits_match_live_transformers(smol):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    path, _, runner = smol
    live = load_tool("make_golden").golden_from_transformers(path)
    check_against(live, runner.forward_logits(live["token_ids"].tolist()))


def test_greedy_chat_answers_paris(smol):
    from engine.tokenizer import load_tokenizer

    _, model, runner = smol
    tok = load_tokenizer(model.weights)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert "<|im_start|>assistant" in text  # ChatML
    ids = tok.encode(text)
    out = runner.generate(ids, 12, SamplingParams(temperature=0.0), stop_token_ids=sorted(tok.eos_token_ids))
    answer = tok.decode(out)
    assert "Paris" in answer, answer
