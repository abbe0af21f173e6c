"""Sampling extras (issue #39): logit bias, the packed constraint mask, log probabilities, their
path through the engine loop on the reference runner, and engine.grammar's llguidance constraints."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.engine_probes import unpack_mask
from fixtures.fake_runner import FakeTokenizer

from engine.loop import Engine, EngineConfig
from engine.sampling import apply_token_mask, sample_item, token_logprobs, validate_sampling
from engine.types import GenerationRequest, MemraError, SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


def _pack(allowed: set[int], vocab: int) -> np.ndarray:
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_mask_matches_llguidance_numpy_reference():
    llg = pytest.importorskip("llguidance.numpy")
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 1000, 49152):
        words = rng.integers(-(1 << 31), 1 << 31, size=(vocab + 31) // 32, dtype=np.int64).astype(np.int32)
        words[0] |= 1  # at least one token allowed
        logits = rng.standard_normal(vocab).astype(np.float32)
        want = logits[None, :].copy()
        llg.apply_token_bitmask_inplace(want, words[None, :])
        np.testing.assert_array_equal(apply_token_mask(logits, words), want[0])
        assert unpack_mask(words, vocab).sum() == np.isfinite(want).sum()
    with pytest.raises(MemraError, match="allows no token"):
        apply_token_mask(np.zeros(40, np.float32), np.zeros(2, np.int32))


def _item(sampling, allowed=None):
    return StepItem(0, [1], 0, [0], True, sampling, history=[1], prompt_len=1, allowed=allowed)


def test_sample_item_bias_mask_logprobs():
    logits = np.array([0.0, 3.0, 1.0, 2.0, -1.0], dtype=np.float32)
    assert sample_item(logits, _item(GREEDY)) == 1
    assert sample_item(logits, _item(SamplingParams(temperature=0.0, logit_bias=((4, 10.0),)))) == 4
    assert sample_item(logits, _item(GREEDY, allowed=_pack({0, 2}, 5))) == 2
    it = _item(SamplingParams(temperature=0.0, logprobs=2, logit_bias=((0, 50.0),)))
    assert sample_item(logits, it) == 0
    lp, top = it.logprobs_out
    ref = logits - np.log(np.exp(logits).sum())  # raw distribution: no bias, no mask
    assert lp == pytest.approx(ref[0]) and [t for t, _ in top] == [1, 3]
    assert [v for _, v in top] == pytest.approx([ref[1], ref[3]])
    # a sampled draw never lands on a masked token
    for s in range(50):
        params = SamplingParams(temperature=1.5, seed=s)
        assert sample_item(logits, _item(params, allowed=_pack({2, 4}, 5))) in (2, 4)
    assert token_logprobs(logits, 1, 0)[1] == []


@pytest.mark.parametrize(
    "params,param",
    [
        (SamplingParams(logprobs=21), "top_logprobs"),
        (SamplingParams(logprobs=-1), "top_logprobs"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((3, float("nan")),)), "logit_bias"),
    ],
)
def test_validate_extras(params, param):
    with pytest.raises(MemraError) as e:
        validate_sampling(params)
    assert e.value.param == param


class _OnlyTokens:
    """A TokenConstraint allowing a fixed token set; records what it saw."""

    def __init__(self, allowed: set[int], vocab: int):
        self.mask = _pack(allowed, vocab)
        self.seen: list[int] = []

    def allowed(self):
        return self.mask

    def advance(self, token: int) -> None:
        self.seen.append(token)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from engine.model import load_model

    return load_model(tiny_llama_dir)


def test_loop_applies_constraints_and_reports_logprobs(model):
    from engine.reference import ReferenceRunner

    runner = ReferenceRunner(model, num_blocks=64, block_size=4, max_model_len=64)
    vocab = runner.vocab
    e = Engine(runner, FakeTokenizer(eos_token_ids=frozenset()), EngineConfig(max_running=4))
    con = _OnlyTokens({5, 9, 77}, vocab)
    prompt = [3, 14, 15, 92, 65]
    try:
        h_free = e.submit(GenerationRequest("free", prompt, sampling=GREEDY, max_tokens=6, ignore_eos=True))
        h_con = e.submit(
            GenerationRequest(
                "con", prompt, sampling=SamplingParams(temperature=0.0, logprobs=3), max_tokens=6,
                ignore_eos=True, constraint=con,
            )
        )
        e.start()
        free = [t for ev in h_free for t in ev.token_ids]
        evs = list(h_con)
    finally:
        e.shutdown(5)
    got = [t for ev in evs for t in ev.token_ids]
    assert set(got) <= {5, 9, 77} and con.seen == got and len(got) == 6
    lps = [x for ev in evs for x in (ev.logprobs or [])]
    assert len(lps) == 6 and all(len(top) == 3 and lp <= 0 for lp, top in lps)
    # the unconstrained request batched with it is what it would be alone
    solo = runner.generate(prompt, 6, GREEDY)
    assert free == list(solo)


@pytest.fixture(scope="module")
def smol_tok(smollm2_source):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_source)


def _walk(con, tok, text):
    """Feed ``text``'s tokens, checking each is allowed by the mask first."""
    for t in tok.encode(text):
        mask = con.allowed()
        assert mask is None or unpack_mask(mask, tok.vocab_size)[t], f"token {t} ({tok.decode([t])!r}) masked"
        con.advance(t)


def test_json_schema_constraint_on_smollm2(smol_tok):
    pytest.importorskip("llguidance")
    from engine import grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    con = grammar.build_constraint(smol_tok, grammar.json_grammar(schema))
    first = unpack_mask(con.allowed(), smol_tok.vocab_size)
    assert first[smol_tok.encode("{")[0]] and not first[smol_tok.encode("Hello")[0]]
    _walk(con, smol_tok, '{"a": 12}')
    end = unpack_mask(con.allowed(), smol_tok.vocab_size)
    assert set(np.flatnonzero(end)) <= set(smol_tok.eos_token_ids)  # complete: only an end token
    bad = grammar.build_constraint(smol_tok, grammar.json_grammar(schema))
    with pytest.raises(MemraError, match="left its grammar"):
        bad.advance(smol_tok.encode("Hello")[0])
    with pytest.raises(MemraError):
        grammar.build_constraint(smol_tok, grammar.json_grammar({"type": "object", "properties": 5}))


def test_tool_call_grammar_and_reasoning_phases(smol_tok):
    pytest.importorskip("llguidance")
    from engine import grammar

    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]
    call = '<tool_call>{"name": "f", "arguments": {"x": "hi"}}</tool_call>'
    con = grammar.build_constraint(smol_tok, grammar.tool_call_grammar(tools, None, parallel=True))
    _walk(con, smol_tok, call + "\n" + '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    named = grammar.build_constraint(smol_tok, grammar.tool_call_grammar(tools, "g", parallel=False))
    with pytest.raises((AssertionError, MemraError)):
        _walk(named, smol_tok, call)  # f is not the named tool
    # reasoning phases, with two ordinary tokens standing in for <think> / </think>
    open_id, close_id = smol_tok.encode("Hello")[0], smol_tok.encode("World")[0]
    lt = grammar.ll_tokenizer(smol_tok)
    from llguidance import LLMatcher

    def fresh(inside):
        m = LLMatcher(lt, grammar.json_grammar(None), log_level=0)
        return grammar.GrammarConstraint(m, lt.vocab_size, think=(open_id, close_id), inside=inside)

    c = fresh(inside=True)
    assert c.allowed() is None
    c.advance(smol_tok.encode("free")[0])  # anything goes inside the block
    c.advance(close_id)
    _walk(c, smol_tok, '{"k": 1}')
    c = fresh(inside=False)  # "maybe": the first token may open a block
    first = unpack_mask(c.allowed(), smol_tok.vocab_size)
    assert first[open_id] and first[smol_tok.encode("{")[0]] and not first[close_id]
    c.advance(open_id)
    assert c.allowed() is None
    c = fresh(inside=False)
    _walk(c, smol_tok, '{"k": 2}')  # no block: the grammar starts at once


def test_a_dead_matcher_fails_only_its_request(smol_tok):
    """A grammar that cannot continue never hands the runner an empty mask (which would fail the
    whole step): the step is left unmasked and advance() fails that request."""
    pytest.importorskip("llguidance")
    from engine import grammar

    con = grammar.build_constraint(smol_tok, grammar.json_grammar(None))
    assert not con.matcher.consume_token(smol_tok.encode("Hello")[0])  # the matcher is now in error
    assert con.allowed() is None
    with pytest.raises(MemraError, match="output constraint failed"):
        con.advance(5)
