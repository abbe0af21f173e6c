"""Warm == cold bits with the chunked gated delta rule, on the CPU: the engine (scheduler, block
manager, prefix cache) over tests/fixtures/delta_emu_runner.py, whose layer is the real
gated_delta_chunk (prefill) and gated_delta_rule (decode) kernels run by the emulator, with
CudaRunner's pass packing. A prompt repeated, or extended, resumes from a block-boundary snapshot
and must give the uncached run's bits at every position it computes and the same generated
tokens; with scheduler chunks (prefill_chunk_tokens) and runner passes that do not fall on the
chunk grid, several sequences per pass, ragged and whole tails. The control: the same engine with
its cuts off the grid (state_align 1) diverges, so the check can fail. The GPU's end-to-end check
is tests/gpu/test_hybrid_runner.py (test_prefix_cache_*)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.delta_emu_runner import DeltaEmuRunner
from fixtures.engine_waves import serve_waves, tokens_of


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("delta_emu")


def _prompt(seed: int, n: int, vocab: int = 97) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _check(runner: DeltaEmuRunner) -> None:
    assert runner.recomputed > 0, "no position was computed twice: nothing compared"
    assert not runner.mismatches, runner.mismatches[:5]


@pytest.mark.parametrize(
    "lens,chunk,step,pass_tokens,block",
    [
        ((200, 100), 65, 512, 45, 16),  # a ragged tail (hit 192 of 200); scheduler and pass cuts off the grid
        ((208, 37), 69, 512, 1000, 16),  # a whole last block (the hit stops a block short: 192 of 208)
        ((150, 90), 512, 100, 64, 16),  # the step budget cuts (decode rows beside prefill)
        ((200, 100), 75, 512, 50, 32),  # blocks of 32: chunks of 32
    ],
)
def test_repeated_prompt_resumes_with_the_cold_bits(workdir, lens, chunk, step, pass_tokens, block):
    runner = DeltaEmuRunner(workdir, pass_tokens=pass_tokens, block_size=block)
    assert runner.state_align == block == runner.chunk.spec.params["chunk"]
    a, b = _prompt(1, lens[0]), _prompt(2, lens[1])
    kw = dict(prefill_chunk_tokens=chunk, max_step_tokens=step, max_tokens=6, vocab_size=97)
    cold, _ = serve_waves(runner, [[a, b]], enable_prefix_cache=False, **kw)
    warm, stats = serve_waves(runner, [[a, b], [a, b]], **kw)
    bs = runner.block_size
    assert [c for _, c in warm] == [0, 0, ((lens[0] - 1) // bs) * bs, ((lens[1] - 1) // bs) * bs]
    assert tokens_of(warm) == tokens_of(cold) * 2
    _check(runner)
    # every pass that did not end its sequence's prompt ended on the grid
    cuts = [p + n for ps in runner.passes for p, n in ps]
    ends = {lens[0], lens[1]}
    assert all(c % block == 0 or c in ends for c in cuts), sorted(set(cuts) - ends)


def test_an_extended_prompt_resumes_with_the_cold_bits(workdir):
    """A second turn (the first prompt + 70 tokens) hits the first one's tail snapshot and runs the
    rest as the uncached second turn does, cut by a small scheduler chunk."""
    runner = DeltaEmuRunner(workdir, pass_tokens=40)
    a = _prompt(3, 203)
    b = a + _prompt(4, 70)
    kw = dict(prefill_chunk_tokens=53, max_step_tokens=512, max_tokens=5, vocab_size=97)
    cold, _ = serve_waves(runner, [[b]], enable_prefix_cache=False, **kw)
    warm, _ = serve_waves(runner, [[a], [b]], **kw)
    assert warm[1][1] == 192 and warm[1][0] == cold[0][0]
    _check(runner)


def test_off_grid_cuts_break_warm_equals_cold(workdir):
    """The control: scheduler chunks of 65 cut the cold run at 195, inside the block the warm run
    resumes at (192); with the cuts off the grid the state after the prompt (position 199) and
    after every decode step differ (the bf16 outputs happen to round alike here)."""
    runner = DeltaEmuRunner(workdir, pass_tokens=1000, align=1)
    a = _prompt(1, 200)
    kw = dict(prefill_chunk_tokens=65, max_step_tokens=512, max_tokens=4, vocab_size=97)
    serve_waves(runner, [[a]], enable_prefix_cache=False, **kw)
    serve_waves(runner, [[a], [a]], **kw)
    assert [p for _, p in runner.mismatches] == [199, 200, 201, 202]


def test_a_repeated_1000_token_prompt_hits_992_with_the_cold_bits(workdir):
    """Issue #36's check at the delta-rule layer, in the waves of tests/gpu/test_hybrid_runner.py's
    test_a_repeated_1000_token_prompt_hits_992_with_the_uncached_bits (its slots, blocks and
    scheduler chunks): cached_tokens 992 of 1,000, a second prompt alongside, a longer second turn
    resumed at 592 of its shared 600."""
    from fixtures.hybrid_case import prompt

    runner = DeltaEmuRunner(workdir, pass_tokens=2048, num_blocks=256, state_slots=64, vocab=384)
    long, other = prompt(41, 1000), prompt(42, 230)
    turn2 = long[:600] + prompt(43, 150)
    kw = dict(prefill_chunk_tokens=300, max_step_tokens=512, max_tokens=12, vocab_size=384)
    cold, _ = serve_waves(runner, [[long, other], [turn2]], enable_prefix_cache=False, **kw)
    warm, _ = serve_waves(runner, [[long, other], [long, other], [turn2]], **kw)
    assert [c for _, c in warm] == [0, 0, 992, 224, 592]
    assert tokens_of(warm) == [cold[0][0], cold[1][0], cold[0][0], cold[1][0], cold[2][0]]
    _check(runner)
