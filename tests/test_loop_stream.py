"""A speculative round's text and events streamed while the next verify pass runs (engine.loop_stream).

On the reference backend (the tiny Llama drafting for itself: every draft accepted), through a
runner that says ``verify_during``: every request's events (tokens, text, finish reason, usage)
equal plain greedy's, one per token, whether it ends by length inside a round's tokens, on a stop
token, on a stop string, or by an abort with a round still deferred; the deferred events are pushed inside the next
round's verify call; a token the tokenizer rejects fails only its request. On the fake CUDA driver,
``CudaRunner.verify(during=)`` runs ``during`` after the verify graph's launch and before the wait.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fixtures.fake_runner import FakeTokenizer
from test_spec import spec_engine

from engine.loop import Engine, EngineConfig
from engine.reference import ReferenceRunner
from engine.spec.build import build_speculator
from engine.spec.config import SpecConfig
from engine.types import GenerationRequest, SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 9, 13, 2, 40, 7], [3, 3, 8, 21, 60, 11, 4, 90, 17]]


class DuringRunner(ReferenceRunner):
    """The reference runner with ``verify(items, during=)``: ``during`` runs first (its pass is
    synchronous), and the events it pushed are counted."""

    verify_during = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.handles: list = []
        self.pushed_during: list[int] = []
        self.calls = 0

    def verify(self, items, during=None):
        self.calls += 1
        before = sum(h._events.qsize() for h in self.handles)
        if during is not None:
            during()
        self.pushed_during.append(sum(h._events.qsize() for h in self.handles) - before)
        return super().verify(items)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from engine.model import load_model

    return load_model(tiny_llama_dir)


def run(model, reqs, spec_dir=None):
    """Events per request: (token_ids, text, finish_reason, completion tokens)."""
    runner = DuringRunner(model, num_blocks=64, block_size=4, max_model_len=128)
    spec = SpecConfig("draft", str(spec_dir), k=4) if spec_dir is not None else None
    e = spec_engine(runner, model, spec)
    try:
        handles = [e.submit(r) for r in reqs]
        runner.handles = handles
        e.start()
        outs = []
        for h in handles:
            evs = []
            for ev in h:
                evs.append((ev.token_ids, ev.text, ev.finish_reason, ev.usage.completion_tokens if ev.usage else None))
            outs.append(evs)
        assert e.stats().kv_blocks_used == 0
        return outs, runner, e.stats()
    finally:
        e.shutdown(5)


def req(i, prompt, **kw):
    kw.setdefault("max_tokens", 23)
    return GenerationRequest(f"r{i}", prompt, GREEDY, **kw)


def test_streamed_events_equal_plain_greedy(model, tiny_llama_dir):
    reqs = [req(i, p, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    plain, _, _ = run(model, reqs)
    spec, runner, stats = run(model, reqs, tiny_llama_dir)
    assert spec == plain
    assert all(len(ev[0]) == 1 for evs in spec for ev in evs)
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    # the rounds after the first stream the previous round's events inside the verify call
    assert runner.calls > 2 and sum(n > 0 for n in runner.pushed_during) >= runner.calls - 2


def test_stop_token_stop_string_and_abort_end_where_plain_does(model, tiny_llama_dir):
    plain, _, _ = run(model, [req(i, p, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    toks = [[ev[0][0] for ev in evs] for evs in plain]
    text = "".join(ev[1] for ev in plain[1])
    reqs = [
        # a stop token met inside a round (the request ends there; later accepted tokens dropped)
        req(0, PROMPTS[0], ignore_eos=True, stop_token_ids=[toks[0][7]]),
        # a stop string: the synchronous path, text held back and cut as plain does
        req(1, PROMPTS[1], ignore_eos=True, stop=[text[9:12]]),
    ]
    want, _, _ = run(model, reqs)
    assert want[0][-1][2] == "stop" and want[1][-1][2] == "stop"
    got, _, _ = run(model, reqs, tiny_llama_dir)
    assert got == want


def test_an_abort_after_a_deferred_round_ends_after_its_events(model, tiny_llama_dir):
    """Driven in the test's thread: after three rounds the abort lands with round 3's events
    still deferred; they come out before the final event, and equal plain greedy's tokens."""
    plain, _, _ = run(model, [req(0, PROMPTS[0], ignore_eos=True)])
    runner = DuringRunner(model, num_blocks=64, block_size=4, max_model_len=128)
    spec = build_speculator(SpecConfig("draft", str(tiny_llama_dir), k=4), model, runner)
    e = Engine(runner, FakeTokenizer(eos_token_ids=frozenset()), EngineConfig(), speculator=spec)
    h = e.submit(req(0, PROMPTS[0], ignore_eos=True))
    e._drain_inbox(False)
    for _ in range(4):  # the prefill, then three rounds
        e._step()
    assert e._later  # round 3's tokens: not streamed yet
    e.abort("r0")
    e._drain_inbox(False)
    evs = list(h)
    assert evs[-1].finish_reason == "abort" and not e._later
    got = [ev.token_ids[0] for ev in evs[:-1]]
    assert got == [ev[0][0] for ev in plain[0]][: len(got)] and len(got) == 1 + 3 * 5
    assert e.stats().kv_blocks_used == 0


def test_a_token_the_tokenizer_rejects_fails_only_its_request(model, tiny_llama_dir, monkeypatch):
    plain, _, _ = run(model, [req(i, p, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    bad = plain[0][9][0][0]  # a token request 0 emits in a later round (not request 1's)
    if bad in {ev[0][0] for ev in plain[1]}:
        pytest.skip("the two requests share the token")
    piece = FakeTokenizer.piece

    def picky(self, t, skip_special_tokens=True):
        if t == bad:
            raise ValueError(f"cannot decode {t}")
        return piece(self, t, skip_special_tokens)

    monkeypatch.setattr(FakeTokenizer, "piece", picky)
    got, _, _ = run(model, [req(i, p, ignore_eos=True) for i, p in enumerate(PROMPTS)], tiny_llama_dir)
    assert got[0][-1][2] == "error" and got[1] == plain[1]


def test_cuda_verify_runs_during_between_the_launch_and_the_wait(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    import test_plan_runner_fake as base

    drv = base.FakeDriver()
    mod = drv.module()
    import engine.runner_cuda as rc
    from engine.model import load_model

    monkeypatch.setattr(rc, "cuda", mod)
    base.write_tiny_llama(tmp_path / "m")
    runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=64, max_model_len=512, builder=base.fake_builder(tmp_path))
    log: list[str] = []
    sync = runner.stream.synchronize
    monkeypatch.setattr(runner.stream, "synchronize", lambda: log.append("sync") or sync())
    launch = mod.Graph.launch
    monkeypatch.setattr(mod.Graph, "launch", lambda g, s: log.append("launch") or launch(g, s))
    item = StepItem(0, [7, 0, 0], 5, [0], True, GREEDY, history=[1] * 5 + [7], draft=[0, 0])
    assert runner.verify_during
    assert runner.verify([item], during=lambda: log.append("during")) == [[0, 0, 0]]
    assert log[-3:] == ["launch", "during", "sync"] and log.count("during") == 1
