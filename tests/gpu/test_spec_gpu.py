"""Speculative decoding on a real GPU (skipped without one): greedy with speculation == plain greedy,
solo and batched, short and long contexts, graphs and eager, on a tiny random Llama and the real
SmolLM2; sampled speculation runs the host rejection rule from the verify logits."""

from __future__ import annotations

import pytest

from engine.bench import NullTokenizer
from engine.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_runner_cuda import write_tiny_llama

    from engine.model import load_model

    target = tmp_path_factory.mktemp("spec-target")
    other = tmp_path_factory.mktemp("spec-other")
    write_tiny_llama(target)
    write_tiny_llama(other, seed=1)
    return load_model(target), target, other


def generate(runner, model, prompts, spec=None, sampling=GREEDY, max_tokens=40, tokenizer=None):
    from engine.loop import Engine, EngineConfig
    from engine.spec.build import build_speculator

    e = Engine(
        runner,
        tokenizer or NullTokenizer(),
        EngineConfig(),
        on_step=lambda e: e.check_invariants(),
        speculator=build_speculator(spec, model, runner),
    )
    hs = [
        e.submit(
            GenerationRequest(
                f"r{i}", p, SamplingParams(**{**sampling.__dict__, "seed": i}), max_tokens=max_tokens, ignore_eos=True
            )
        )
        for i, p in enumerate(prompts)
    ]
    e.start()
    try:
        outs = [[t for ev in h for t in ev.token_ids] for h in hs]
        return outs, e.stats()
    finally:
        e.shutdown(10)


def _prompts(n_long=0):
    loop = [11, 23, 35, 47, 59, 71, 83] * 6  # repetitive: prompt lookup proposes
    base = [[5, 17, 99, 3, 64, 64, 12], loop, [40, 41, 42]]
    if n_long:
        base.append([(i * 37) % 500 + 1 for i in range(n_long)])  # past split_kv_tokens: long launches
    return base


@pytest.mark.parametrize("use_graphs", [True, False])
@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_greedy_with_speculation_equals_plain_greedy(tiny, method, use_graphs):
    from engine.runner_cuda import CudaRunner
    from engine.spec.config import SpecConfig

    model, target, other = tiny
    spec = {
        "ngram": SpecConfig("ngram", k=4, ngram_min=1),
        "draft-self": SpecConfig("draft", str(target), k=4),
        "draft-other": SpecConfig("draft", str(other), k=3),
    }[method]
    runner = CudaRunner(model, num_blocks=512, max_model_len=1024, use_graphs=use_graphs)
    try:
        prompts = _prompts(n_long=300)
        plain = [generate(runner, model, [p])[0][0] for p in prompts]
        solo = [generate(runner, model, [p], spec)[0][0] for p in prompts]
        batched, stats = generate(runner, model, prompts, spec)
        assert solo == plain
        assert batched == plain
        assert stats.spec_verify_rows > 0
        if method == "draft-self":
            assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    finally:
        runner.close()


def test_sampled_speculation_runs_the_host_rule(tiny):
    from engine.runner_cuda import CudaRunner
    from engine.spec.config import SpecConfig

    model, target, _ = tiny
    runner = CudaRunner(model, num_blocks=256, max_model_len=512)
    try:
        sampling = SamplingParams(temperature=0.8, top_k=5)
        outs, stats = generate(runner, model, _prompts(), SpecConfig("draft", str(target), k=3), sampling)
        assert all(len(o) == 40 for o in outs)
        assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    finally:
        runner.close()


def test_smollm2_greedy_with_prompt_lookup_and_self_draft_equals_plain(smollm2_path):
    from engine.backend import create_runner
    from engine.model import load_model
    from engine.spec.config import SpecConfig
    from engine.tokenizer import load_tokenizer

    model = load_model(smollm2_path)
    tok = load_tokenizer(model.weights)
    text = (
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n"
    )
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Add type hints to every function:\n{text}"}],
                add_generation_prompt=True,
            )
        ),
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": "Write a short story about a lighthouse."}], add_generation_prompt=True
            )
        ),
    ]
    runner = create_runner(model, "cuda")
    try:
        plain, _ = generate(runner, model, prompts, None, max_tokens=96)
        ngram, st = generate(runner, model, prompts, SpecConfig("ngram", k=4), max_tokens=96)
        assert ngram == plain
        assert st.spec_accepted_tokens > 0
        solo = [generate(runner, model, [p], SpecConfig("ngram", k=4), max_tokens=96)[0][0] for p in prompts]
        assert solo == plain
        draft, st = generate(runner, model, prompts, SpecConfig("draft", str(smollm2_path), k=4), max_tokens=96)
        assert draft == plain
        assert st.spec_accepted_tokens == st.spec_draft_tokens
    finally:
        runner.close()


@pytest.mark.parametrize("depth", [8, 300])
def test_verify_logits_match_plain_decode_steps(tiny, depth):
    """The logits of the k+1 verify rows against the batch-1 decode steps that plain greedy runs at
    the same positions: the same argmax and close values. Greedy speculation is byte-identical to
    plain greedy exactly when these argmaxes agree; the bits agree only where the kernels of the
    verify bucket reduce like the batch-1 ones (printed, not asserted)."""
    import numpy as np

    from engine.runner_cuda import CudaRunner
    from engine.types import StepItem

    model = tiny[0]
    runner = CudaRunner(model, num_blocks=256, max_model_len=1024)
    try:
        prompt = [(i * 37) % 500 + 1 for i in range(depth)]
        ta, tb = list(range(0, 40)), list(range(40, 80))
        tok = runner.step([StepItem(0, prompt, 0, ta, True, GREEDY)])[0]
        runner.step([StepItem(1, prompt, 0, tb, True, GREEDY)])
        plain, toks = [], [tok]
        for j in range(4):  # plain greedy: four batch-1 decode steps
            nxt = runner.step([StepItem(0, [toks[-1]], depth + j, ta, True, GREEDY)])[0]
            plain.append(runner.read_logits(1)[0])
            toks.append(nxt)
        item = StepItem(1, toks[:4], depth, tb, True, GREEDY, history=prompt + toks[:1], draft=toks[1:4])
        out = runner.verify([item])
        got = runner.read_logits(4)
        assert out == [toks[1:5]]  # every draft token accepted, the bonus is plain's 4th token
        for j in range(4):
            assert int(np.argmax(got[j])) == int(np.argmax(plain[j]))
            rel = float(np.linalg.norm(got[j] - plain[j]) / np.linalg.norm(plain[j]))
            assert rel < 1e-2, (j, rel)
        same = all(np.array_equal(got[j], plain[j]) for j in range(4))
        print(f"verify rows vs batch-1 decode at depth {depth}: bit-identical={same}")
    finally:
        runner.close()


@pytest.mark.parametrize("use_graphs", [True, False])
def test_logprobs_and_biased_requests_beside_speculation(tiny, use_graphs):
    """A logprobs request and a logit-biased one never speculate (engine.spec.speculator.may_speculate)
    and are host-sampled in verify's plain rows while the other rows verify drafts: every request
    gets the tokens it gets without a speculator, the logprobs rows their logprobs (close)."""
    import numpy as np

    from engine.loop import Engine, EngineConfig
    from engine.runner_cuda import CudaRunner
    from engine.spec.build import build_speculator
    from engine.spec.config import SpecConfig

    model, target, _ = tiny
    runner = CudaRunner(model, num_blocks=512, max_model_len=1024, use_graphs=use_graphs)
    shaped = [
        GREEDY,
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias=((7, 5.0),)),
        SamplingParams(temperature=0.7, top_k=10, seed=3, logprobs=0),
    ]
    prompts = _prompts() + [[11, 23, 35, 47] * 5]

    def go(spec):
        e = Engine(runner, NullTokenizer(), EngineConfig(), speculator=build_speculator(spec, model, runner))
        hs = [
            e.submit(GenerationRequest(f"r{i}", p, shaped[i % len(shaped)], max_tokens=32, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        e.start()
        try:
            evs = [list(h) for h in hs]
            return [[t for ev in x for t in ev.token_ids] for x in evs], [[ev.logprobs for ev in x] for x in evs], e.stats()
        finally:
            e.shutdown(10)

    try:
        plain, plain_lp, _ = go(None)
        spec, spec_lp, stats = go(SpecConfig("draft", str(target), k=4))
        assert spec == plain
        assert stats.spec_accepted_tokens > 0
        for i in (1, 3):
            for a, b in zip(plain_lp[i], spec_lp[i], strict=True):
                assert a is not None and b is not None
                assert np.isclose(a[0][0], b[0][0], atol=1e-3)
                assert [t for t, _ in a[0][1]] == [t for t, _ in b[0][1]]
    finally:
        runner.close()
