"""Ahead-of-time captures after ready (issue #34, engine.runner_warm): a runner built with
``defer_warm_up`` captures nothing while it is built; the engine thread runs its background work one
unit at a time while no request is scheduled, so a request waits for at most one unit; a request
that needs a pass before its unit ran binds or captures it itself, with the same launches and
arguments as the unit would, and the unit then skips it (nothing captured twice)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fixtures.engine_waves import engine_for
from fixtures.fake_runner import FakeRunner
from fixtures.hybrid import write_qwen3_5_hf
from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder
from test_runner_cuda import write_tiny_llama

from engine.types import GenerationRequest, SamplingParams, StepItem

UNIT_S = 0.05


class WarmingRunner(FakeRunner):
    """A FakeRunner with background work: ``units`` units of ``UNIT_S`` seconds each, recording
    when each ran and whether a step ran while one was in progress."""

    def __init__(self, units: int, **kw):
        super().__init__(**kw)
        self.units = units
        self.unit_spans: list[tuple[float, float]] = []
        self.step_starts: list[float] = []
        self.in_unit = False
        self.overlapping = False

    def background_work(self):
        def work():
            for _ in range(self.units):
                self.in_unit = True
                t0 = time.monotonic()
                time.sleep(UNIT_S)
                self.unit_spans.append((t0, time.monotonic()))
                self.in_unit = False
                yield 1

        return work()

    def step(self, items):
        self.overlapping |= self.in_unit
        self.step_starts.append(time.monotonic())
        return super().step(items)


def _generate(e, rid: str, prompt: list[int]) -> tuple[list[int], float]:
    """(the request's tokens, seconds from submit to its first step)."""
    t0 = time.monotonic()
    h = e.submit(GenerationRequest(rid, prompt, sampling=SamplingParams(temperature=0.0), max_tokens=6,
                                   ignore_eos=True))  # fmt: skip
    evs = list(h)
    assert evs[-1].finish_reason == "length", evs[-1].error
    return [t for ev in evs for t in ev.token_ids], t0


def test_a_request_during_background_work_waits_at_most_one_unit_and_gets_the_same_tokens():
    runner = WarmingRunner(units=40)
    e = engine_for(runner)
    prompt = [5, 17, 99, 3, 64, 64, 12, 101, 7]
    try:
        e.start()
        while not runner.unit_spans:  # the engine warms up before any request
            time.sleep(0.005)
        assert e.warming_up
        during, submitted = _generate(e, "during", prompt)
        first = next(t for t in runner.step_starts if t >= submitted)
        assert first - submitted < UNIT_S + 0.04  # (at most the unit in progress, plus scheduling)
        assert len(runner.unit_spans) < runner.units and e.warming_up  # served while work remained
        deadline = time.monotonic() + 10
        while e.warming_up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not e.warming_up and len(runner.unit_spans) == runner.units  # every unit ran, once
        after, _ = _generate(e, "after", prompt)
    finally:
        e.shutdown()
    assert during == after == runner.reference_generate(prompt, 6)
    assert not runner.overlapping  # no step ran inside a unit


def test_a_runner_without_background_work_blocks_on_its_inbox():
    e = engine_for(FakeRunner())
    assert not e.warming_up
    try:
        e.start()
        assert _generate(e, "r", [5, 6, 7])[0]
    finally:
        e.shutdown()


def test_a_failed_unit_ends_the_background_work_but_not_the_engine():
    runner = WarmingRunner(units=3)

    def broken():
        yield 1
        raise RuntimeError("capture failed")

    runner.background_work = broken
    e = engine_for(runner)
    try:
        e.start()
        deadline = time.monotonic() + 5
        while e.warming_up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not e.warming_up and e.healthy
        assert _generate(e, "r", [5, 6, 7])[0] == runner.reference_generate([5, 6, 7], 6)
    finally:
        e.shutdown()


# ----- the CUDA runner on the fake driver


def _cuda(tmp_path, monkeypatch, defer: bool, hybrid: bool = False):
    """(runner, driver, launches): launches are (kernel, packed argument bytes, in a capture); a
    tiny llama, or a tiny Qwen3.5 hybrid."""
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    launches: list[tuple[str, bytes, bool]] = []
    prepared = mod.PreparedLaunch

    class RecPrepared(prepared):
        def __call__(self, args):
            launches.append((self.fn.name, bytes(args._buf), drv.capturing))
            return super().__call__(args)

    mod.PreparedLaunch = RecPrepared
    monkeypatch.setattr(rc, "cuda", mod)
    if hybrid:
        path = write_qwen3_5_hf(tmp_path / "m", bf16=True, hidden_size=128, intermediate_size=256,
                                linear_key_head_dim=32, linear_value_head_dim=32)
        runner = rc.CudaRunner(load_model(path), num_blocks=300, max_model_len=4096,
                               builder=fake_builder(tmp_path), state_slots=6, defer_warm_up=defer)
    else:
        write_tiny_llama(tmp_path / "m")
        runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=300, max_model_len=4096,
                               builder=fake_builder(tmp_path), defer_warm_up=defer)  # fmt: skip
    return runner, drv, launches


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_a_deferred_runner_captures_nothing_when_built_and_the_same_graphs_in_the_background(
    tmp_path, monkeypatch, hybrid
):
    eager, _, _ = _cuda(tmp_path / "a", monkeypatch, defer=False, hybrid=hybrid)
    runner, drv, _ = _cuda(tmp_path / "b", monkeypatch, defer=True, hybrid=hybrid)
    assert drv.captures == 0 and not runner._graphs and not runner._prefill_bound
    assert runner._tail_keys == eager._tail_keys  # (a hybrid's, registered at build: out of the LRU)
    work = runner.background_work()
    assert runner.background_work() is None  # (handed out once)
    assert sum(work) == drv.captures == len(runner._graphs) > 0
    assert runner._graphs.keys() == eager._graphs.keys()
    assert runner._prefill_bound.keys() == eager._prefill_bound.keys()
    assert {k for k in runner._eager if k[0] == "head"} == {k for k in eager._eager if k[0] == "head"}


def _tail_item(runner, n_new: int) -> StepItem:
    """A prefix-cache hit's last pass: ``n_new`` tokens after 3 cached blocks, sampling greedily."""
    bs = runner.block_size
    start = 3 * bs
    return StepItem(0, [(7 * i) % 300 + 3 for i in range(n_new)], start, list(range(1, 6)), True, GREEDY,
                    prompt_len=start + n_new)  # fmt: skip


@pytest.mark.parametrize("new", ["block", "partial"])
def test_a_request_before_its_unit_runs_the_same_launches_and_nothing_is_captured_twice(tmp_path, monkeypatch, new):
    """A warm request that arrives after the first units: a whole last block (its prefill graph not
    captured yet) runs the very bound launches the unit captures later, eagerly; a trailing partial
    block (its decode-row graph not captured yet) captures that graph itself, and the unit keeps it."""
    runner, drv, launches = _cuda(tmp_path, monkeypatch, defer=True)
    bs = runner.block_size
    work = runner.background_work()
    next(work)  # (one prefill shape bound: the request comes while the work goes on)
    item = _tail_item(runner, bs if new == "block" else 5)
    launches.clear()
    runner.step([item])
    ran = list(launches)
    if new == "block":
        assert ("tail", bs) not in runner._graphs and all(not cap for *_, cap in ran)
        launches.clear()
        captures = drv.captures
        for _ in work:
            pass
        graph, bound = runner._graphs[("tail", bs)]
        assert bound is runner._prefill_bound[("prefill", bs, 1, bs)]
        captured = [(k, a) for k, a, cap in launches if cap]
        n = len(bound)
        assert captured[:n] == [(k, a) for k, a, _ in ran[:n]]  # the layers: same kernels, same arguments
        assert drv.captures - captures == len(runner._graphs) - 0  # each graph captured once
    else:
        mine = {k: g for k, g in runner._graphs.items()}
        assert len(mine) == 1 and drv.captures == 1
        (key, (graph, _)), = mine.items()
        for _ in work:
            pass
        assert runner._graphs[key][0] is graph  # kept, not captured again
        assert drv.captures == len(runner._graphs)
    launches.clear()
    graph_launches = drv.graph_launches
    runner.step([_tail_item(runner, len(item.token_ids))])  # the same request after the work: graph replays
    assert drv.graph_launches > graph_launches and not [1 for *_, cap in launches if cap]


def test_verify_graphs_join_the_background_work_of_a_deferred_runner(tmp_path, monkeypatch):
    runner, drv, _ = _cuda(tmp_path, monkeypatch, defer=True)
    assert runner.prepare_verify(3) == 0 and drv.captures == 0
    for _ in runner.background_work():
        pass
    eager, _, _ = _cuda(tmp_path / "e", monkeypatch, defer=False)
    eager.prepare_verify(3)  # (a dense plan's tail graphs are verify graphs too: most are there)
    assert set(runner._graphs) == set(eager._graphs)
    assert drv.captures == len(runner._graphs)  # each once
    assert runner.prepare_verify(3) == 0  # (all there: nothing more to capture)


def test_the_engine_thread_runs_the_cuda_runner_s_work_after_start(tmp_path, monkeypatch):
    runner, drv, _ = _cuda(tmp_path, monkeypatch, defer=True)
    runner.ctx.make_current = lambda: None  # (the engine thread makes the context current)
    made = threading.Event()
    ensure = runner._ensure_context
    runner._ensure_context = lambda: made.set() or ensure()
    e = engine_for(runner, vocab_size=runner.plan.dims["vocab"])
    try:
        e.start()
        deadline = time.monotonic() + 20
        while e.warming_up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not e.warming_up and made.is_set() and drv.captures == len(runner._graphs) > 0
        toks, _ = _generate(e, "r", [int(t) for t in np.arange(3, 40)])
        assert len(toks) == 6
    finally:
        e.shutdown()


def test_held_background_work_waits_for_start_background():
    """`memra serve` builds its Engine with ``hold_background`` and starts the work once /ready answers."""
    from fixtures.fake_runner import FakeTokenizer

    from engine.loop import Engine, EngineConfig

    runner = WarmingRunner(units=3)
    e = Engine(runner, FakeTokenizer(eos_token_ids=frozenset()), EngineConfig(), hold_background=True)
    try:
        e.start()
        assert _generate(e, "r", [5, 6, 7])[0]  # (requests run meanwhile)
        time.sleep(0.1)
        assert not runner.unit_spans and e.warming_up
        e.start_background()
        deadline = time.monotonic() + 5
        while e.warming_up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(runner.unit_spans) == 3 and not e.warming_up
    finally:
        e.shutdown()
