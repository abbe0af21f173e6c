"""MTP heads as the third speculative proposer (engine.spec.mtp_head, MtpProposer) and speculative
decoding on hybrids (the reference's verify restores the recurrent state), on a tiny random Qwen3.5
with one MTP layer, numpy reference backend.

The head's logits and fed-back hidden state match an independent numpy implementation of the
Qwen3.5 MTP block written here (concat order [embedding | hidden], gated attention with q/k norms
and partial rotary, SwiGLU, its own KV over the positions it has seen); greedy with `--speculative
mtp` (and ngram, on the hybrid) is byte-identical to plain greedy, solo and batched, through
preemption and prefix hits; the acceptance counters move; the MTP head drafts the target's
continuation when its weights make it a copy of the target's last layer path; the one-line errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures.engine_waves import GREEDY, PROMPTS, serve_waves, tokens_of
from fixtures.fake_runner import FakeTokenizer
from fixtures.hybrid import write_hybrid_moe_hf, write_qwen3_5_hf

from engine.loop import Engine, EngineConfig
from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.spec.build import build_speculator
from engine.spec.config import SpecConfig
from engine.spec.hidden_tap import HiddenTap
from engine.spec.mtp_head import MtpHeadReference
from engine.spec.proposer import MtpProposer
from engine.types import ConfigError, GenerationRequest, MemraError, SamplingParams, StepItem


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return write_qwen3_5_hf(tmp_path_factory.mktemp("qwen3_5_mtp"), seed=5, mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def model(mtp_dir):
    return load_model(mtp_dir)


# ----- the head against an independent numpy implementation -----------------------------------------


def _rms(x, w, eps=1e-6):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def numpy_mtp(raw: dict, cfg: dict, tokens, hidden, positions):
    """Qwen3.5's MTP block from the HF tensors (zero-centred norms: 1 + w), float64: row t reads
    token tokens[t] and hidden[t] at position positions[t], attending causally over rows <= t."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rd = int(hd * cfg["rope_parameters"]["partial_rotary_factor"])
    theta = cfg["rope_parameters"]["rope_theta"]
    p = "mtp.layers.0."
    e = _rms(raw["model.embed_tokens.weight"][tokens], raw["mtp.pre_fc_norm_embedding.weight"])
    hh = _rms(np.asarray(hidden), raw["mtp.pre_fc_norm_hidden.weight"])
    x = np.concatenate([e, hh], -1) @ raw["mtp.fc.weight"].T
    T = len(tokens)
    h = _rms(x, raw[p + "input_layernorm.weight"])
    qg = (h @ raw[p + "self_attn.q_proj.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ raw[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (h @ raw[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    q, k = _rms(q, raw[p + "self_attn.q_norm.weight"]), _rms(k, raw[p + "self_attn.k_norm.weight"])
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(t):  # NeoX halves over the first rd dims
        a, b, rest = t[..., : rd // 2], t[..., rd // 2 : rd], t[..., rd:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], -1)

    q, k = rope(q), rope(k)
    rep = nh // nkv
    out = np.zeros((T, nh, hd))
    for t in range(T):
        for head in range(nh):
            s = k[: t + 1, head // rep] @ q[t, head] / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[t, head] = (w / w.sum()) @ v[: t + 1, head // rep]
    ao = (out * (1.0 / (1.0 + np.exp(-gate)))).reshape(T, nh * hd)
    x = x + ao @ raw[p + "self_attn.o_proj.weight"].T
    h = _rms(x, raw[p + "post_attention_layernorm.weight"])
    x = x + (_moe(raw, cfg, p + "mlp.", h) if "num_experts" in cfg else _swiglu(raw, p + "mlp.", h))
    hn = _rms(x, raw["mtp.norm.weight"])
    return hn @ raw["lm_head.weight"].T, hn


def _swiglu(raw, p, h):
    g, u = h @ raw[p + "gate_proj.weight"].T, h @ raw[p + "up_proj.weight"].T
    return (g / (1.0 + np.exp(-g)) * u) @ raw[p + "down_proj.weight"].T


def _moe(raw, cfg, p, h):
    """Top-k softmax routing (renormalised), routed SwiGLU experts + the sigmoid-gated shared one."""
    logits = h @ raw[p + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(len(h)):
        top = np.argsort(-probs[t], kind="stable")[: cfg["num_experts_per_tok"]]
        w = probs[t, top] / probs[t, top].sum()
        for e, we in zip(top, w, strict=True):
            out[t] += we * _swiglu(raw, p + f"experts.{e}.", h[t : t + 1])[0]
    gate = 1.0 / (1.0 + np.exp(-(h @ raw[p + "shared_expert_gate.weight"].T)))
    return out + gate * _swiglu(raw, p + "shared_expert.", h)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_hybrid_moe_hf(tmp_path_factory.mktemp("qwen3_5_moe_mtp"), seed=6, bf16=False, mtp_num_hidden_layers=1)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_mtp_head_matches_an_independent_numpy_implementation(which, model, mtp_dir, moe_dir):
    from safetensors.numpy import load_file

    path = mtp_dir if which == "dense" else moe_dir
    model = model if which == "dense" else load_model(moe_dir)
    raw = {k: v.astype(np.float64) for k, v in load_file(path / "model.safetensors").items()}
    cfg = json.loads((path / "config.json").read_text())
    runner = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64)
    head = MtpHeadReference(runner)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, cfg["vocab_size"], 9)]
    hidden = rng.standard_normal((9, cfg["hidden_size"])).astype(np.float32)
    want_logits, want_h = numpy_mtp(raw, cfg, tokens, hidden.astype(np.float64), range(9))
    # a chunk of 6 positions, then 3 one-position steps over the head's cache (as drafting runs it)
    table = [0, 1, 2]
    got = [head.forward(tokens[:6], hidden[:6], 0, table)]
    got += [head.forward([tokens[t]], hidden[t : t + 1], t, table) for t in range(6, 9)]
    for (tok, logits, h), t in zip(got, [5, 6, 7, 8], strict=True):
        scale = np.abs(want_logits[t]).max()
        assert np.abs(logits - want_logits[t]).max() / scale < 1e-4
        assert np.abs(h - want_h[t]).max() / np.abs(want_h[t]).max() < 1e-4
        assert tok == int(np.argmax(want_logits[t]))


def test_target_hidden_state_is_the_final_normed_value(model):
    """The tap keeps the main graph's `h` after final_norm (what the head's hidden input expects):
    lm_head applied to a tapped row gives the target's logits of that position."""
    runner = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64)
    runner.hidden_tap = HiddenTap(model.graph.mtp.hidden_from)
    prompt = PROMPTS[0]
    item = StepItem(0, prompt, 0, [0, 1, 2, 3], False, GREEDY, state_slot=0)
    runner.step([item])
    rows = runner.hidden_tap.rows(0, 0, len(prompt))
    want = runner.forward_logits(prompt)
    got = rows @ runner.weight("lm_head", None).T
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_hybrid_verify_restores_the_state_of_the_accepted_position(model):
    """verify() of [x, d1, d2, d3] accepting d1 only: logits and recurrent state equal those of
    plain one-token steps over [x, d1]; the next step continues exactly like plain decode."""
    prompt = PROMPTS[0]
    plain = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64, state_slots=2)
    spec = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64, state_slots=2)
    table = list(range(8))
    for r in (plain, spec):
        r.step([StepItem(0, prompt[:-1], 0, table, False, GREEDY, state_slot=0)])
    n = len(prompt) - 1
    want = []
    for j in range(4):  # plain decode: the last prompt token, then the greedy tokens
        tok = prompt[-1] if j == 0 else want[-1]
        want.append(plain.step([StepItem(0, [tok], n + j, table, True, GREEDY, state_slot=0)])[0])
    draft = [want[0], (want[1] + 1) % model.dims["vocab"], 5]  # d1 right, d2 wrong
    item = StepItem(0, [prompt[-1], *draft], n, table, True, GREEDY, state_slot=0, draft=draft)
    assert spec.verify([item]) == [[want[0], want[1]]]
    # the sequence continues from n + 2 valid positions: the state holds [.., x, d1] only
    got = spec.step([StepItem(0, [want[1]], n + 2, table, True, GREEDY, state_slot=0)])[0]
    assert got == want[2]
    ref_state = {k: v[0] for k, v in plain.states.items()}
    one_more = spec.step([StepItem(0, [want[2]], n + 3, table, True, GREEDY, state_slot=0)])[0]
    assert one_more == want[3]
    for key, arr in spec.states.items():
        assert np.array_equal(arr[0], ref_state[key]), key


def test_mtp_proposer_catches_up_and_survives_a_recompute(model):
    """Proposing straight on the runner: the head runs the prompt's positions once, drafts k
    tokens; after a recompute (the target taps the same positions again, no new token) it drafts
    the same tokens again instead of failing; release drops its blocks and the tapped rows."""
    from engine.spec.proposer import ProposeRequest

    runner = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64, state_slots=2)
    proposer = build_speculator(SpecConfig("mtp", k=3), model, runner).proposer
    prompt = PROMPTS[0]
    item = StepItem(7, prompt[:-1], 0, list(range(8)), False, GREEDY, state_slot=0)
    runner.step([item])
    req = ProposeRequest(7, prompt, 3, GREEDY)
    first = proposer.propose([req])[0].tokens
    assert len(first) == 3 and runner.hidden_tap.span(7) == (len(prompt) - 1, len(prompt) - 1)
    runner.step([item])  # recompute: rows 0..n-2 tapped again
    assert proposer.propose([req])[0].tokens == first
    proposer.release(7)
    assert proposer.blocks.num_used == 0 and len(runner.hidden_tap) == 0


# ----- through the engine --------------------------------------------------------------------------


def run(model, prompts, spec=None, *, max_tokens=16, num_blocks=64, state_slots=16, **cfg):
    runner = ReferenceRunner(model, num_blocks=num_blocks, block_size=4, max_model_len=128, state_slots=state_slots)
    speculator = build_speculator(spec, model, runner)
    outs, stats = serve_waves(runner, [prompts], max_tokens=max_tokens, speculator=speculator, **cfg)
    assert stats.kv_blocks_used == 0 and stats.state_slots_live == 0
    if spec is not None and spec.method == "mtp":
        assert len(runner.hidden_tap) == 0  # every sequence's rows dropped at its end
        assert speculator.proposer.blocks.num_used == 0
    return tokens_of(outs), stats


@pytest.fixture(scope="module")
def plain(model):
    return [run(model, [p])[0][0] for p in PROMPTS]


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_greedy_with_speculation_on_a_hybrid_equals_plain_greedy(model, plain, method):
    spec = SpecConfig(method, k=3, ngram_min=1)
    solo = [run(model, [p], spec)[0][0] for p in PROMPTS[:2]]
    assert solo == plain[:2]
    batched, stats = run(model, PROMPTS, spec)
    assert batched == plain
    assert stats.spec_verify_rows > 0 and stats.spec_draft_tokens >= stats.spec_verify_rows


def test_mtp_through_preemption_prefix_hits_and_chunks(model, plain):
    spec = SpecConfig("mtp", k=2)
    outs, stats = run(model, PROMPTS + [PROMPTS[0]], spec, num_blocks=20, max_running=5,
                      prefill_chunk_tokens=5, max_step_tokens=12)  # fmt: skip
    assert outs == plain + [plain[0]]
    assert stats.preemptions > 0 and stats.spec_draft_tokens > 0


def test_mtp_after_a_prefix_cache_hit_starts_its_cache_at_the_first_computed_position(model, plain):
    """A repeated prompt hits the prefix cache, so the target never computes (nor taps) the cached
    positions: the head's cache starts at the first computed one, and the output is still plain's."""
    runner = ReferenceRunner(model, num_blocks=64, block_size=4, max_model_len=128, state_slots=16)
    speculator = build_speculator(SpecConfig("mtp", k=3), model, runner)
    bases = []
    original = speculator.proposer._row

    def row(seq_id, first):
        r = original(seq_id, first)
        bases.append(r.base)
        return r

    speculator.proposer._row = row
    outs, _ = serve_waves(runner, [[PROMPTS[0]], [PROMPTS[0]]], max_tokens=16, speculator=speculator)
    assert [o for o, _ in outs] == [plain[0], plain[0]]
    cached = outs[1][1]
    assert cached > 0 and bases[0] == 0 and max(bases) == cached


def test_mtp_drafts_are_accepted_when_the_head_predicts_the_target(model, plain):
    """The real head runs (its cache and positions as always) but its draft is replaced by the
    target's own greedy continuation: acceptance is 100 %, the counters say so, steps drop."""
    runner = ReferenceRunner(model, num_blocks=64, block_size=4, max_model_len=128, state_slots=16)
    speculator = build_speculator(SpecConfig("mtp", k=3), model, runner)
    real = speculator.proposer.head
    continuation = {tuple(p): p + c for p, c in zip(PROMPTS, plain, strict=True)}

    class Oracle:  # the real head's cache bookkeeping, the target's next token as the draft
        num_blocks, block_size, max_model_len = real.num_blocks, real.block_size, real.max_model_len

        def __init__(self):
            self.seq: list[int] = []

        def forward(self, tokens, hidden, start_pos, table):
            tok, logits, h = real.forward(tokens, hidden, start_pos, table)
            full = next(c for c in continuation.values() if c[: len(self.seq)] == self.seq)
            return full[start_pos + len(tokens) + 1], logits, h

    oracle = Oracle()
    speculator.proposer.head = oracle
    original = speculator.proposer._propose_one

    def propose_one(r):
        oracle.seq = list(r.tokens)
        return original(r)

    speculator.proposer._propose_one = propose_one
    [(out, _)], stats = serve_waves(runner, [[PROMPTS[0]]], max_tokens=16, speculator=speculator)
    assert out == plain[0]
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert stats.steps < 16


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_greedy_with_mtp_on_moe_hybrids_equals_plain_greedy(tmp_path, family):
    m = load_model(write_hybrid_moe_hf(tmp_path, family=family, seed=7, mtp_num_hidden_layers=1))
    assert m.graph.family == family
    want = [run(m, [p], max_tokens=8)[0][0] for p in PROMPTS[:2]]
    got, stats = run(m, PROMPTS[:2], SpecConfig("mtp", k=3), max_tokens=8)
    assert got == want and stats.spec_draft_tokens > 0


def test_random_mtp_head_acceptance_counters(model, plain):
    """A random head drafts poorly (the policy then drafts less) but the counters account for it."""
    outs, stats = run(model, PROMPTS[:1], SpecConfig("mtp", k=2))
    assert outs == plain[:1]
    assert stats.spec_draft_tokens >= stats.spec_verify_rows > 0
    assert 0 <= stats.spec_accepted_tokens <= stats.spec_draft_tokens


@pytest.mark.parametrize("biased", [False, True])
def test_sampling_on_a_hybrid_with_speculation_keeps_the_target_distribution(model, monkeypatch, biased):
    """Five sampled tokens (top-k 2: 32 outcomes) from 500 seeds through the engine on the hybrid,
    each row drafting the target's own greedy continuation (accepted often, not always, so the
    recurrent state is put back to every possible position), against the exact joint distribution;
    the biased rule (resampling from p instead of the residual) must fail the same test."""
    from collections import Counter

    from engine.sampling import filtered_probs
    from engine.spec import accept as accept_mod
    from engine.spec.proposer import Draft
    from engine.spec.speculator import Speculator

    if biased:
        monkeypatch.setattr(accept_mod, "residual", lambda p, q: p)
    sampling = SamplingParams(temperature=1.0, top_k=2)
    prompt, n, length = [5, 17, 99, 3], 500, 5
    oracle = ReferenceRunner(model, num_blocks=8, block_size=4, max_model_len=32)
    memo: dict[tuple, int] = {}

    def greedy_next(tokens):
        key = tuple(tokens)
        if key not in memo:
            memo[key] = int(np.argmax(oracle.forward_logits(list(tokens))[-1]))
        return memo[key]

    class SelfDraft:
        name = "self"

        def propose(self, requests):
            out = []
            for r in requests:
                toks = list(r.tokens)
                for _ in range(r.k):
                    toks.append(greedy_next(toks))
                out.append(Draft(toks[len(r.tokens) :]))
            return out

        def release(self, seq_id):
            pass

    runner = ReferenceRunner(model, num_blocks=4096, block_size=4, max_model_len=32, state_slots=300)
    spec = Speculator(SelfDraft(), SpecConfig("ngram", k=2, max_batch=10_000))
    e = Engine(runner, FakeTokenizer(eos_token_ids=frozenset()),
               EngineConfig(max_running=256, max_waiting=4096), speculator=spec)  # fmt: skip
    try:
        handles = [
            e.submit(GenerationRequest(f"r{i}", prompt, sampling=SamplingParams(temperature=1.0, top_k=2, seed=i),
                                       max_tokens=length, ignore_eos=True))
            for i in range(n)
        ]  # fmt: skip
        e.start()
        outs = [tuple(t for ev in h for t in ev.token_ids) for h in handles]
        stats = e.stats()
    finally:
        e.shutdown(5)
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, pr in joint.items():
            p = filtered_probs(oracle.forward_logits(prompt + list(prefix))[-1], sampling)
            for t in np.nonzero(p)[0]:
                nxt[prefix + (int(t),)] = pr * float(p[t])
        joint = nxt
    keys = sorted(joint)
    counts = Counter(outs)
    assert set(counts) <= set(keys)
    exp = n * np.array([joint[k] for k in keys])
    chi2 = float(((np.array([counts[k] for k in keys]) - exp) ** 2 / exp).sum())
    df = len(keys) - 1
    a = 2.0 / (9.0 * df)
    critical = df * (1.0 - a + 3.719 * np.sqrt(a)) ** 3  # Wilson-Hilferty, p = 1e-4
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    print(f"chi2 {chi2:.1f} (bound {critical:.1f}), accepted {stats.spec_accepted_tokens}/{stats.spec_draft_tokens}")
    assert stats.spec_draft_tokens > 2 * n  # drafts of 2 tokens: the state goes back 0, 1 or 2 positions
    assert chi2 > 2 * critical if biased else chi2 < critical, (chi2, critical)


# ----- errors ------------------------------------------------------------------------------------------


def test_a_hybrid_without_mtp_weights_says_so(tmp_path):
    m = load_model(write_qwen3_5_hf(tmp_path, seed=3))
    runner = ReferenceRunner(m, num_blocks=8, block_size=4, max_model_len=32, state_slots=2)
    with pytest.raises(MemraError, match=r"has no MTP head; use ngram or draft:PATH") as err:
        build_speculator(SpecConfig("mtp"), m, runner)
    assert "\n" not in str(err.value)


def test_mtp_on_a_backend_without_a_head_is_one_line(model):
    class OtherBackend:
        backend = "other"

        def verify(self, items):  # pragma: no cover
            return []

    with pytest.raises(ConfigError, match=r"--speculative mtp: the other backend does not run MTP heads yet"):
        build_speculator(SpecConfig("mtp"), model, OtherBackend())
    with pytest.raises(MemraError, match="no MTP head runner"):
        MtpProposer(model)


def test_memra_run_with_mtp_prints_the_plain_text_and_its_stats(capfd, mtp_dir):
    from engine.cli import main

    def run_cli(*extra):
        rc = main(["run", str(mtp_dir), "--backend", "reference", "--prompt", "Hello there", "--max-tokens", "10",
                   "--temperature", "0", "--stats", *extra])  # fmt: skip
        out, err = capfd.readouterr()
        assert rc == 0, err
        return out, err

    plain, _ = run_cli()
    out, err = run_cli("--speculative", "mtp", "--spec-tokens", "3")
    assert out == plain and plain.strip()
    stats = json.loads(err.strip().splitlines()[-1].removeprefix("memra: "))
    assert stats["speculative"] == "mtp" and stats["spec_draft_tokens"] > 0
