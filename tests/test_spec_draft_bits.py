"""The draft-model proposer computes every position the way the target computed it (issue #38: a
self-draft of SmolLM2 on an H100 was accepted 147 of 166 times because it ran the row's first
generated token, and the first draft, in its prompt's prefill pass while the target ran it as a
decode row). On ``fixtures.path_bits.PathBitsRunner``, whose tokens change with the path (prefill
pass or decode row) that computed each position, as a GPU's bits do at a near tie: the target as
its own draft is accepted whole, batched, over a warm prefix cache, chunked prompts and a prompt
whose last token a prefix hit leaves alone (the prompts' last tokens run as decode rows cold and
warm, engine.runner_tail, so a warm prompt gives the cold run's tokens); catch-ups past MAX_DECODE_CATCHUP run as one prefill chunk (one pass, not a step a
token)."""

from __future__ import annotations

import pytest
from fixtures.engine_waves import serve_waves, tokens_of
from fixtures.path_bits import DECODE, PREFILL, PathBitsRunner

from engine.spec.config import SpecConfig
from engine.spec.draft import MAX_DECODE_CATCHUP, DraftModelProposer, catchup_chunks
from engine.spec.proposer import ProposeRequest
from engine.spec.speculator import Speculator
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
BS = 4
# prompt lengths: 4m + 1 (a warm hit leaves its last token to a decode row), 4m + 3, a long one
# over two prefill chunks, and 1
PROMPTS = [[(7 * i + 3) % 120 + 2 for i in range(n)] for n in (9, 23, 90, 1)]


def _spec(draft: PathBitsRunner, k: int = 4) -> Speculator:
    return Speculator(DraftModelProposer(draft), SpecConfig("draft", "self", k=k))


def _waves(runner, waves, speculator=None, max_tokens=24, **kw):
    return serve_waves(runner, waves, max_tokens=max_tokens, vocab_size=128, speculator=speculator,
                       prefill_chunk_tokens=32, **kw)


def test_self_draft_is_accepted_whole_cold_and_warm():
    """Two waves of the same prompts through one engine: the second hits the prefix cache the first
    wrote (so does the long prompt in the first: the prompts share their first tokens); the 9-token
    prompt's hit leaves its last token alone, a decode row as in the cold run. Both waves give the
    cold tokens."""
    target = PathBitsRunner(block_size=BS, chunk=48)
    cold = [target.greedy(p, 24) for p in PROMPTS]
    draft = PathBitsRunner(block_size=BS, chunk=48)
    outs, stats = _waves(target, [PROMPTS, PROMPTS], _spec(draft))
    # (the prompts share their first tokens; a warm hit takes the trailing partial block but the
    # last token too, engine.partial_blocks: the 23- and 90-token prompts)
    assert [c for _, c in outs] == [0, 0, 20, 0, 8, 22, 89, 0]
    assert tokens_of(outs) == cold + cold
    assert stats.spec_draft_tokens > 100
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    # the draft ran the prompt but its tail (its last token, where it does not end on a block
    # boundary) in prefill passes, the tail and every generated position as decode rows, as the
    # target did (engine.runner_tail)
    for runner in (draft, target):
        for seq, pos, path in runner.paths:
            n = len(PROMPTS[seq % 4])
            assert path == (PREFILL if pos < runner.tail_start(n) else DECODE), (seq, pos)


def test_self_draft_solo_equals_batched():
    target = PathBitsRunner(block_size=BS, chunk=48)
    draft = PathBitsRunner(block_size=BS, chunk=48)
    spec = _spec(draft, k=3)
    outs, stats = _waves(target, [[p] for p in PROMPTS], spec, enable_prefix_cache=False)
    assert tokens_of(outs) == [target.greedy(p, 24) for p in PROMPTS]
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


def test_catchup_chunks():
    assert catchup_chunks([1, 2, 3, 4, 5], 0, 4) == [[1, 2, 3, 4], [5]]  # first call: prompt, then t1
    assert catchup_chunks([1, 2, 3, 4], 0, 4) == [[1, 2, 3], [4]]  # the prompt's last token as a decode row
    assert catchup_chunks([1, 2, 3, 4, 5], 0, 0) == [[1, 2, 3, 4], [5]]  # prompt length unknown
    assert catchup_chunks([8, 9], 30, 4) == [[8], [9]]
    assert catchup_chunks([7], 0, 0) == [[7]]
    gen = list(range(MAX_DECODE_CATCHUP))
    assert catchup_chunks([1, 2, *gen], 8, 10) == [[1, 2], *([t] for t in gen)]
    assert catchup_chunks([1, 2, 3, *gen], 8, 10) == [[1, 2, 3, *gen[:-1]], [gen[-1]]]  # too long: one pass


@pytest.mark.parametrize("gap", [1, 2, 5, MAX_DECODE_CATCHUP + 3, MAX_DECODE_CATCHUP + 4])
def test_drafts_after_a_catch_up_are_the_targets_tokens(gap):
    """The target emitted ``gap`` tokens since the first draft call (whose 3 drafted inputs the draft
    ran): a catch-up of up to MAX_DECODE_CATCHUP new tokens runs as decode rows and the drafts are
    the target's greedy tokens; past it the catch-up is one prefill pass but its last token (fewer
    draft steps) and the drafts then follow the other bits."""
    target = PathBitsRunner(block_size=BS)
    prompt = PROMPTS[1]
    want = target.greedy(prompt, 60)
    draft = PathBitsRunner(block_size=BS)
    proposer = DraftModelProposer(draft)
    seq = [*prompt, want[0]]
    first = proposer.propose([ProposeRequest(0, list(seq), 4, GREEDY, len(prompt))])[0].tokens
    assert first == want[1:5]
    seq = [*prompt, *want[: 1 + gap]]
    steps = len(draft.paths)
    drafts = proposer.propose([ProposeRequest(0, list(seq), 4, GREEDY, len(prompt))])[0].tokens
    if gap - 3 <= MAX_DECODE_CATCHUP:  # (new tokens: the gap less the 3 drafted inputs kept)
        assert drafts == want[1 + gap : 5 + gap]
    else:
        assert drafts != want[1 + gap : 5 + gap]
        assert sum(1 for *_, p in draft.paths[steps:] if p == PREFILL) == gap - 4
