"""CudaRunner features on a real GPU (skipped without one), on the tiny random Llama of
test_runner_cuda: penalties applied on the GPU equal engine.sampling's, several prefill sequences
in one pass equal one pass each, and a step mixing prefill chunks and decode rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from runner_harness import GREEDY, tiny_llama_runner
from runner_harness import rel as _rel

from engine.sampling import apply_penalties
from engine.types import SamplingParams, StepItem


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    r = tiny_llama_runner(tmp_path_factory.mktemp("tiny-llama-features"))
    yield r
    r.close()


@pytest.mark.parametrize("use_graphs", [True, False])
def test_gpu_penalties_equal_the_numpy_penalties(runner, use_graphs):
    runner.use_graphs = use_graphs
    rng = np.random.default_rng(11)
    vocab = runner.plan.values["logits"].width
    prompt = [int(t) for t in rng.integers(1, vocab, 20)]
    hist = prompt + [int(t) for t in rng.integers(1, vocab, 6)]
    table = [40, 41]
    runner.step([StepItem(0, hist[:-1], 0, table, False, GREEDY)])
    plain = StepItem(0, [hist[-1]], len(hist) - 1, table, True, GREEDY, hist, 20, 6)
    runner.step([plain])
    base = runner.read_logits(1)[0]
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4
    )
    tok = runner.step([StepItem(0, [hist[-1]], len(hist) - 1, table, True, params, hist, 20, 6)])[0]
    want = apply_penalties(base, params, hist, 20)
    np.testing.assert_allclose(runner.read_logits(1)[0], want, rtol=1e-5, atol=1e-5)
    assert tok == int(np.argmax(want))


def test_several_prefill_sequences_in_one_pass_equal_one_pass_each(runner):
    rng = np.random.default_rng(5)
    vocab = runner.plan.values["logits"].width
    prompts = [[int(t) for t in rng.integers(1, vocab, n)] for n in (9, 33, 2)]
    tables = [[60 + 4 * i + j for j in range(4)] for i in range(3)]
    alone = []
    for p, t in zip(prompts, tables, strict=True):
        alone.append((runner.step([StepItem(0, p, 0, t, True, GREEDY)])[0], runner.read_logits(1)[0]))
    ids = runner.step(
        [StepItem(i, p, 0, t, True, GREEDY) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    )
    assert ids == [a[0] for a in alone]
    if runner._varlen:  # one pass, one head over the three finished rows (else one pass each)
        logits = runner.read_logits(3)
        for i in range(3):
            assert _rel(logits[i], alone[i][1]) < 1e-2


def test_a_step_mixing_prefill_and_decode_matches_separate_steps(runner):
    rng = np.random.default_rng(8)
    vocab = runner.plan.values["logits"].width
    a = [int(t) for t in rng.integers(1, vocab, 12)]
    b = [int(t) for t in rng.integers(1, vocab, 7)]
    ta, tb = [90, 91], [92, 93]
    first = runner.step([StepItem(0, a, 0, ta, True, GREEDY)])[0]
    dec_alone = runner.step([StepItem(0, [first], len(a), ta, True, GREEDY)])[0]
    pre_alone = runner.step([StepItem(1, b, 0, tb, True, GREEDY)])[0]
    mixed = runner.step([StepItem(1, b, 0, tb, True, GREEDY), StepItem(0, [first], len(a), ta, True, GREEDY)])
    assert mixed == [pre_alone, dec_alone]
