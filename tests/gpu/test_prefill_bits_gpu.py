"""Whether a prompt's bits depend on how its prefill was cut, on a real GPU (skipped without one;
issue #38: a self-draft is accepted whole only where it computes each position with the target's
bits; the brief's "greedy output reproducible, batched equal to solo"; issue #36's "a hit's output
equals the uncached run's"). SmolLM2-135M-Instruct Q4_1 (h100 / h200 profile: prefill passes of
256 rows and more dequantise the weights for the wgmma GEMM, shorter ones decode them in the gemm
kernel's tile loads), each case comparing the first token's logits and six greedy decode steps'
(np.array_equal of the f32 logits, so the KV the prefill wrote is compared too):

* a prompt packed with another one in one pass equals the prompt alone (both passes below 256 rows;
  and, as its own case, a packed pass of 256 rows or more, across the GEMM switch);
* a prefix-cache hit's tail (1 .. 16 tokens, one pass over the cached blocks; a prompt's last
  token runs as a decode row in both, engine.runner_tail, the tokens before it and a whole last
  block as a prefill) equals the cold pass, below and across the switch (a 300-token cold pass,
  299 prefill rows, against its 12-token tail, 11 prefill rows: the prefill KV of a position does
  not depend on the pass it ran in, which the partial-block copies, engine.partial_blocks, and
  the full blocks' rely on).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.runner_tail import tail_count, whole_block_tails
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
STEPS = 6


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    r = CudaRunner(load_model(smollm2_path), num_blocks=1024, max_model_len=2048)
    yield r
    r.close()


class Tables:
    """Fresh block ranges for each sequence (blocks are never reused within the module)."""

    used = 0

    @classmethod
    def take(cls, n: int) -> list[int]:
        cls.used += n
        return list(range(cls.used - n, cls.used))


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 40000, n)]


def run(runner, items: list[StepItem], seq: int) -> list[np.ndarray]:
    """Run ``items`` in one step; then STEPS greedy decode steps of the item of sequence ``seq``
    alone: its head logits and each step's."""
    heads = [j for j, it in enumerate(items) if it.sample]  # (a prefill pass's head rows, in item order)
    toks = runner.step(items)
    i = [items[j].seq_id for j in heads].index(seq)
    it = items[heads[i]]
    tails = [tail_count(items[j], runner.block_size, whole_block_tails(runner)) for j in heads]
    if any(tails):  # the prompts' last tokens ran last, as decode rows of one pass
        logits = runner.read_logits(sum(tails))  # (engine.runner_tail): the item's last row samples
        row = sum(tails[: i + 1]) - 1
    else:
        logits, row = runner.read_logits(len(heads)), i
    out, tok, pos = [logits[row].copy()], toks[heads[i]], it.start_pos + len(it.token_ids)
    for _ in range(STEPS):
        tok = runner.step([StepItem(seq, [tok], pos, it.block_table, True, GREEDY)])[0]
        out.append(runner.read_logits(1)[0].copy())
        pos += 1
    return out


def cold(runner, prompt: list[int], seq: int, others: list[list[int]] = ()) -> list[np.ndarray]:
    blocks = (len(prompt) + STEPS) // 16 + 1
    items = [StepItem(seq, prompt, 0, Tables.take(blocks), True, GREEDY, prompt_len=len(prompt))]
    for j, p in enumerate(others):
        items.append(StepItem(seq + 100 + j, p, 0, Tables.take(len(p) // 16 + 1), True, GREEDY, prompt_len=len(p)))
    return run(runner, items, seq)


def compare(a: list[np.ndarray], b: list[np.ndarray]) -> str:
    """'' when every row is bit-identical, else which rows differ and by how much."""
    bad = [(i, float(np.max(np.abs(x - y))), int(x.argmax()) == int(y.argmax()))
           for i, (x, y) in enumerate(zip(a, b, strict=True)) if not np.array_equal(x.view(np.uint32), y.view(np.uint32))]
    return "" if not bad else "rows differ (row, max |diff|, same argmax): " + ", ".join(map(str, bad))


@pytest.mark.parametrize("other", [120, 200], ids=["pass-220-rows", "pass-300-rows"])
def test_a_prompt_packed_with_another_equals_it_alone(runner, other):
    prompt = prompt_of(100, 1)
    alone = cold(runner, prompt, 1)
    packed = cold(runner, prompt, 2, [prompt_of(other, 2)])
    assert not (msg := compare(alone, packed)), msg


@pytest.mark.parametrize(("hit", "tail"), [(96, 1), (96, 2), (96, 7), (96, 16), (288, 12)])
def test_a_warm_tail_equals_the_cold_pass(runner, hit, tail):
    prompt = prompt_of(hit + tail, 3 + hit + tail)
    ref = cold(runner, prompt, 10)
    table = Tables.take((hit + tail + STEPS) // 16 + 1)
    runner.step([StepItem(11, prompt[:hit], 0, table, False, GREEDY)])  # the cached blocks: another pass
    warm = run(runner, [StepItem(12, prompt[hit:], hit, table, True, GREEDY, prompt_len=hit + tail)], 12)
    assert not (msg := compare(ref, warm)), msg
