"""Overlapped decode steps (EngineConfig.overlap, engine.loop_overlap) over the FakeRunner, whose
launched steps run later in launch order like a device stream: the same tokens, events and finish
reasons as synchronous steps (greedy, seeded sampling, EOS / stop ids / stop strings, max_tokens at
the context limit), no leaked or corrupted KV blocks (the fake checks every position it reads),
aborts while a step is in flight, runner failures, and the rows that must run synchronously."""

from __future__ import annotations

import random

import pytest
from fixtures.engine_waves import collect
from fixtures.fake_runner import FakeRunner, FakeTokenizer

from engine.loop import Engine, EngineConfig
from engine.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TOK = FakeTokenizer()


def _engine(overlap: bool, runner: FakeRunner | None = None, **cfg) -> Engine:
    runner = runner or FakeRunner(num_blocks=64, block_size=4, max_model_len=256)
    cfg.setdefault("max_running", 8)
    cfg.setdefault("prefill_chunk_tokens", 16)
    cfg.setdefault("max_step_tokens", 32)
    e = Engine(runner, TOK, EngineConfig(overlap=overlap, **cfg), on_step=lambda e: e.check_invariants())
    return e


def _summary(events):
    last = events[-1]
    return (
        [t for ev in events for t in ev.token_ids],
        "".join(ev.text for ev in events),
        last.finish_reason,
        last.usage.completion_tokens,
    )


def _mixed_requests(seed: int, n: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(2, 128) for _ in range(rng.randint(1, 30))]
        sampling = GREEDY if i % 3 else SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i)
        kw = {}
        if i % 4 == 1:
            kw["stop_token_ids"] = [FakeRunner.reference_generate(prompt, 20, sampling)[rng.randrange(3, 20)]]
        if i % 5 == 2:
            kw["stop"] = ["w1", "e"]
        reqs.append(
            GenerationRequest(f"r{i}", prompt, sampling=sampling, max_tokens=rng.randint(1, 24),
                              ignore_eos=i % 2 == 0, **kw)  # fmt: skip
        )
    return reqs


def _run_all(overlap: bool, reqs, runner: FakeRunner | None = None, **cfg) -> tuple[dict, Engine]:
    e = _engine(overlap, runner, **cfg)
    hs = {r.request_id: e.submit(r) for r in reqs}  # all queued before the thread starts
    e.start()
    out = {rid: _summary(collect(h)) for rid, h in hs.items()}
    e.check_invariants()
    s = e.stats()
    assert s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total
    e.shutdown(2)
    assert all(h._events.empty() for h in hs.values()), "events after a final one"
    return out, e


def test_overlap_gives_the_same_events_as_synchronous_steps(caplog):
    reqs = _mixed_requests(7, 24)
    sync, es = _run_all(False, reqs)
    over, eo = _run_all(True, reqs)
    assert over == sync
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # (a dropped row never reaches _advance)
    assert es.runner.launches == 0 and eo.runner.launches > eo.stats().steps // 2
    assert any(reason == "stop" for _, _, reason, _ in over.values())
    for r in reqs:  # and the oracle
        toks, _, reason, n = over[r.request_id]
        want = FakeRunner.reference_generate(r.prompt_ids, r.max_tokens, r.sampling)
        assert toks == want[: len(toks)] and n == len(toks)


def test_a_stopped_request_s_extra_position_leaves_the_prefix_cache_intact():
    """The step after an EOS runs the stopped request's next position into its own uncommitted
    tail block; a later request sharing the whole history reads the committed blocks (the fake
    fails a read of KV another write changed) and gets the same tokens."""
    for base in range(2, 400):
        p = [base % 90 + 2, 7, 9, (base * 7) % 90 + 2, 5, 6, 8]
        out = FakeRunner.reference_generate(p, 40)
        if FakeTokenizer.EOS in out and out.index(FakeTokenizer.EOS) >= 6:
            break
    k = out.index(FakeTokenizer.EOS)
    e = _engine(True)
    e.start()
    first = _summary(collect(e.submit(GenerationRequest("a", p, sampling=GREEDY, max_tokens=40))))
    assert first[0] == out[: k + 1] and first[2] == "stop"
    again = p + out[: k + 1]  # the whole first history as a prompt: a prefix-cache hit
    second = collect(e.submit(GenerationRequest("b", again, sampling=GREEDY, max_tokens=8, ignore_eos=True)))
    assert _summary(second)[0] == FakeRunner.reference_generate(again, 8)
    assert second[-1].usage.cached_tokens >= (len(again) // 4 - 1) * 4
    e.shutdown(2)


def test_rows_ending_by_length_are_left_out_of_the_next_launch():
    """A row whose step gives its last token by max_tokens or the context is not launched again:
    the fake runs exactly the positions synchronous steps run (prompt + max_tokens - 1 each)."""
    reqs = [GenerationRequest(f"r{i}", [i + 2, *range(20, 30 + i)], sampling=GREEDY, max_tokens=29 - i, ignore_eos=True)
            for i in range(3)]  # fmt: skip
    runs = {}
    for overlap in (False, True):
        runner = FakeRunner(num_blocks=64, block_size=4, max_model_len=40)
        out, e = _run_all(overlap, reqs, runner=runner)
        assert {v[2] for v in out.values()} == {"length"} and e.stats().step_failures == 0
        runs[overlap] = (out, runner.tokens_run)
    assert runs[True] == runs[False]
    assert runs[True][1] == sum(len(r.prompt_ids) + r.max_tokens - 1 for r in reqs)
    assert runner.launches > 20


def test_abort_while_a_step_is_in_flight_frees_the_blocks():
    runner = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, step_delay_s=0.002)
    e = _engine(True, runner)
    e.start()
    keep = e.submit(GenerationRequest("keep", list(range(2, 20)), sampling=GREEDY, max_tokens=60, ignore_eos=True))
    h = e.submit(GenerationRequest("a", list(range(3, 40)), sampling=GREEDY, max_tokens=200, ignore_eos=True))
    for _ in range(5):
        h.get(timeout=5)
    h.cancel()
    events = collect(h)
    assert events[-1].finish_reason == "abort"
    toks = [t for ev in events for t in ev.token_ids]
    assert len(toks) < 200 and events[-1].usage.completion_tokens == 5 + len(toks)
    assert _summary(collect(keep))[0] == FakeRunner.reference_generate(list(range(2, 20)), 60)
    e.check_invariants()
    s = e.stats()
    assert s.kv_blocks_used == 0 and s.aborted == 1 and runner.launches > 0
    e.shutdown(2)
    assert h._events.empty() and keep._events.empty(), "events after a final one"


def test_shutdown_with_a_step_in_flight_ends_every_request():
    runner = FakeRunner(num_blocks=256, block_size=4, max_model_len=1024, step_delay_s=0.005)
    e = _engine(True, runner)
    e.start()
    hs = [e.submit(GenerationRequest(f"r{i}", [5 + i, 6], sampling=GREEDY, max_tokens=900, ignore_eos=True))
          for i in range(3)]  # fmt: skip
    hs[0].get(timeout=5)
    e.shutdown(0.3)
    assert not e.alive
    assert {collect(h)[-1].finish_reason for h in hs} == {"abort"}
    assert not runner._uncollected  # the queued step was collected before the thread ended


@pytest.mark.parametrize("at", [2, 3, 5])
def test_a_failed_launch_fails_the_requests_in_flight_and_the_engine_goes_on(at):
    runner = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, fail_steps=[at])
    e = _engine(True, runner)
    hs = [e.submit(GenerationRequest(f"r{i}", list(range(2, 12)), sampling=GREEDY, max_tokens=8, ignore_eos=True))
          for i in range(2)]  # fmt: skip
    e.start()
    assert [collect(h)[-1].finish_reason for h in hs] == ["error", "error"]
    ok = _summary(collect(e.submit(GenerationRequest("later", [5, 6, 7], sampling=GREEDY, max_tokens=6))))
    assert ok[0] == FakeRunner.reference_generate([5, 6, 7], 6)
    assert e.healthy and e.stats().step_failures == 1
    e.check_invariants()
    assert e.stats().kv_blocks_used == 0
    e.shutdown(2)


def test_rows_that_need_the_host_run_synchronously():
    """Penalties, logprobs or a logit bias in the batch: no launch while they run, same output."""
    plain = GenerationRequest("p", list(range(2, 12)), sampling=GREEDY, max_tokens=10, ignore_eos=True)
    for sp in (SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.0, logprobs=1)):
        other = GenerationRequest("h", list(range(3, 9)), sampling=sp, max_tokens=10, ignore_eos=True)
        sync, _ = _run_all(False, [plain, other])
        over, e = _run_all(True, [plain, other])
        assert over == sync and e.runner.launches == 0


def test_a_new_request_joins_between_overlapped_steps():
    """A submit while steps overlap: the step in flight is read, the newcomer's prefill runs
    synchronously, then the batch overlaps again; every output is the oracle's."""
    runner = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, step_delay_s=0.001)
    e = _engine(True, runner)
    e.start()
    a = e.submit(GenerationRequest("a", list(range(2, 20)), sampling=GREEDY, max_tokens=40, ignore_eos=True))
    for _ in range(10):
        a.get(timeout=5)
    launched = runner.launches
    sp = SamplingParams(temperature=0.7, seed=5)
    b = e.submit(GenerationRequest("b", list(range(9, 30)), sampling=sp, max_tokens=30, ignore_eos=True))
    assert _summary(collect(b))[0] == FakeRunner.reference_generate(list(range(9, 30)), 30, sp)
    assert len(_summary(collect(a))[0]) == 30
    assert runner.launches > launched + 20
    e.shutdown(2)


def test_overlap_is_off_for_runners_without_launch():
    class SyncOnly(FakeRunner):
        launch = None

    assert not _engine(True, SyncOnly()).overlaps
    assert _engine(True).overlaps and not _engine(False).overlaps


def test_the_next_step_is_queued_before_the_engine_waits_for_the_last():
    """Steady decoding: every collect but the last finds the next step already launched (two
    uncollected), so the device always has the next step queued while the host post-processes."""

    class Watch(FakeRunner):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.ahead: list[int] = []  # uncollected launches at each collect

        def collect(self, handle):
            self.ahead.append(len(self._uncollected))
            return super().collect(handle)

    runner = Watch(num_blocks=64, block_size=4, max_model_len=256)
    e = _engine(True, runner)
    hs = [e.submit(GenerationRequest(f"r{i}", [3 + i, 9, 4], sampling=GREEDY, max_tokens=40, ignore_eos=True))
          for i in range(3)]  # fmt: skip
    e.start()
    for i, h in enumerate(hs):
        assert _summary(collect(h))[0] == FakeRunner.reference_generate([3 + i, 9, 4], 40)
    e.shutdown(2)
    # 1 prefill step (synchronous), then 39 decode steps launched: all but the last collected with
    # the next one queued
    assert runner.launches == 39 and runner.ahead == [2] * 38 + [1]


def test_steps_keep_overlapping_while_a_request_waits_for_blocks():
    """A request that cannot be admitted (no blocks) does not stop the overlap: it is tried again
    once a request ends, and every output is the oracle's."""

    class Watch(FakeRunner):
        ahead: list[int]

        def collect(self, handle):
            self.ahead.append(len(self._uncollected))
            return super().collect(handle)

    runner = Watch(num_blocks=12, block_size=4, max_model_len=64)
    runner.ahead = []
    e = _engine(True, runner, max_running=4)
    prompts = [[2 + i, *range(30, 45)] for i in range(3)]  # 16 tokens: 4 blocks + 1 of headroom
    hs = [e.submit(GenerationRequest(f"r{i}", p, sampling=GREEDY, max_tokens=8, ignore_eos=True))
          for i, p in enumerate(prompts)]  # fmt: skip
    e.start()
    for p, h in zip(prompts, hs, strict=True):
        assert _summary(collect(h))[0] == FakeRunner.reference_generate(p, 8)
    e.shutdown(2)
    assert e.stats().preemptions == 0
    # r0 and r1 decode 7 steps while r2 waits, then r2 alone: both runs overlapped throughout
    assert runner.ahead == [2] * 6 + [1] + [2] * 6 + [1]
