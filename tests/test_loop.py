"""Engine loop end to end over the FakeRunner: outputs, prefix cache, limits, stops, aborts, failures."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from fixtures.engine_waves import collect
from fixtures.fake_runner import FakeRunner, FakeTokenizer

from engine.loop import Engine, EngineConfig
from engine.types import ConfigError, GenerationRequest, MemraError, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TOK = FakeTokenizer()


def make_engine(runner=None, start=True, **cfg) -> Engine:
    runner = runner or FakeRunner(num_blocks=64, block_size=4, max_model_len=256)
    cfg.setdefault("max_running", 8)
    cfg.setdefault("prefill_chunk_tokens", 16)
    cfg.setdefault("max_step_tokens", 32)
    engine = Engine(runner, TOK, EngineConfig(**cfg), on_step=lambda e: e.check_invariants())
    if start:
        engine.start()
    return engine


def req(rid, prompt, max_tokens=8, **kw) -> GenerationRequest:
    kw.setdefault("sampling", GREEDY)
    kw.setdefault("ignore_eos", True)
    return GenerationRequest(rid, list(prompt), max_tokens=max_tokens, **kw)


def tokens(events):
    return [t for ev in events for t in ev.token_ids]


def text(events):
    return "".join(ev.text for ev in events)


def assert_idle_clean(engine: Engine):
    engine.check_invariants()
    s = engine.stats()
    assert s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total


def test_greedy_output_usage_ttft_and_text():
    e = make_engine()
    prompt = list(range(2, 30))
    events = collect(e.submit(req("a", prompt, max_tokens=12)))
    assert tokens(events) == FakeRunner.reference_generate(prompt, 12)
    assert events[0].ttft_s is not None and events[0].ttft_s >= 0
    assert all(ev.ttft_s is None for ev in events[1:])
    last = events[-1]
    assert last.finish_reason == "length" and last.usage.prompt_tokens == 28
    assert last.usage.completion_tokens == 12 and last.usage.cached_tokens == 0
    assert all(ev.usage is None for ev in events[:-1])
    assert text(events) == TOK.decode(tokens(events))  # incremental text never breaks UTF-8
    e.shutdown(2)
    assert not e.alive


def test_batched_greedy_equals_solo_greedy():
    prompts = [list(range(3, 3 + n)) + [n % 90 + 2] for n in (5, 17, 33, 2, 48, 9)]
    solo = []
    for i, p in enumerate(prompts):
        e = make_engine()
        solo.append(tokens(collect(e.submit(req(f"s{i}", p, max_tokens=20)))))
        e.shutdown(2)
    # batched, with a KV cache small enough to force preemption and chunking
    e = make_engine(
        FakeRunner(num_blocks=30, block_size=4, max_model_len=128), start=False, prefill_chunk_tokens=8
    )
    handles = [e.submit(req(f"b{i}", p, max_tokens=20)) for i, p in enumerate(prompts)]
    e.start()  # all queued first: the batching (and the preemption asserted below) is deterministic
    batched = [tokens(collect(h)) for h in handles]
    assert batched == solo
    assert e.runner.max_items > 1 and e.stats().preemptions > 0
    assert_idle_clean(e)
    e.shutdown(2)


def test_seeded_sampling_is_batch_independent():
    s = SamplingParams(temperature=1.0, seed=1234)
    p = list(range(10, 40))
    e = make_engine()
    alone = tokens(collect(e.submit(req("x", p, max_tokens=10, sampling=s))))
    hs = [e.submit(req(f"y{i}", p[i:], max_tokens=10, sampling=s)) for i in range(4)]
    together = [tokens(collect(h)) for h in hs]
    assert together[0] == alone == FakeRunner.reference_generate(p, 10, s)
    assert together[1] == FakeRunner.reference_generate(p[1:], 10, s)
    e.shutdown(2)


def test_seed_none_is_filled_at_submit():
    e = make_engine(start=False)
    e.submit(req("r", [5, 6, 7], sampling=SamplingParams(temperature=1.0)))
    seq = e._inbox.get_nowait()[1]
    assert isinstance(seq.sampling.seed, int)


def test_second_identical_prompt_hits_the_prefix_cache():
    r = FakeRunner(num_blocks=64, block_size=4, max_model_len=256)
    e = make_engine(r)
    prompt = list(range(2, 42))  # 40 tokens
    first = collect(e.submit(req("a", prompt, max_tokens=4)))
    prefill_first = r.prefill_tokens
    second = collect(e.submit(req("b", prompt, max_tokens=4)))
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == 36  # capped at (40 - 1) // 4 blocks
    assert r.prefill_tokens - prefill_first == 4
    assert tokens(second) == tokens(first)
    s = e.stats()
    assert s.prefix_hit_tokens == 36 and s.prefix_query_tokens == 80
    assert_idle_clean(e)
    e.shutdown(2)


def test_prefix_cache_is_tenant_and_salt_isolated():
    e = make_engine()
    prompt = list(range(2, 42))
    collect(e.submit(req("a", prompt, tenant="alice")))
    assert collect(e.submit(req("b", prompt, tenant="bob")))[-1].usage.cached_tokens == 0
    assert collect(e.submit(req("c", prompt, tenant="alice", cache_salt="k")))[-1].usage.cached_tokens == 0
    assert collect(e.submit(req("d", prompt, tenant="alice")))[-1].usage.cached_tokens == 36
    e.shutdown(2)


def test_disabled_prefix_cache_reports_no_hits():
    e = make_engine(enable_prefix_cache=False)
    prompt = list(range(2, 42))
    collect(e.submit(req("a", prompt)))
    assert collect(e.submit(req("b", prompt)))[-1].usage.cached_tokens == 0
    assert e.stats().kv_blocks_cached == 0
    e.shutdown(2)


def test_context_length_errors_name_the_numbers():
    e = make_engine(FakeRunner(num_blocks=8, block_size=4, max_model_len=64), start=False)
    with pytest.raises(MemraError) as ei:
        e.submit(req("a", range(2, 52), max_tokens=20))
    assert (
        ei.value.code == "context_length_exceeded" and "64" in ei.value.message and "70" in ei.value.message
    )
    with pytest.raises(MemraError) as ei:
        e.submit(req("b", range(2, 32), max_tokens=10))  # fits the context, not the 32-token cache
    assert ei.value.code == "context_length_exceeded" and "8 blocks" in ei.value.message
    with pytest.raises(MemraError) as ei:
        e.submit(req("c", range(2, 34), max_tokens=None))  # nothing left to generate
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(MemraError) as ei:
        e.submit(req("d", [], max_tokens=4))
    assert ei.value.param == "prompt"
    with pytest.raises(MemraError) as ei:
        e.submit(req("e", [500], max_tokens=4))  # outside the fake vocabulary
    assert ei.value.param == "prompt"
    with pytest.raises(MemraError) as ei:
        e.submit(req("f", [5], max_tokens=0))
    assert ei.value.param == "max_tokens"


def test_max_tokens_none_runs_to_the_cache_or_context_limit():
    e = make_engine(FakeRunner(num_blocks=8, block_size=4, max_model_len=64))
    events = collect(e.submit(req("a", range(2, 12), max_tokens=None)))
    assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 32 - 10
    e.shutdown(2)


def test_overloaded_tenant_limit_duplicate_and_draining():
    e = make_engine(start=False, max_waiting=3, tenant_max_concurrency={"t": 2})
    e.submit(req("a", [5], tenant="t"))
    e.submit(req("b", [5], tenant="t"))
    with pytest.raises(MemraError) as ei:
        e.submit(req("c", [5], tenant="t"))
    assert ei.value.code == "tenant_limit"
    with pytest.raises(MemraError) as ei:
        e.submit(req("a", [5]))
    assert "already in flight" in ei.value.message
    e.submit(req("d", [5]))
    with pytest.raises(MemraError) as ei:
        e.submit(req("e", [5]))
    assert ei.value.code == "overloaded"
    e.start()
    e.drain()
    with pytest.raises(MemraError) as ei:
        e.submit(req("f", [5]))
    assert ei.value.code == "draining"
    e.shutdown(2)


def test_tenant_slot_is_released_before_the_final_event():
    e = make_engine(tenant_max_concurrency={"t": 1})
    for i in range(5):  # each submit right after the previous final event must be accepted
        collect(e.submit(req(f"r{i}", [5, 6], max_tokens=2, tenant="t")))
    e.shutdown(2)


def test_bad_config_is_rejected():
    with pytest.raises(ConfigError, match="max_step_tokens"):
        make_engine(start=False, max_running=64, max_step_tokens=32)
    with pytest.raises(ConfigError, match="tenant_max_concurrency"):
        make_engine(start=False, tenant_max_concurrency={"x": 0})


def _prompt_with_eos_within(n: int) -> tuple[list[int], int]:
    for base in range(2, 500):
        p = [base % 90 + 2, 7, 9, (base * 7) % 90 + 2]
        out = FakeRunner.reference_generate(p, n)
        if FakeTokenizer.EOS in out:
            return p, out.index(FakeTokenizer.EOS)
    raise AssertionError("no prompt found")


def test_eos_stops_and_its_text_is_not_emitted_unless_ignored():
    p, k = _prompt_with_eos_within(40)
    e = make_engine()
    events = collect(e.submit(req("a", p, max_tokens=40, ignore_eos=False)))
    assert events[-1].finish_reason == "stop"
    assert tokens(events) == FakeRunner.reference_generate(p, k + 1)
    assert events[-1].usage.completion_tokens == k + 1
    assert text(events) == TOK.decode(tokens(events)[:-1])
    ignored = collect(e.submit(req("b", p, max_tokens=40, ignore_eos=True)))
    assert ignored[-1].finish_reason == "length" and len(tokens(ignored)) == 40
    e.shutdown(2)


def test_stop_token_ids_and_stop_strings():
    p = list(range(20, 36))
    ref = FakeRunner.reference_generate(p, 30)
    e = make_engine()
    stop_id = ref[5]
    first = ref.index(stop_id)
    events = collect(e.submit(req("a", p, max_tokens=30, stop_token_ids=[stop_id])))
    assert events[-1].finish_reason == "stop" and tokens(events) == ref[: first + 1]
    full = TOK.decode(ref)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    events = collect(e.submit(req("b", p, max_tokens=30, stop=[stop])))
    assert events[-1].finish_reason == "stop"
    assert text(events) == full[: full.index(stop)]
    e.shutdown(2)


def test_abort_frees_blocks_and_is_idempotent():
    r = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, step_delay_s=0.002)
    e = make_engine(r)
    h = e.submit(req("a", range(2, 40), max_tokens=200))
    h.get(timeout=5)
    h.cancel()
    e.abort("a")
    e.abort("never-submitted")
    last = collect(h)[-1]
    assert last.finish_reason == "abort" and last.usage.prompt_tokens == 38
    assert collect(e.submit(req("b", [5, 6])))[-1].finish_reason == "length"  # engine keeps serving
    assert_idle_clean(e)
    assert e.stats().aborted == 1
    e.shutdown(2)


def test_runner_error_fails_only_that_step():
    r = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, fail_steps=[3])
    e = make_engine(r, start=False)
    hs = [e.submit(req(f"r{i}", range(2, 12), max_tokens=6)) for i in range(2)]
    e.start()  # both queued first, so both are in the failing step
    finals = [collect(h)[-1] for h in hs]
    assert [f.finish_reason for f in finals] == ["error", "error"]
    assert finals[0].error.code == "engine_error"
    ok = collect(e.submit(req("later", range(2, 12), max_tokens=6)))
    assert ok[-1].finish_reason == "length" and tokens(ok) == FakeRunner.reference_generate(range(2, 12), 6)
    assert e.healthy and e.stats().step_failures == 1 and e.stats().errors == 2
    assert_idle_clean(e)
    e.shutdown(2)


def test_fatal_runner_error_marks_engine_unhealthy():
    r = FakeRunner(num_blocks=64, block_size=4, max_model_len=256, fatal_steps=[1])
    e = make_engine(r)
    final = collect(e.submit(req("a", [5, 6, 7])))[-1]
    assert final.finish_reason == "error" and final.error.code == "engine_error"
    e._thread.join(2)
    assert not e.healthy and not e.alive
    with pytest.raises(MemraError) as ei:
        e.submit(req("b", [5]))
    assert ei.value.code == "engine_error"


def test_shutdown_is_bounded_and_aborts_the_rest():
    r = FakeRunner(num_blocks=256, block_size=4, max_model_len=1024, step_delay_s=0.01)
    e = make_engine(r)
    hs = [e.submit(req(f"r{i}", range(2, 10), max_tokens=900)) for i in range(3)]
    hs[0].get(timeout=5)
    t0 = time.monotonic()
    e.shutdown(timeout_s=0.5)
    assert time.monotonic() - t0 < 1.0  # bound 0.5 s, slack for a loaded CI machine
    assert not e.alive
    assert all(collect(h, timeout=1)[-1].finish_reason == "abort" for h in hs)
    with pytest.raises(MemraError) as ei:
        e.submit(req("late", [5]))
    assert ei.value.code == "draining"


def test_shutdown_before_start_cancels_queued_requests():
    e = make_engine(start=False)
    h = e.submit(req("a", [5]))
    e.shutdown(1)
    assert collect(h, timeout=1)[-1].finish_reason == "abort"


def test_many_threads_submit_and_abort():
    e = make_engine(FakeRunner(num_blocks=40, block_size=4, max_model_len=128), max_waiting=1000)
    results: dict[str, list] = {}
    lock = threading.Lock()

    def client(k: int):
        for j in range(12):
            rid = f"c{k}-{j}"
            h = e.submit(req(rid, range(2 + j, 12 + 2 * j), max_tokens=5 + j))
            if j % 5 == 4:
                h.cancel()
            evs = collect(h)
            with lock:
                results[rid] = evs

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(results) == 48
    for rid, evs in results.items():
        j = int(rid.split("-")[1])
        assert sum(ev.finish_reason is not None for ev in evs) == 1
        if evs[-1].finish_reason == "length":
            assert tokens(evs) == FakeRunner.reference_generate(range(2 + j, 12 + 2 * j), 5 + j)
        else:
            assert evs[-1].finish_reason == "abort" and j % 5 == 4
    assert_idle_clean(e)
    e.shutdown(2)


def test_handle_get_times_out():
    e = make_engine(start=False)
    h = e.submit(req("a", [5]))
    with pytest.raises(queue.Empty):
        h.get(timeout=0.01)


class _BadRunner(FakeRunner):
    """Returns None for sampled items on its second step, numpy-style ints otherwise."""

    def step(self, items):
        out = super().step(items)
        if self.steps == 2:
            return [None for _ in out]
        return [_Int(t) if t is not None else None for t in out]


class _Int:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def test_runner_returning_garbage_fails_the_step_not_the_engine():
    e = make_engine(_BadRunner(num_blocks=64, block_size=4, max_model_len=256))
    first = collect(e.submit(req("a", [5, 6, 7], max_tokens=5)))
    assert first[-1].finish_reason == "error" and tokens(first) == FakeRunner.reference_generate([5, 6, 7], 1)
    ok = collect(e.submit(req("b", [5, 6, 7], max_tokens=5)))
    assert tokens(ok) == FakeRunner.reference_generate([5, 6, 7], 5) and e.healthy
    assert all(type(t) is int for t in tokens(ok))
    e.shutdown(2)


class _PickyTokenizer(FakeTokenizer):
    def incremental_decoder(self, skip_special_tokens=True):
        dec = super().incremental_decoder(skip_special_tokens)
        picky = dec.push

        def push(ids):
            if 50 in ids:
                raise ValueError("token 50 is not decodable")
            return picky(ids)

        dec.push = push
        return dec


def test_a_decoding_error_fails_only_that_request():
    e = Engine(FakeRunner(), _PickyTokenizer(), EngineConfig(max_running=8, max_step_tokens=32))
    e.start()
    prompts = [[b, 9, 9] for b in range(2, 60)]
    bad = next(p for p in prompts if 50 in FakeRunner.reference_generate(p, 6))
    good = next(p for p in prompts if 50 not in FakeRunner.reference_generate(p, 6))
    hb, hg = e.submit(req("bad", bad, max_tokens=6)), e.submit(req("good", good, max_tokens=6))
    assert collect(hb)[-1].error.code == "engine_error"
    assert tokens(collect(hg)) == FakeRunner.reference_generate(good, 6)
    assert e.healthy
    assert_idle_clean(e)
    e.shutdown(2)
