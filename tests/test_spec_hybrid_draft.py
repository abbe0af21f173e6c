"""A hybrid draft model (recurrent layers) in the draft-model proposer, on the numpy reference: the
draft's recurrent state is rolled back to what the target accepted (snapshots after each drafted
token in the proposer's slot pool), so after any accepted length its drafts are exactly the greedy
continuation a fresh run of the draft model gives; greedy with a hybrid draft == plain greedy on a
hybrid target, solo and batched; slots all back at the end."""

from __future__ import annotations

import pytest
from fixtures.engine_waves import serve_waves, tokens_of
from fixtures.hybrid import write_qwen3_5_hf

from engine.bench import NullTokenizer
from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.spec.draft import DraftModelProposer
from engine.spec.proposer import ProposeRequest
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid-draft")
    return load_model(write_qwen3_5_hf(d / "a", seed=3)), load_model(write_qwen3_5_hf(d / "b", seed=4))


def test_drafts_after_every_accepted_length_are_a_fresh_runs(models):
    target, _ = models
    proposer = DraftModelProposer(ReferenceRunner(target, num_blocks=64, max_model_len=256, state_slots=8))
    assert proposer.hybrid and len(proposer._snap_free) == 4
    fresh = ReferenceRunner(target, num_blocks=64, max_model_len=256, state_slots=2)
    seq = [5, 17, 99, 3, 64, 64, 12, 101]
    for step in range(12):
        k = 4 if step % 3 else 3
        drafts = proposer.propose([ProposeRequest(0, list(seq), k, GREEDY)])[0].tokens
        assert len(drafts) == k
        assert drafts == fresh.generate(seq, k), step
        j = step % (k + 1)  # the target accepts j drafts, then emits a token of its own
        seq += drafts[:j] + [(drafts[j] + 1) % 384 if j < k else 7]
    proposer.release(0)
    assert len(proposer._snap_free) == 4 and proposer.blocks.num_state_live == 0


def test_a_recompute_without_a_snapshot_starts_the_row_over(models):
    """Called twice with the same tokens (a preempted sequence recomputed): the rollback point has
    no snapshot, so the row starts over, and its drafts are still a fresh run's."""
    target, _ = models
    proposer = DraftModelProposer(ReferenceRunner(target, num_blocks=64, max_model_len=256, state_slots=4))
    fresh = ReferenceRunner(target, num_blocks=64, max_model_len=256, state_slots=2)
    seq = [9, 8, 7, 6, 5]
    first = proposer.propose([ProposeRequest(0, seq, 2, GREEDY)])[0].tokens
    assert first == fresh.generate(seq, 2)
    assert proposer.propose([ProposeRequest(0, seq, 2, GREEDY)])[0].tokens == first


def _generate(runner, prompts, speculator):
    outs, stats = serve_waves(runner, [prompts], max_tokens=16, speculator=speculator, tokenizer=NullTokenizer())
    return tokens_of(outs), stats


@pytest.mark.parametrize("which", ["self", "other"])
def test_greedy_with_a_hybrid_draft_equals_plain_greedy(models, which):
    from engine.spec.config import SpecConfig
    from engine.spec.speculator import Speculator

    target, other = models
    runner = ReferenceRunner(target, num_blocks=64, max_model_len=256, state_slots=16)
    prompts = [[5, 17, 99, 3, 64, 64, 12], [40, 41, 42] * 3]
    plain = [runner.generate(p, 16) for p in prompts]
    draft_model = target if which == "self" else other
    proposer = DraftModelProposer(ReferenceRunner(draft_model, num_blocks=64, max_model_len=256, state_slots=8))
    spec = Speculator(proposer, SpecConfig("draft", "x", k=3))
    out, stats = _generate(runner, prompts, spec)
    assert out == plain
    assert stats.spec_verify_rows > 0
    if which == "self":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert not proposer._rows and proposer.blocks.num_state_live == 0 and len(proposer._snap_free) == 4
