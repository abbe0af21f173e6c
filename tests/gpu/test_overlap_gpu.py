"""Overlapped decode steps on a real GPU (skipped without one): CudaRunner.launch / collect chains
give the very ids synchronous steps give (greedy and seeded sampling, graphs and eager), and the
Engine with ``overlap`` on streams the same events as with it off, frees every KV block, and
survives aborts while a step is in flight (engine.runner_overlap, engine.loop_overlap).

Timing (not a test): ``memra bench MODEL --skip-runner --concurrency 1,8,32 --overlap`` against
``--no-overlap`` on the same machine."""

from __future__ import annotations

import random

import pytest
from fixtures.fake_runner import FakeTokenizer
from test_runner_cuda import DIMS, write_tiny_llama

from engine.types import GenerationRequest, SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from engine.model import load_model

    path = tmp_path_factory.mktemp("tiny-llama-overlap")
    write_tiny_llama(path, seed=5)
    return load_model(path)


@pytest.fixture(scope="module", params=[True, False], ids=["graphs", "eager"])
def runner(request, model):
    from engine.runner_cuda import CudaRunner

    r = CudaRunner(model, num_blocks=256, max_model_len=1024, use_graphs=request.param)
    yield r
    r.close()


def _samplings(n):
    return [GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77 + i) for i in range(n)]


def _decode_chain(runner, prompts, steps, overlap, block0):
    """Prefill every prompt (synchronous), then ``steps`` decode steps of all rows; returns each
    row's generated ids. Tables: 8 blocks per row from ``block0``."""
    n = len(prompts)
    sps = _samplings(n)
    tables = [list(range(block0 + 8 * i, block0 + 8 * i + 8)) for i in range(n)]
    first = runner.step([StepItem(i, p, 0, tables[i], True, sps[i], history=p, prompt_len=len(p))
                         for i, p in enumerate(prompts)])  # fmt: skip
    out = [[t] for t in first]

    def row(i, step, prev):
        hist = prompts[i] + out[i][: step + 1]
        return StepItem(i, [-1] if prev else [hist[-1]], len(hist) - 1, tables[i], True, sps[i],
                        history=hist[:-1] if prev else hist, prompt_len=len(prompts[i]),
                        num_generated=step + 1, prev_row=i if prev else None)  # fmt: skip

    if not overlap:
        for step in range(steps):
            for i, t in enumerate(runner.step([row(i, step, False) for i in range(n)])):
                out[i].append(t)
        return out
    pending = runner.launch([row(i, 0, False) for i in range(n)])
    for step in range(1, steps + 1):
        # the host does not know step-1's tokens yet: rows carry placeholders, prev_row = row
        nxt = None
        if step < steps:
            items = []
            for i in range(n):
                hist_len = len(prompts[i]) + step + 1
                items.append(StepItem(i, [-1], hist_len - 1, tables[i], True, sps[i],
                                      history=[0] * (hist_len - 1), prompt_len=len(prompts[i]),
                                      num_generated=step + 1, prev_row=i))  # fmt: skip
            nxt = runner.launch(items)
        for i, t in enumerate(runner.collect(pending)):
            out[i].append(t)
        pending = nxt
    return out


def test_launch_collect_chains_give_the_synchronous_ids(runner):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, DIMS["vocab"]) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    sync = _decode_chain(runner, prompts, 24, overlap=False, block0=0)
    over = _decode_chain(runner, prompts, 24, overlap=True, block0=64)
    assert over == sync
    assert len({tuple(o) for o in sync}) > 1


def _engine(runner, overlap):
    from engine.loop import Engine, EngineConfig

    cfg = EngineConfig(max_running=16, prefill_chunk_tokens=256, overlap=overlap)
    return Engine(runner, FakeTokenizer(), cfg, on_step=lambda e: e.check_invariants())


def _run(runner, reqs, overlap):
    calls = {"launch": 0}
    launch = runner.launch

    def counted(items):
        calls["launch"] += 1
        return launch(items)

    runner.launch = counted
    try:
        e = _engine(runner, overlap)
        hs = {r.request_id: e.submit(r) for r in reqs}
        e.start()
        out = {}
        for rid, h in hs.items():
            events = list(h)
            out[rid] = ([t for ev in events for t in ev.token_ids], events[-1].finish_reason,
                        events[-1].usage.completion_tokens)  # fmt: skip
        e.shutdown(10)
        s = e.stats()
        assert s.kv_blocks_used == 0 and s.running == 0 and s.errors == 0
    finally:
        del runner.launch
    return out, calls["launch"]


def test_engine_streams_the_same_tokens_with_overlap_on_and_off(runner):
    # 8 requests: every decode bucket is one of 1..8, whose rows are batch-invariant bit for bit
    # (tests/gpu/test_batch_invariance_gpu.py), so a stopped request's extra row in a step cannot
    # change the others' logits by moving them to another bucket's kernels
    rng = random.Random(11)
    reqs = []
    for i, sp in enumerate(_samplings(8)):
        prompt = [rng.randrange(2, 128) for _ in range(rng.randint(5, 120))]  # (FakeTokenizer: 128 ids)
        reqs.append(GenerationRequest(f"r{i}", prompt, sampling=sp, max_tokens=rng.randint(4, 48), ignore_eos=True))
    sync, launches = _run(runner, reqs, overlap=False)
    assert launches == 0
    # stop ids taken from the synchronous output, so some requests stop mid-batch (one extra row)
    for i in range(0, 8, 3):
        toks = sync[f"r{i}"][0]
        if len(toks) > 3:
            reqs[i].stop_token_ids = [toks[len(toks) // 2]]
    sync, _ = _run(runner, reqs, overlap=False)
    over, launches = _run(runner, reqs, overlap=True)
    assert over == sync
    assert launches > 20
    assert any(reason == "stop" for _, reason, _ in sync.values())


def test_abort_with_a_step_in_flight_frees_the_blocks(runner):
    e = _engine(runner, overlap=True)
    e.start()
    keep = e.submit(GenerationRequest("keep", list(range(5, 60)), sampling=GREEDY, max_tokens=64, ignore_eos=True))
    h = e.submit(GenerationRequest("a", list(range(7, 90)), sampling=GREEDY, max_tokens=400, ignore_eos=True))
    for _ in range(8):
        h.get(timeout=30)
    h.cancel()
    assert list(h)[-1].finish_reason == "abort"
    events = list(keep)
    assert events[-1].finish_reason == "length" and sum(len(ev.token_ids) for ev in events) == 64
    e.shutdown(10)
    e.check_invariants()
    assert e.stats().kv_blocks_used == 0
