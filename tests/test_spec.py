"""Speculative decoding (engine.spec) on the numpy reference backend.

Greedy with speculation (prompt lookup, a draft model accepting everything, a draft model accepting
little) is byte-identical to plain greedy, solo and batched, through preemption and prefix-cache
hits; the rejection rule preserves the target distribution (chi-square against the exact
distribution, which a deliberately biased rule fails); rollback frees only rejected positions'
blocks and never hashes them; the policy turns speculation down; the MTP error is one line;
constrained, logit-biased and logprobs requests decode plainly beside speculating rows, with the
tokens, logprobs and constraint steps they get without a speculator.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from fixtures.checkpoints import write_llama_safetensors
from fixtures.engine_waves import PROMPTS as BASE_PROMPTS
from fixtures.fake_runner import FakeTokenizer

from engine.block_manager import BlockManager
from engine.loop import Engine, EngineConfig
from engine.sampling import filtered_probs, sample
from engine.spec import accept as accept_mod
from engine.spec.build import build_speculator
from engine.spec.config import SpecConfig, parse_speculative
from engine.spec.policy import SpecPolicy
from engine.spec.proposer import MtpProposer, NgramProposer
from engine.types import ConfigError, GenerationRequest, MemraError, SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [*BASE_PROMPTS, [9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8]]


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719 is p = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from engine.model import load_model

    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> Path:
    """A tiny Llama with different random weights and the same tokenizer: a poor draft."""
    return write_llama_safetensors(tmp_path_factory.mktemp("tiny_draft"), seed=1)


def spec_engine(runner, model, spec, cfg: EngineConfig | None = None) -> Engine:
    """An engine over ``runner`` with ``spec``'s speculator (None: off), a tokenizer without EOS, and
    the block invariants checked after every step."""
    return Engine(
        runner,
        FakeTokenizer(eos_token_ids=frozenset()),
        cfg or EngineConfig(),
        on_step=lambda e: e.check_invariants(),
        speculator=build_speculator(spec, model, runner),
    )


def run(model, prompts, spec=None, *, sampling=GREEDY, max_tokens=24, num_blocks=64, seeds=None, opt_out=(), **cfg):
    """Submit every prompt at once; return (token lists, EngineStats)."""
    from engine.reference import ReferenceRunner

    runner = ReferenceRunner(model, num_blocks=num_blocks, block_size=4, max_model_len=128)
    e = spec_engine(runner, model, spec, EngineConfig(**cfg))
    try:
        handles = []
        for i, p in enumerate(prompts):
            s = sampling if seeds is None else SamplingParams(**{**sampling.__dict__, "seed": seeds[i]})
            req = GenerationRequest(
                f"r{i}", p, sampling=s, max_tokens=max_tokens, ignore_eos=True, speculative=i not in opt_out
            )
            handles.append(e.submit(req))
        e.start()
        outs = []
        for h in handles:
            evs = list(h)
            assert evs[-1].finish_reason == "length", evs[-1].error
            assert all(len(ev.token_ids) == 1 for ev in evs)  # one event per token, drafts or not
            outs.append([t for ev in evs for t in ev.token_ids])
        stats = e.stats()
        assert stats.kv_blocks_used == 0
        return outs, stats
    finally:
        e.shutdown(5)


# ----- greedy exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_greedy_with_speculation_equals_plain_greedy_solo_and_batched(model, tiny_llama_dir, other_draft, method):
    spec = {
        "ngram": SpecConfig("ngram", k=4, ngram_min=1),
        "draft-self": SpecConfig("draft", str(tiny_llama_dir), k=4),
        "draft-other": SpecConfig("draft", str(other_draft), k=3),
    }[method]
    plain = [run(model, [p])[0][0] for p in PROMPTS]
    solo = []
    for p in PROMPTS:
        out, stats = run(model, [p], spec)
        solo.append(out[0])
    assert solo == plain
    batched, stats = run(model, PROMPTS, spec)
    assert batched == plain
    assert stats.spec_verify_rows > 0 and stats.spec_draft_tokens >= stats.spec_verify_rows
    if method == "draft-self":  # the target as its own draft: everything is accepted
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert stats.steps < len(plain[0]) * 2
    if method == "ngram":
        assert stats.spec_accepted_tokens > 0


def test_greedy_speculation_through_preemption_prefix_hits_and_chunks(model, tiny_llama_dir):
    plain = [run(model, [p])[0][0] for p in PROMPTS]
    spec = SpecConfig("draft", str(tiny_llama_dir), k=4)
    out, stats = run(
        model, PROMPTS + PROMPTS, spec, num_blocks=24, max_running=6, prefill_chunk_tokens=6, max_step_tokens=16
    )
    assert out == plain + plain
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.spec_accepted_tokens > 0


def test_per_request_opt_out(model, tiny_llama_dir):
    spec = SpecConfig("draft", str(tiny_llama_dir), k=4)
    out, stats = run(model, PROMPTS[:2], spec, opt_out=(0, 1))
    assert stats.spec_draft_tokens == 0
    assert out == [run(model, [p])[0][0] for p in PROMPTS[:2]]


def test_policy_turns_speculation_off_for_large_batches(model, tiny_llama_dir):
    spec = SpecConfig("draft", str(tiny_llama_dir), k=4, max_batch=2)
    _, stats = run(model, PROMPTS, spec, max_tokens=8)
    _, solo = run(model, PROMPTS[:2], spec, max_tokens=8)
    assert solo.spec_draft_tokens > 0
    # 5 decode rows > max_batch until requests finish together: no drafts at all
    assert stats.spec_draft_tokens == 0


def test_policy_follows_measured_acceptance():
    pol = SpecPolicy(4, max_batch=8, verify_cost=0.1, probe_every=4)
    assert pol.tokens_for(1, 1) == 4  # optimistic start
    assert pol.tokens_for(1, 9) == 0  # batch above max_batch
    for _ in range(10):
        pol.record(1, 4, 0)
    ks = [pol.tokens_for(1, 1) for _ in range(8)]
    assert ks.count(0) == 6 and ks.count(1) == 2  # off, but probing every 4th step
    for _ in range(20):
        pol.record(1, 1, 1)
    assert pol.tokens_for(1, 1) == 4
    assert SpecPolicy(4, verify_cost=1.0).best_k(0.99) == 0  # verification as dear as decoding


# ----- rollback ------------------------------------------------------------------------------------


def test_truncate_frees_only_rejected_blocks_and_never_hashes_them():
    bm = BlockManager(16, 4)
    salt = b"s" * 16
    toks = list(range(10))
    assert bm.allocate(1, toks, salt) == 0
    bm.commit(1, toks, 10)  # 2 full blocks committed
    assert bm.grow(1, 10 + 1 + 5)  # a decode row with a 5-token draft: positions 10..15
    assert len(bm.table(1)) == 4
    free_before = bm.num_free
    assert bm.truncate(1, 12) == 1  # 1 draft token accepted: positions < 12 stay
    assert len(bm.table(1)) == 3 and bm.num_free == free_before + 1
    bm.commit(1, toks + [10, 11], 12)  # block 2 is full of accepted tokens only now
    bm.check_invariants()
    assert bm.num_cached == 0 and len(bm._by_hash) == 3
    with pytest.raises(ValueError, match="committed"):
        bm.truncate(1, 4)
    bm.free(1)
    bm.check_invariants()
    # a prompt sharing only the accepted tokens hits exactly those three blocks
    assert bm.allocate(2, toks + [10, 11, 99], salt) == 12


# ----- proposers -----------------------------------------------------------------------------------


def test_ngram_proposer_finds_the_latest_longest_match_incrementally():
    ng = NgramProposer(min_n=2, max_n=3)
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert ng.lookup(0, toks, 3) == [4, 5, 9]  # "1 2 3" at 0..2 beats the later, shorter "2 3" at 6..7
    toks2 = [1, 2, 3, 4, 2, 3, 5, 6, 2, 3]
    ng2 = NgramProposer(min_n=2, max_n=3)
    assert ng2.lookup(0, toks2, 2) == [5, 6]  # of two "2 3", the latest
    assert ng.lookup(1, [1, 2, 3], 4) == []  # nothing earlier to match
    toks.append(4)
    assert ng.lookup(0, toks, 2) == [5, 9]  # the index grows with the sequence
    ng.release(0)
    assert 0 not in ng._index


def test_mtp_says_the_model_has_no_mtp_head(model):
    with pytest.raises(MemraError, match=r"has no MTP head") as e:
        MtpProposer(model)
    assert "\n" not in str(e.value)


def test_parse_speculative_flags():
    assert parse_speculative(None) is None
    assert parse_speculative("ngram") == SpecConfig("ngram", k=4)
    assert parse_speculative("draft:/m/x.gguf", 2) == SpecConfig("draft", "/m/x.gguf", k=2)
    for bad, k, msg in [
        ("draft", None, "PATH"),
        ("eagle", None, "unknown method"),
        ("ngram", 0, "between 1"),
        ("ngram:x", None, "only draft"),
        (None, 3, "needs --speculative"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            parse_speculative(bad, k)


def test_draft_with_another_vocabulary_is_refused(model, tmp_path):
    from engine.reference import ReferenceRunner

    other = write_llama_safetensors(tmp_path / "v", vocab_size=500)
    runner = ReferenceRunner(model, num_blocks=8, block_size=4, max_model_len=32)
    with pytest.raises(MemraError, match="vocabulary has 500 tokens"):
        build_speculator(SpecConfig("draft", str(other)), model, runner)


# ----- the rejection rule preserves the target distribution ----------------------------------------


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    exp = n * probs[keep]
    return float(((counts[keep] - exp) ** 2 / exp).sum())


def _rule_counts(p_logits: np.ndarray, q: np.ndarray | None, n: int) -> np.ndarray:
    """First emitted token of ``accept`` over n seeds, drafts drawn from q (or fixed to token 2)."""
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(p_logits.shape[1], dtype=np.int64)
    rng = np.random.default_rng(123)
    for seed in range(n):
        d = int(rng.choice(len(q), p=q)) if q is not None else 2
        item = StepItem(
            0, [0, d], 5, [0], True, SamplingParams(temperature=1.0, seed=seed), draft=[d],
            draft_probs=None if q is None else q[None, :],
        )
        counts[accept_mod.accept(p_logits, item)[0]] += 1
    del params
    return counts


P_LOGITS = np.log(np.array([[0.05, 0.10, 0.30, 0.20, 0.35, 0.0001], [0.2] * 5 + [0.0001]]))
Q = np.array([0.40, 0.05, 0.05, 0.40, 0.05, 0.05])


@pytest.mark.parametrize("proposal", ["sampled", "point"])
def test_rejection_rule_emits_the_target_distribution(proposal):
    q = Q if proposal == "sampled" else None
    p = filtered_probs(P_LOGITS[0], SamplingParams(temperature=1.0))
    assert _chi2(_rule_counts(P_LOGITS, q, 4000), p) < chi2_critical(5)


def test_a_biased_rule_fails_the_same_test(monkeypatch):
    """Resampling from p instead of the residual after a rejection (a classic bug) is detected."""
    p = filtered_probs(P_LOGITS[0], SamplingParams(temperature=1.0))
    monkeypatch.setattr(accept_mod, "residual", lambda p, q: p)
    for q in (Q, None):
        assert _chi2(_rule_counts(P_LOGITS, q, 4000), p) > 10 * chi2_critical(5)


def test_empty_draft_samples_exactly_like_plain_sampling():
    logits = np.random.default_rng(0).normal(size=(1, 50)).astype(np.float32)
    for seed in range(50):
        s = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, seed=seed)
        item = StepItem(0, [3], 7, [0], True, s, history=[1, 2, 3], prompt_len=2, num_generated=4)
        assert accept_mod.accept(logits, item) == [sample(logits[0], s, [1, 2, 3], 2, 4)]


def test_greedy_penalties_see_the_drafted_history():
    """With a repetition penalty, row i's argmax is taken over history + draft[:i]."""
    logits = np.zeros((3, 8), dtype=np.float32)
    logits[:, 5] = 1.0
    logits[:, 6] = 0.9
    s = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    item = StepItem(0, [1, 5, 6], 3, [0], True, s, history=[1], prompt_len=1, draft=[5, 6])
    # row 0: 5 wins; row 1: 5 penalised to 0.5 -> 6 (= draft); row 2: 5 (0.5) beats 6 (0.45)
    assert accept_mod.accept(logits, item) == [5, 6, 5]


def _exact_joint(model, prompt, sampling, n_tokens):
    """The exact distribution of the first n_tokens sampled tokens (dict: tuple -> prob)."""
    from engine.reference import ReferenceRunner

    runner = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64)
    joint = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, pr in joint.items():
            logits = runner.forward_logits(prompt + list(prefix))[-1]
            p = filtered_probs(logits, sampling)
            for t in np.nonzero(p)[0]:
                nxt[prefix + (int(t),)] = pr * float(p[t])
        joint = nxt
    return joint


def _engine_joint_chi2(model, spec, prompt, sampling, n):
    outs, stats = run(
        model, [prompt] * n, spec, sampling=sampling, max_tokens=3, seeds=list(range(n)),
        num_blocks=4096, max_running=256, max_waiting=4096,
    )
    exact = _exact_joint(model, prompt, sampling, 3)
    keys = sorted(exact)
    counts = Counter(tuple(o) for o in outs)
    assert set(counts) <= set(keys)
    return _chi2(np.array([counts[k] for k in keys]), np.array([exact[k] for k in keys])), len(keys), stats


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_with_a_draft_model_keeps_the_target_distribution(model, tiny_llama_dir, monkeypatch, biased):
    """Three sampled tokens (top-k 3: 27 outcomes) from 1000 seeds through the engine with a draft
    model (the target's own greedy token: accepted often, not always), against the exact joint
    distribution of the target; the biased rule must fail."""
    sampling = SamplingParams(temperature=1.0, top_k=3)
    spec = SpecConfig("draft", str(tiny_llama_dir), k=2, max_batch=10_000)
    if biased:
        monkeypatch.setattr(accept_mod, "residual", lambda p, q: p)
    chi2, cells, stats = _engine_joint_chi2(model, spec, [5, 17, 99, 3], sampling, 1000)
    assert stats.spec_verify_rows >= 1000  # every request verified a draft
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    if biased:
        assert chi2 > 3 * chi2_critical(cells - 1)
    else:
        assert chi2 < chi2_critical(cells - 1)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_random_load_with_speculation_aborts_and_preemption(model, tiny_llama_dir, other_draft, draft):
    """40 requests with random prompts (shared prefixes), lengths, opt-outs, a few aborts and a small
    cache, with a draft accepting everything or little and k up to 4: every greedy output that
    finished equals its solo plain output, the block invariants hold after every step, and every
    block is released."""
    import random

    from engine.reference import ReferenceRunner

    rng = random.Random(7)
    base = [rng.randrange(1, 128) for _ in range(12)]
    prompts = [base[: rng.randrange(2, 12)] + [rng.randrange(1, 128) for _ in range(rng.randrange(1, 6))] for _ in range(40)]
    lens = [rng.randrange(1, 30) for _ in prompts]
    runner = ReferenceRunner(model, num_blocks=24, block_size=4, max_model_len=128)
    path = tiny_llama_dir if draft == "self" else other_draft
    spec = SpecConfig("draft", str(path), k=4, max_batch=6)
    e = spec_engine(runner, model, spec, EngineConfig(max_running=8, prefill_chunk_tokens=8, max_step_tokens=24))
    handles = [
        e.submit(GenerationRequest(f"q{i}", p, GREEDY, max_tokens=n, ignore_eos=True, speculative=i % 5 != 0))
        for i, (p, n) in enumerate(zip(prompts, lens, strict=True))
    ]
    e.start()
    for i in (3, 17, 31):
        e.abort(f"q{i}")
    try:
        outs = {}
        for i, h in enumerate(handles):
            evs = list(h)
            if evs[-1].finish_reason == "length":
                outs[i] = [t for ev in evs for t in ev.token_ids]
            else:
                assert evs[-1].finish_reason == "abort"
        stats = e.stats()
    finally:
        e.shutdown(5)
    assert len(outs) >= 37 and stats.kv_blocks_used == 0 and stats.preemptions > 0
    assert stats.spec_verify_rows > 0
    assert (stats.spec_accepted_tokens == stats.spec_draft_tokens) == (draft == "self")
    for i, toks in outs.items():
        assert toks == runner.generate(prompts[i], lens[i]), i


# ----- requests the host sampler shapes (constraint, logit bias, logprobs) beside speculating rows ---


class _EveryThird:
    """A TokenConstraint allowing, at generated token n, the ids t with (t + n) % 3 == 0; records
    what it was advanced with and fails a token it does not allow (as engine.grammar's does)."""

    def __init__(self, vocab: int):
        self.vocab, self.seen = vocab, []

    def _ok(self, t: int) -> bool:
        return (t + len(self.seen)) % 3 == 0

    def allowed(self):
        bits = np.zeros(((self.vocab + 31) // 32) * 32, dtype=np.uint8)
        bits[[t for t in range(self.vocab) if self._ok(t)]] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    def advance(self, token: int) -> None:
        if not self._ok(token):
            raise MemraError(f"token {token} breaks the constraint")
        self.seen.append(token)


def test_constrained_biased_and_logprobs_requests_beside_speculation_match_plain(model, tiny_llama_dir, monkeypatch):
    """With the target as its own draft (every draft accepted), the plain greedy rows speculate while
    a constrained, a logit-biased and two logprobs requests (greedy and seeded sampling) in the same
    batch decode one token a step through verify's plain rows: every request gets the tokens (and
    logprobs) it gets without a speculator, and the constraint is advanced with each of them."""
    from engine.reference import ReferenceRunner

    vocab = int(model.dims["vocab"])
    seen_rows: list[tuple[bool, bool]] = []  # per verify row: (has a draft, is shaped by the host sampler)

    def go(spec):
        runner = ReferenceRunner(model, num_blocks=64, block_size=4, max_model_len=128)
        verify = runner.verify

        def spy(items):
            seen_rows.extend((bool(it.draft), it.allowed is not None or it.sampling.needs_host) for it in items)
            return verify(items)

        monkeypatch.setattr(runner, "verify", spy)
        e = spec_engine(runner, model, spec)
        constraint = _EveryThird(vocab)
        top = max(range(vocab), key=lambda t: t % 7)  # some token the model would not pick on its own
        shaped = [
            (GREEDY, None),
            (GREEDY, constraint),
            (SamplingParams(temperature=0.0, logit_bias=((top, 6.0), (3, -100.0))), None),
            (SamplingParams(temperature=0.0, logprobs=3), None),
            (SamplingParams(temperature=0.8, top_k=20, seed=11, logprobs=0), None),
            (GREEDY, None),
        ]
        try:
            hs = [
                e.submit(GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], sampling=s, max_tokens=12,
                                           ignore_eos=True, constraint=c))
                for i, (s, c) in enumerate(shaped)
            ]
            e.start()
            outs = []
            for h in hs:
                evs = list(h)
                assert evs[-1].finish_reason == "length", evs[-1].error
                outs.append(([t for ev in evs for t in ev.token_ids], [ev.logprobs for ev in evs]))
            return outs, e.stats(), constraint.seen
        finally:
            e.shutdown(5)

    plain, _, plain_seen = go(None)
    seen_rows.clear()
    spec, stats, spec_seen = go(SpecConfig("draft", str(tiny_llama_dir), k=4))
    assert spec == plain
    assert spec_seen == plain_seen == plain[1][0]  # the constraint saw every token, in order
    assert all((t + n) % 3 == 0 for n, t in enumerate(plain[1][0]))
    assert all(lp is None for _, lps in plain[:3] for lp in lps) and plain[5][1][0] is None
    for _, lps in plain[3:5]:  # one (logprob, top) per token event
        assert all(lp is not None and len(lp) == 1 for lp in lps)
    assert [len(lp[0][1]) for lp in plain[3][1]] == [3] * 12
    # the plain rows accepted drafts; shaped rows went through verify steps but never carried one
    assert stats.spec_accepted_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert any(host for _, host in seen_rows) and not any(d and host for d, host in seen_rows)
