"""CudaRunner's overlapped decode launches (engine.runner_overlap) on the fake driver (no GPU): what
a launch queues and in which order, the pinned inputs equal a synchronous step's but for the input
ids the previous launch sampled (device-to-device copies, one per run of rows), the "inputs read"
wait before the pinned block is rewritten, two output slots, and the misuse errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder
from test_runner_cuda import write_tiny_llama

from engine.runner_overlap import prev_runs
from engine.types import MemraError, SamplingParams, StepItem


@pytest.fixture()
def rec(tmp_path, monkeypatch):
    """(runner, driver, log): log holds ("htod", ptr, nbytes), ("dtod", dst, src, nbytes),
    ("dtoh", ptr, nbytes), ("record", event id), ("sync", event id), ("graph", capturing) in order;
    every D2H of the sampled ids writes 100 * (its number) + row, mod 500 (inside the 512-id vocab)."""
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    log: list[tuple] = []
    d2h = {"n": 0}
    htod = mod.htod

    def rec_htod(ptr, host, stream=None):
        log.append(("htod", ptr, np.asarray(host).nbytes))
        return htod(ptr, host, stream)

    def rec_dtoh(host, ptr, stream=None):
        d2h["n"] += 1
        host[:] = (100 * d2h["n"] + np.arange(host.size)) % 500
        log.append(("dtoh", ptr, host.nbytes))
        return host

    class Ev(mod.Event):
        def record(self, stream):
            log.append(("record", id(self)))
            super().record(stream)

        def synchronize(self):
            log.append(("sync", id(self)))

    class G(mod.Graph):
        def launch(self, stream):
            log.append(("graph", drv.capturing))
            super().launch(stream)

    capture = mod.capture

    class Cap(capture):
        def __enter__(self):
            super().__enter__()
            return G()

    mod.htod, mod.dtoh, mod.Event, mod.capture = rec_htod, rec_dtoh, Ev, Cap
    mod.dtod = lambda dst, src, n, stream=None: log.append(("dtod", dst, src, n))
    monkeypatch.setattr(rc, "cuda", mod)
    write_tiny_llama(tmp_path / "m")
    runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=64, max_model_len=512, builder=fake_builder(tmp_path))
    drv.reset()
    log.clear()
    d2h["n"] = 0  # (the build's graph captures copied ids too: engine.runner_tail's prompt tails)
    return runner, drv, log


def _rows(n, start=9, prev=False, sampling=GREEDY):
    return [
        StepItem(i, [-1] if prev else [5 + i], start + i, [2 * i, 2 * i + 1], True, sampling,
                 num_generated=3, prev_row=i if prev else None)
        for i in range(n)
    ]  # fmt: skip


def test_prev_runs_coalesce_consecutive_rows():
    items = _rows(5, prev=True)
    assert prev_runs(items) == [(0, 0, 5)]
    items[2].prev_row = None  # a row with its own token splits the run
    items[3].prev_row, items[4].prev_row = 4, 5  # a finished row 3 left out of the new batch
    assert prev_runs(items) == [(0, 0, 2), (3, 4, 2)]


def test_a_launch_queues_inputs_copies_graph_and_ids_then_collect_waits(rec):
    runner, drv, log = rec
    tok_ptr = runner._in_dev.ptr + runner._in_off["tokens"]
    out_ptr = runner._in_dev.ptr + runner._in_off["out_ids"]
    prev = runner._ov_prev.ptr
    h1 = runner.launch(_rows(3))
    first = list(log)
    kinds = [e[0] for e in first]
    # upload, no token copies (own tokens), inputs-read event, graph (captured on first use: a warm
    # run, so no graph launch until the capture's), ids to the next launch and to the host, done
    assert kinds[0] == "htod" and first[0][1] == runner._in_dev.ptr
    assert not [e for e in first if e[0] == "dtod" and e[1] == tok_ptr]
    assert ("dtod", prev, out_ptr, 12) in first and ("dtoh", out_ptr, 12) in first
    assert kinds.index("record") < kinds.index("graph") < kinds.index("dtoh") < len(kinds) - 1
    assert kinds[-1] == "record" and "sync" not in kinds
    assert runner._views["tokens"][:4].tolist() == [5, 6, 7, 0]
    log.clear()
    items = _rows(3, start=10, prev=True)
    items[1], items[2] = items[2], items[1]  # rows 1 and 2 swapped: two runs
    items[1].prev_row, items[2].prev_row = 2, 1
    h2 = runner.launch(items)
    second = list(log)
    assert second[0][0] == "sync"  # the previous launch's inputs-read event, before any write
    assert [e for e in second if e[0] == "dtod" and e[1] != prev] == [
        ("dtod", tok_ptr, prev, 4),
        ("dtod", tok_ptr + 4, prev + 8, 4),
        ("dtod", tok_ptr + 8, prev + 4, 4),
    ]
    copies = [i for i, e in enumerate(second) if e[0] == "dtod" and e[1] == tok_ptr]
    assert second[1][0] == "htod" and copies[0] > 1  # the placeholders go up, then the ids over them
    assert ("graph", False) in second and drv.captures == 1  # bucket 4 replayed, not recaptured
    assert runner.collect(h1) == [100, 101, 102]
    assert runner.collect(h2) == [200, 201, 202]
    assert runner._ov_done[0] is not runner._ov_done[1]


def test_launch_inputs_equal_a_synchronous_step_s_but_the_ids(rec):
    runner, _, _ = rec
    hot = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    items = _rows(5, sampling=hot)
    runner.step(items)
    want = runner._in_host.bytes[: runner._tables_off + 8 * runner._table_ld * 4].copy()
    runner.collect(runner.launch(items))
    got = runner._in_host.bytes[: len(want)]
    assert np.array_equal(got, want)


def test_launch_refuses_what_it_cannot_overlap_and_misuse_is_an_error(rec):
    runner, _, _ = rec
    assert runner.can_launch(_rows(3))
    pen = SamplingParams(temperature=0.0, presence_penalty=0.5)
    lp = SamplingParams(temperature=0.0, logprobs=2)
    bias = SamplingParams(temperature=0.0, logit_bias=((3, 1.0),))
    for sp in (pen, lp, bias):
        assert not runner.can_launch(_rows(2, sampling=sp))
    assert not runner.can_launch([StepItem(0, [1, 2, 3], 0, [0], True, GREEDY)])  # a prefill
    assert not runner.can_launch(_rows(runner._max_rows + 1))
    with pytest.raises(MemraError, match="prev_row"):
        runner.launch(_rows(2, prev=True))  # no launch before it
    h1 = runner.launch(_rows(2))
    h2 = runner.launch(_rows(2, start=10, prev=True))
    with pytest.raises(MemraError, match="not collected"):
        runner.launch(_rows(2, start=11, prev=True))
    with pytest.raises(MemraError, match="not collected"):
        runner.step(_rows(2))
    with pytest.raises(MemraError, match="oldest"):
        runner.collect(h2)
    runner.collect(h1)
    runner.collect(h2)
    runner.step(_rows(2, start=11))
    with pytest.raises(MemraError, match="prev_row"):  # a synchronous step in between
        runner.launch(_rows(2, start=12, prev=True))


def test_the_engine_steps_the_cuda_runner_through_launch_and_collect(rec):
    from fixtures.fake_runner import FakeTokenizer

    from engine.loop import Engine, EngineConfig
    from engine.types import GenerationRequest

    runner, drv, log = rec
    runner.ctx.make_current = lambda: None  # (the engine thread makes the context current)
    calls = {"launch": 0, "step": 0}
    launch, step = runner.launch, runner.step
    runner.launch = lambda items: calls.__setitem__("launch", calls["launch"] + 1) or launch(items)
    runner.step = lambda items: calls.__setitem__("step", calls["step"] + 1) or step(items)
    cfg = EngineConfig(max_running=4, overlap=True)
    e = Engine(runner, FakeTokenizer(), cfg, on_step=lambda e: e.check_invariants())
    e.start()
    hs = [e.submit(GenerationRequest(f"r{i}", [5, 6, 7 + i], sampling=GREEDY, max_tokens=12, ignore_eos=True))
          for i in range(3)]  # fmt: skip
    for h in hs:
        events = list(h)
        assert events[-1].finish_reason == "length" and sum(len(ev.token_ids) for ev in events) == 12
    e.shutdown(2)
    assert calls["launch"] >= 9 and calls["step"] <= 3
    assert e.stats().kv_blocks_used == 0
