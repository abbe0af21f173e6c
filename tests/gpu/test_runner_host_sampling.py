"""CudaRunner steps the host sampler finishes (issue #39): a step with a row asking for logprobs is
sampled on the host from its logits by engine.sampling.sample_item (with that row's logit bias and
constraint mask, and those of the other host rows of the step), in decode steps (graphs on and off)
and at the end of a prefill, while the other rows keep the device sampler's ids. (Bias and masks
without logprobs run on the device: test_runner_token_mask.py.) Skipped without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.sampling import token_logprobs, unpack_mask
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_runner_cuda import write_tiny_llama

    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    path = tmp_path_factory.mktemp("tiny-llama-host-sampling")
    write_tiny_llama(path)
    r = CudaRunner(load_model(path), num_blocks=256, max_model_len=1024)
    yield r
    r.close()


def _pack(allowed, vocab):
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("use_graphs", [True, False])
def test_host_rows_beside_device_rows(runner, use_graphs):
    runner.use_graphs = use_graphs
    rng = np.random.default_rng(5)
    vocab = runner.plan.values["logits"].width
    prompts = [[int(t) for t in rng.integers(1, vocab, 12)] for _ in range(3)]
    tables = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    for p, t in zip(prompts, tables, strict=True):
        runner.step([StepItem(0, p, 0, t, False, GREEDY)])
    allowed = {3, 17, 101}
    items = [
        StepItem(0, [prompts[0][-1]], 12, tables[0], True, GREEDY, prompts[0], 12, 0),
        StepItem(1, [prompts[1][-1]], 12, tables[1], True, SamplingParams(temperature=0.0, logprobs=4), prompts[1], 12, 0,
                 allowed=_pack(allowed, vocab)),
        StepItem(2, [prompts[2][-1]], 12, tables[2], True, SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
                 prompts[2], 12, 0),
    ]
    toks = runner.step(items)
    logits = runner.read_logits(3)
    assert toks[0] == int(np.argmax(logits[0]))
    masked = np.where(unpack_mask(_pack(allowed, vocab), vocab), logits[1], -np.inf)
    assert toks[1] == int(np.argmax(masked)) and toks[1] in allowed
    lp, top = items[1].logprobs_out
    want_lp, want_top = token_logprobs(logits[1], toks[1], 4)
    assert lp == pytest.approx(want_lp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in want_top]
    assert toks[2] == 7


def test_prefill_head_on_the_host(runner):
    vocab = runner.plan.values["logits"].width
    prompt = list(range(5, 25))
    item = StepItem(0, prompt, 0, [50, 51], True, SamplingParams(temperature=0.0, logprobs=0), prompt, 20, 0,
                    allowed=_pack({11, 12}, vocab))
    tok = runner.step([item])[0]
    assert tok in (11, 12) and item.logprobs_out is not None and item.logprobs_out[1] == []
