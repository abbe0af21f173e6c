"""Partial-block prefix hits (engine.partial_blocks) through the engine: a repeated prompt runs one
token after a copy of its cached partial block, and outputs what the cold request did. On the
scripted FakeRunner (whose KV check fails on a missing, late or wrong copy) under preemption,
overlap and waves of shared prefixes; on the numpy reference through the server's
/v1/completions, counted in the usage and the metrics."""

from __future__ import annotations

import random

import pytest
from fixtures.engine_waves import serve_waves
from fixtures.fake_runner import FakeRunner

from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_a_repeated_prompt_runs_one_token_after_the_copy_on_the_fake_runner():
    runner = FakeRunner(num_blocks=32, block_size=4)
    prompt = list(range(1, 15))  # 3 full blocks + 2 tokens
    runs: list[tuple[int, int]] = []
    step = runner.step
    runner.step = lambda items: (runs.extend((len(i.token_ids), i.start_pos) for i in items), step(items))[1]
    outs, stats = serve_waves(runner, [[prompt], [prompt]], max_tokens=4)
    want = FakeRunner.reference_generate(prompt, 4)
    assert outs == [(want, 0), (want, 13)] and runner.copies == 1
    assert runs[4] == (1, 13)  # the warm request's only prefill row: the prompt's last token
    assert stats.prefix_hit_tokens == 13


@pytest.mark.parametrize("overlap", [False, True])
def test_waves_of_shared_prefixes_with_preemption_equal_the_reference(overlap):
    rng = random.Random(3)
    base = [rng.randrange(1, 100) for _ in range(13)]
    prompts = [base[: rng.randrange(2, 14)] + [rng.randrange(1, 100) for _ in range(rng.randrange(0, 3))]
               for _ in range(10)]  # fmt: skip
    runner = FakeRunner(num_blocks=12, block_size=4)
    outs, stats = serve_waves(runner, [prompts, prompts[::-1], prompts], max_tokens=14, max_running=4,
                              prefill_chunk_tokens=5, overlap=overlap)  # fmt: skip
    want = [FakeRunner.reference_generate(p, 14) for p in prompts]
    assert [t for t, _ in outs] == want + want[::-1] + want
    assert runner.copies > 0 and stats.preemptions > 0


def test_a_repeated_prompt_through_the_server_on_the_reference_hits_its_partial_block(tiny_llama_dir):
    """memra's app over the numpy ReferenceRunner: the same /v1/completions prompt sent again reports
    all but its last token cached (its partial block too), runs one row after one block copy, and
    returns the cold request's text; the prefix-hit metric counts the partial tokens."""
    import falcon.testing

    from engine.loop import Engine, EngineConfig
    from engine.model import load_model
    from engine.reference import ReferenceRunner
    from engine.server.app import create_app
    from engine.server.model_info import ModelInfo
    from engine.tokenizer import load_tokenizer

    model = load_model(tiny_llama_dir)
    tok = load_tokenizer(model.weights)
    runner = ReferenceRunner(model, num_blocks=64, block_size=16, max_model_len=128)
    rows: list[tuple[int, int]] = []
    copies: list[tuple[int, int]] = []
    step, copy = runner.step, runner.copy_blocks
    runner.step = lambda items: (rows.extend((len(i.token_ids), i.start_pos) for i in items), step(items))[1]
    runner.copy_blocks = lambda pairs: (copies.extend(pairs), copy(pairs))[1]
    eng = Engine(runner, tok, EngineConfig(), on_step=lambda e: e.check_invariants())
    eng.start()
    try:
        client = falcon.testing.TestClient(create_app(eng, tok, ModelInfo("m", 128, "reference")))
        body = {"model": "m", "prompt": "the quick brown fox jumps over the lazy dog again and again",
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}  # fmt: skip

        def send():
            r = client.simulate_post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json

        cold = send()
        n = cold["usage"]["prompt_tokens"]
        assert n % 16 > 1, f"the prompt ({n} tokens) must end inside a block, past its first token"
        rows.clear()
        warm = send()
        metrics = client.simulate_get("/metrics").text
    finally:
        eng.shutdown(5)
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert rows[0] == (1, n - 1) and len(copies) == 1  # one prefill row, one block copied
    assert eng.stats().prefix_hit_tokens >= n - 1
    assert "memra_cached_prompt_tokens_total" in metrics


def test_longer_and_shorter_prompts_over_a_cached_partial_block_on_the_reference(tiny_llama_dir):
    """The numpy reference through the engine (16-token blocks): a prompt of 2 blocks + 6 tokens,
    then it extended by 4 tokens inside its last block, cut to 3 tokens into it, and again: each
    copies the cached partial block's positions its own cold run computes by prefill (never the
    cached prompt's last, its decode-row tail, nor its own last) and gives its uncached run's greedy
    tokens (the reference's bits follow its passes' row counts, so tokens, not logits:
    docs/engine-loop.md, "Partial blocks")."""
    from engine.model import load_model
    from engine.reference import ReferenceRunner

    model = load_model(tiny_llama_dir)
    runner = ReferenceRunner(model, num_blocks=64, block_size=16, max_model_len=128)
    vocab = int(model.dims["vocab"])
    a = [(37 * i) % (vocab - 3) + 3 for i in range(42)]
    prompts = [a[:38], a, a[:35], a[:38]]
    cold = [serve_waves(runner, [[p]], max_tokens=6, vocab_size=vocab, enable_prefix_cache=False)[0][0][0]
            for p in prompts]  # fmt: skip
    outs, stats = serve_waves(runner, [[p] for p in prompts], max_tokens=6, vocab_size=vocab)
    assert [t for t, _ in outs] == cold
    assert [c for _, c in outs] == [0, 37, 34, 37] and stats.prefix_hit_tokens == 37 + 34 + 37
