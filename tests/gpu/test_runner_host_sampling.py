"""CudaRunner rows asking for logprobs (issue #39), on the device (the logprobs kernel after the
sampler, from a raw copy of the row's logits) and, once a step has more such rows than the device's
slots (engine.ir.LP_SLOTS, patched to 0 here), on the host from the step's logits by
engine.sampling.sample_item, in decode steps (graphs on and off) and at the end of a prefill; the
other rows of the same step keep the device sampler's ids, masks and bias. Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.engine_probes import unpack_mask
from runner_harness import tiny_llama_runner

import engine.runner_steps as rs
from engine.runner_tail import tail_count, whole_block_tails
from engine.sampling import token_logprobs
from engine.spec.cuda_verify import narrow_rows
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    r = tiny_llama_runner(tmp_path_factory.mktemp("tiny-llama-host-sampling"))
    yield r
    r.close()


@pytest.fixture(params=["device", "host"])
def where(request, monkeypatch):
    if request.param == "host":
        monkeypatch.setattr(rs, "LP_SLOTS", 0)
    return request.param


def _pack(allowed, vocab):
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("use_graphs", [True, False])
def test_logprobs_rows_beside_device_rows(runner, use_graphs, where):
    runner.use_graphs = use_graphs
    rng = np.random.default_rng(5)
    vocab = runner.plan.values["logits"].width
    prompts = [[int(t) for t in rng.integers(1, vocab, 12)] for _ in range(3)]
    tables = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    for p, t in zip(prompts, tables, strict=True):
        runner.step([StepItem(0, p, 0, t, False, GREEDY)])

    def items(params, allowed=None):
        return [StepItem(i, [prompts[i][-1]], 12, tables[i], True, params[i], prompts[i], 12, 0, allowed=allowed[i])
                for i in range(3)]

    runner.step(items([GREEDY] * 3, [None] * 3))
    raw = runner.read_logits(3)  # the same step's logits, nothing applied
    allowed = {3, 17, 101}
    step = items(
        [GREEDY, SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))],
        [None, _pack(allowed, vocab), None],
    )
    toks = runner.step(step)
    assert toks[0] == int(np.argmax(raw[0]))
    masked = np.where(unpack_mask(_pack(allowed, vocab), vocab), raw[1], -np.inf)
    assert toks[1] == int(np.argmax(masked)) and toks[1] in allowed
    lp, top = step[1].logprobs_out  # of the raw logits, whichever side computed them
    want_lp, want_top = token_logprobs(raw[1], toks[1], 4)
    assert lp == pytest.approx(want_lp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in want_top]
    np.testing.assert_allclose([v for _, v in top], [v for _, v in want_top], atol=1e-4)
    assert toks[2] == 7


def test_prefill_head_logprobs(runner, where):
    vocab = runner.plan.values["logits"].width
    prompt = list(range(5, 25))
    item = StepItem(0, prompt, 0, [50, 51], True, SamplingParams(temperature=0.0, logprobs=0), prompt, 20, 0,
                    allowed=_pack({11, 12}, vocab))
    tok = runner.step([item])[0]
    assert tok in (11, 12) and item.logprobs_out is not None and item.logprobs_out[1] == []
    plain = StepItem(0, prompt, 0, [50, 51], True, GREEDY, prompt, 20, 0)
    runner.step([plain])
    tail = tail_count(plain, runner.block_size, whole_block_tails(runner))  # (decode rows, in passes of `limit`)
    limit = min(narrow_rows(runner.plan, runner._max_rows), runner._max_rows)
    head = (tail - 1) % limit if tail else 0  # the last pass's row of the prompt's last token
    logits = runner.read_logits(head + 1)[head]
    assert item.logprobs_out[0] == pytest.approx(token_logprobs(logits, tok, 0)[0], abs=1e-4)
