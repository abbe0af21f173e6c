"""Engine over the numpy ReferenceRunner on a tiny random Llama: greedy alone == batched, and a
prefix-cache hit (plus chunked prefill and preemption) does not change the output."""

from __future__ import annotations

import pytest
from fixtures.engine_waves import PROMPTS, serve_waves

from engine.loop import Engine, EngineConfig
from engine.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from engine.model import load_model

    return load_model(tiny_llama_dir)


def run(model, waves, num_blocks, **cfg):
    """Submit each wave of prompts once the previous wave has finished; return (tokens, cached) per request."""
    from engine.reference import ReferenceRunner

    runner = ReferenceRunner(model, num_blocks=num_blocks, block_size=4, max_model_len=64)
    return serve_waves(runner, waves, max_tokens=8, **cfg)


def test_reference_greedy_alone_equals_batched_with_cache_chunks_and_preemption(model):
    solo = [run(model, [[p]], 32)[0][0][0] for p in PROMPTS]
    batched, stats = run(model, [PROMPTS], 12, max_running=4, prefill_chunk_tokens=6, max_step_tokens=16)
    assert [toks for toks, _ in batched] == solo
    assert stats.preemptions > 0
    # the same prompts again in a second wave: prefix hits must not change the tokens
    again, stats = run(model, [PROMPTS, PROMPTS], 64, max_running=8)
    assert [toks for toks, _ in again] == solo + solo
    # full blocks, and the trailing partial block's tokens but the last (engine.partial_blocks);
    # prompt 1 ends on a block boundary: its last block is never a hit
    assert [cached for _, cached in again] == [0] * 4 + [13, 4, 1, 10]


def test_real_tokenizer_text_and_stop_string(model):
    """The engine's text path over engine.tokenizer: events concatenate to decode(tokens); a stop
    string taken from the middle of that text cuts the output right before it."""
    from engine.reference import ReferenceRunner
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model.weights)
    runner = ReferenceRunner(model, num_blocks=32, block_size=4, max_model_len=64)
    e = Engine(runner, tok, EngineConfig(), on_step=lambda e: e.check_invariants())
    e.start()
    try:
        prompt = tok.encode("hello world, this is a test")
        evs = list(e.submit(GenerationRequest("a", prompt, sampling=GREEDY, max_tokens=24, ignore_eos=True)))
        ids = [t for ev in evs for t in ev.token_ids]
        full = "".join(ev.text for ev in evs)
        assert full == tok.decode(ids)
        if len(full.strip()) < 6:
            pytest.skip("the tiny model produced too little text for a stop-string check")
        mid = len(full) // 2
        stop = full[mid : mid + 3]
        evs = list(
            e.submit(
                GenerationRequest("b", prompt, sampling=GREEDY, max_tokens=24, ignore_eos=True, stop=[stop])
            )
        )
        assert evs[-1].finish_reason == "stop"
        assert "".join(ev.text for ev in evs) == full[: full.index(stop)]
    finally:
        e.shutdown(5)
