"""Randomized engine run (fixed seed): 300 requests with arrivals, aborts, prefix sharing and a tiny
KV cache forcing preemption; invariants after every step; every request ends once, correctly; with
synchronous and with overlapped decode steps (engine.loop_overlap)."""

from __future__ import annotations

import random

import pytest
from fixtures.fake_runner import FakeRunner, FakeTokenizer

from engine.loop import Engine, EngineConfig
from engine.types import GenerationRequest, SamplingParams


def expected(r: GenerationRequest) -> tuple[list[int], str]:
    out = FakeRunner.reference_generate(r.prompt_ids, r.max_tokens, r.sampling)
    stops = set(r.stop_token_ids) | (set() if r.ignore_eos else {FakeTokenizer.EOS})
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1], "stop"
    return out, "length"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_randomized_arrivals_aborts_and_preemption(overlap):
    rng = random.Random(20261202)
    shared = [[rng.randrange(2, 128) for _ in range(40)] for _ in range(3)]
    reqs, arrival, abort_at = [], [], {}
    t = 0.0
    for i in range(300):
        n = rng.randint(1, 40)
        k = rng.randint(0, n) if rng.random() < 0.6 else 0
        prompt = rng.choice(shared)[:k] + [rng.randrange(2, 128) for _ in range(n - k)]
        sampling = (
            SamplingParams(temperature=0.0) if rng.random() < 0.7 else SamplingParams(temperature=0.8, seed=i)
        )
        r = GenerationRequest(
            f"r{i}",
            prompt,
            sampling=sampling,
            max_tokens=rng.randint(1, 40),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=[rng.randrange(2, 128)] if rng.random() < 0.2 else [],
            tenant=rng.choice(["a", "b"]),
        )
        t += rng.expovariate(1.0)
        reqs.append(r)
        arrival.append(int(t))
        if rng.random() < 0.15:
            abort_at.setdefault(int(t) + rng.randint(0, 30), []).append(r.request_id)

    runner = FakeRunner(num_blocks=24, block_size=4, max_model_len=96)
    cfg = EngineConfig(max_running=6, max_waiting=1000, prefill_chunk_tokens=16, max_step_tokens=24, overlap=overlap)
    handles = {}
    state = {"step": 0, "next": 0}

    def submit_due(e: Engine, upto: int) -> None:
        while state["next"] < len(reqs) and arrival[state["next"]] <= upto:
            r = reqs[state["next"]]
            handles[r.request_id] = e.submit(r)
            state["next"] += 1

    def on_step(e: Engine) -> None:
        e.check_invariants()
        state["step"] += 1
        step = state["step"]
        submit_due(e, step)
        for rid in abort_at.pop(step, []):
            e.abort(rid)
        if not e.scheduler.has_work() and e._inbox.empty() and state["next"] < len(reqs):
            submit_due(e, arrival[state["next"]])  # idle: fast-forward to the next arrival

    engine = Engine(runner, FakeTokenizer(), cfg, on_step=on_step)
    submit_due(engine, 0)
    engine.start()
    results = {}
    for r in reqs:
        while r.request_id not in handles:  # submitted later from the engine thread
            assert engine.healthy, f"engine stopped: {engine._crash!r}"
            engine._thread.join(0.001)
        h = handles[r.request_id]
        events = []
        while True:
            ev = h.get(timeout=10)
            assert ev.finish_reason != "error", f"{r.request_id}: {ev.error and ev.error.message}"
            events.append(ev)
            if ev.finish_reason:
                break
        results[r.request_id] = events
    engine.check_invariants()
    aborted_ids = {rid for rids in abort_at.values() for rid in rids}  # never fired: none should remain
    assert not aborted_ids, "some aborts were scheduled after the run ended"
    n_aborted = 0
    for r in reqs:
        events = results[r.request_id]
        assert sum(ev.finish_reason is not None for ev in events) == 1
        assert handles[r.request_id]._events.empty(), "events after the final one"
        toks = [t for ev in events for t in ev.token_ids]
        want, reason = expected(r)
        last = events[-1]
        if last.finish_reason == "abort":
            n_aborted += 1
            assert toks == want[: len(toks)] and len(toks) < len(want) + 1
        else:
            assert (toks, last.finish_reason) == (want, reason), r.request_id
        assert last.usage.completion_tokens == len(toks)
        assert last.usage.prompt_tokens == len(r.prompt_ids)
    s = engine.stats()
    assert s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total
    assert s.finished + s.aborted == 300 and s.aborted == n_aborted > 0
    assert s.preemptions > 0 and s.prefix_hit_tokens > 0 and s.prefix_evictions > 0
    assert runner.max_items > 1
    assert (runner.launches > 0) == overlap
    engine.shutdown(2)
