"""The device token_mask step's host side (issue #39), without a GPU: engine.sampling.mask_words (the
one meaning of a constraint's bitmask), engine.logit_prep's packing (per-row flags, compacted mask
words, bias entries in request order) decoded back to the host sampler's math, the plan's masked
sampling kinds, and CudaRunner on the fake driver choosing masked kinds and uploading the entries.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.engine_probes import unpack_mask
from test_plan_runner_fake import GREEDY, fake  # noqa: F401  (the fake-driver runner fixture)

from engine.ir import LOGPROBS, MASKED
from engine.logit_prep import PrepBlock, on_device
from engine.sampling import apply_logit_bias, apply_token_mask, mask_words
from engine.types import MemraError, SamplingParams, StepItem


def pack_bits(allowed, vocab: int) -> np.ndarray:
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_mask_words_over_a_narrower_or_wider_vocabulary():
    m = pack_bits({0, 31, 32, 70, 99}, 100)  # 4 words
    w = mask_words(m, 64)  # narrower logits: the words past them and ids >= 64 go
    assert w.dtype == np.uint32 and w.tolist() == [1 | 1 << 31, 1]
    w = mask_words(m, 71)  # a partial last word keeps only ids < 71
    assert w.tolist() == [1 | 1 << 31, 1, 1 << 6]
    w = mask_words(m, 200)  # wider logits: tokens the mask does not reach are forbidden
    assert w.size == 7 and w[4:].tolist() == [0, 0, 0] and np.flatnonzero(unpack_mask(m, 200)).tolist() == [0, 31, 32, 70, 99]
    with pytest.raises(MemraError, match="allows no token"):
        mask_words(pack_bits({99}, 100), 64)
    with pytest.raises(MemraError, match="allows no token"):
        apply_token_mask(np.zeros(64, np.float32), pack_bits({99}, 100))


def decode_packed(block: PrepBlock, logits: np.ndarray, rows: int) -> np.ndarray:
    """The token_mask kernel's math (kernels/token_mask.cu.j2) in numpy over the packed views."""
    out = np.array(logits, dtype=np.float32, copy=True)
    for r in range(rows):
        for tok, bits in block.entries[block.start[r] : block.start[r + 1]]:
            if 0 <= tok < block.vocab:
                out[r, tok] += np.int32(bits).view(np.float32)
        if block.slot[r] >= 0:
            keep = np.unpackbits(block.words[block.slot[r]].view(np.uint8), bitorder="little")[: block.vocab]
            out[r] = np.where(keep.astype(bool), out[r], np.float32(-np.inf))
    return out


def _item(r, sampling=GREEDY, allowed=None, sample=True):
    return StepItem(r, [1], 5, [0], sample, sampling, allowed=allowed)


def test_packing_round_trips_to_the_host_samplers_math():
    vocab, rows = 77, 8
    rng = np.random.default_rng(3)
    block = PrepBlock(rows, vocab, 64, capacity=16)
    raw = np.zeros(64 + block.nbytes, np.uint8)
    block.bind(raw)
    assert all(o % 16 == 0 for o in block.offsets.values()) and block.offsets["mask_slot"] == 64
    bias_a = ((5, 1.5), (500, 9.0), (5, -0.25), (76, 100.0))  # a repeat, an id past the vocabulary
    items = [
        _item(0),
        _item(1, allowed=pack_bits({2, 40, 76}, vocab)),
        _item(2, SamplingParams(temperature=0.7, logit_bias=bias_a)),
        _item(3, SamplingParams(temperature=0.0, logit_bias=((40, -3.0),)), allowed=pack_bits({40, 41}, 96)),
        _item(4, SamplingParams(logit_bias=((1, 2.0),)), allowed=pack_bits({1}, vocab), sample=False),
    ]
    size = block.pack(items)
    assert block.slot.tolist() == [-1, 0, -1, 1, -1, -1, -1, -1]  # flags, compacted slots
    assert block.start.tolist() == [0, 0, 0, 3, 4, 4, 4, 4, 4]  # 500 dropped; row 4 samples nothing
    assert size == block.offsets["mask_words"] - 64 + 2 * block.width * 4
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    got = decode_packed(block, logits, rows)
    for r, it in enumerate(items):
        want = logits[r]
        if it.sample:
            want = apply_logit_bias(want, it.sampling.logit_bias)
            if it.allowed is not None:
                want = apply_token_mask(want, it.allowed)
        assert np.array_equal(got[r], want), r
    assert np.array_equal(got[5:], logits[5:])
    # a later step with fewer rows leaves no flag or entry of the last one behind
    assert block.pack([_item(0)]) == block.offsets["mask_words"] - 64
    assert (block.slot == -1).all() and (block.start == 0).all()


def test_packing_over_capacity_or_with_an_empty_mask():
    block = PrepBlock(4, 50, 0, capacity=3)
    block.bind(np.zeros(block.nbytes, np.uint8))
    two = SamplingParams(logit_bias=((1, 1.0), (2, 1.0)))
    assert block.pack([_item(0, two)]) is not None
    assert block.pack([_item(0, two), _item(1, two)]) is None  # 4 entries > 3: the host samples
    with pytest.raises(MemraError, match="allows no token"):
        block.pack([_item(0, allowed=pack_bits({60}, 64))])
    with pytest.raises(ValueError):
        block.pack([_item(i) for i in range(5)])


def test_which_rows_the_device_step_serves():
    assert on_device(_item(0, allowed=pack_bits({1}, 8)))
    assert on_device(_item(0, SamplingParams(logit_bias=((1, 1.0),))))
    assert on_device(_item(0, SamplingParams(logprobs=2)))
    assert not on_device(_item(0, SamplingParams(temperature=0.3, repetition_penalty=1.2)))
    assert not on_device(_item(0, SamplingParams(logit_bias=((1, 1.0),)), sample=False))


def test_every_sampling_kind_has_a_masked_twin_that_masks_first(fake):  # noqa: F811
    runner, _ = fake
    s = runner.plan.sampling
    for kind in ("greedy", "sample", "penalised"):
        assert [la.spec.template for la in s[MASKED + kind]] == ["token_mask"] + [la.spec.template for la in s[kind]]
    (mask,) = s[MASKED + "greedy"][:1]
    assert [a.ref for a in mask.args[1:5]] == ["mask_slot", "bias_start", "bias_entries", "mask_words"]


def test_masked_decode_runs_the_kernel_inside_the_graph_with_its_entries(fake):  # noqa: F811
    runner, drv = fake
    vocab = runner.plan.values["logits"].width
    con = StepItem(0, [5], 7, [0], True, GREEDY, allowed=pack_bits({3, 9}, vocab))
    free = StepItem(1, [6], 7, [1], True, GREEDY)
    drv.h2d.clear()
    runner.step([con, free])
    names = [n for n, _, _ in drv.launches]
    tm = [i for i, n in enumerate(names) if n.startswith("token_mask")]
    assert tm and names[tm[-1] + 1].startswith("argmax")  # greedy rows: the mask, then the argmax
    assert drv.captures == 1 and drv.graph_launches == 1  # still a captured, replayed decode graph
    # the graph leaves the copies to the host: rows + tables, then the token_mask block with one
    # masked row of words (nothing captured into the graph)
    want = runner._prep.offsets["mask_words"] - runner._prep.offset + 4 * runner._prep.width
    assert len(drv.h2d) == 2 and drv.h2d[1] == want and drv.h2d_graph == []
    assert runner._prep.slot[:2].tolist() == [0, -1] and runner._prep.words[0, 0] == (1 << 3 | 1 << 9)
    drv.h2d.clear()
    runner.step([con, free])
    assert drv.captures == 1 and drv.graph_launches == 2 and drv.h2d == [drv.h2d[0], want]  # replayed
    drv.launches.clear()
    runner.step([free, StepItem(0, [5], 8, [0], True, GREEDY)])  # unmasked: no token_mask launch
    assert not any(n.startswith("token_mask") for n, _, _ in drv.launches)


def test_logprobs_kinds_and_the_host_fallbacks(fake, monkeypatch):  # noqa: F811
    import engine.runner_steps as rs

    runner, _ = fake
    vocab = runner.plan.values["logits"].width
    con = StepItem(0, [5], 7, [0], True, GREEDY, allowed=pack_bits({3}, vocab))
    lp = StepItem(1, [6], 7, [1], True, SamplingParams(temperature=0.0, logprobs=2))
    assert runner._sampling_kind([con]) == MASKED + "greedy" and runner._host_rows == []
    # logprobs rows on the device: a slot each (raw copy + the logprobs kernel after the sampler)
    assert runner._sampling_kind([con, lp]) == MASKED + "greedy" + LOGPROBS and runner._host_rows == []
    assert runner._prep.lp_slot[:2].tolist() == [-1, 0] and runner._prep.lp_k[0] == 2
    assert runner._prep.lp_rows == [(1, 0)]
    hot = SamplingParams(temperature=0.9, seed=1, presence_penalty=0.5, logit_bias=((4, 2.0),))
    pen = StepItem(2, [6], 7, [1], True, hot, history=[4, 4], prompt_len=1, num_generated=1)
    lp_all = StepItem(3, [6], 7, [1], True, SamplingParams(logprobs=1, presence_penalty=0.5, logit_bias=((5, 1.0),)),
                      history=[5, 5], prompt_len=1, num_generated=1, allowed=pack_bits({5}, vocab))
    assert runner._sampling_kind([con, pen, lp_all]) == MASKED + "penalised" + LOGPROBS
    assert runner._pen[0] == 2 and runner._prep.start[:4].tolist() == [0, 0, 1, 2]
    h2d = []
    import engine.runner_cuda as rc

    monkeypatch.setattr(rc, "_call_htod", lambda ptr, host, stream: h2d.append(host.nbytes))
    runner._upload_inputs(4, MASKED + "penalised" + LOGPROBS)  # rows, penalty entries, token_mask block
    assert h2d[1:] == [(4 + 3 * 2) * 4, runner._prep_bytes]
    # more logprobs rows than slots: those rows get no device entries (raw logits) and go to the host
    monkeypatch.setattr(rs, "LP_SLOTS", 0)
    assert runner._sampling_kind([con, lp]) == MASKED + "greedy" and runner._host_rows == [1]
    assert runner._sampling_kind([lp]) == "greedy" and runner._host_rows == [0]
    assert runner._sampling_kind([con, pen, lp_all]) == MASKED + "penalised" and runner._host_rows == [2]
    assert runner._prep.slot[:3].tolist() == [0, -1, -1] and runner._prep.start[:4].tolist() == [0, 0, 1, 1]
    assert runner._pen[0] == 1 and runner._pen[4:7].tolist() == [1, 4, 2 * 1]  # row 1's entry only
    assert (runner._prep.lp_slot == -1).all()
    monkeypatch.setattr(runner._prep, "capacity", 0)
    assert runner._sampling_kind([con, pen]) == "host"


def test_logprobs_outputs_become_the_items_logprobs(fake):  # noqa: F811
    runner, drv = fake
    items = [StepItem(0, [5], 7, [0], True, GREEDY), StepItem(1, [6], 7, [1], True, SamplingParams(temperature=0.0, logprobs=3))]
    p = runner._prep
    p.lp_ids[0, :3] = [9, 4, 7]
    p.lp_vals[0, :4] = [-1.5, -0.25, -0.5, -0.75]
    drv.launches.clear()
    runner.step(items)  # the fake device copies nothing back: the values set above stay
    names = [n for n, _, _ in drv.launches]
    assert names[-3].startswith("token_mask") and names[-2].startswith("argmax") and names[-1].startswith("logprobs")
    assert items[1].logprobs_out == (-1.5, [(9, -0.25), (4, -0.5), (7, -0.75)]) and items[0].logprobs_out is None
    lo, hi = p.out_range()
    assert lo == p.offsets["lp_ids"] and hi == p.offsets["lp_vals"] + 4 * 21


def test_the_constrained_driver_on_the_reference(tiny_llama_dir):
    """The GPU test's driver (tests/fixtures/constrained.py) on the numpy oracle: the json_schema row
    finishes with schema-valid JSON, every token allowed by its mask, and the unconstrained row
    beside it equals its solo run."""
    pytest.importorskip("llguidance")
    import json

    from fixtures.constrained import PERSON, RecordingReference, Row, generate

    from engine import grammar
    from engine.model import load_model
    from engine.reference import ReferenceRunner
    from engine.tokenizer import load_tokenizer

    model = load_model(tiny_llama_dir)
    tok = load_tokenizer(model.weights)
    ref = RecordingReference(ReferenceRunner(model, num_blocks=64, max_model_len=256))
    eos = set(tok.eos_token_ids)
    p_con, p_free = tok.encode("user Give me a person as JSON. assistant"), tok.encode("Hello, world!")
    con = grammar.build_constraint(tok, grammar.json_grammar(PERSON))
    rows = generate(ref, [Row(p_con, con), Row(p_free)], 96, eos)
    obj = json.loads(tok.decode(rows[0].out))
    assert rows[0].done and set(obj) == {"name", "ok", "n"} and obj["n"] in (1, 22, 333)
    for t, m in zip(rows[0].out, rows[0].masks, strict=True):
        assert unpack_mask(m, ref.ref.vocab)[t]
    solo = generate(ref, [Row(p_free)], len(rows[1].out), eos, first_block=32)
    assert solo[0].out == rows[1].out


def test_token_mask_and_logprobs_compile_for_every_profile_arch(tmp_path):
    """The templates through NVRTC on every profile's arch, with a vocabulary of whole words and one
    with a tail word (the plan's specs compile with the others in tests/test_kernels_compile.py)."""
    from test_kernels_compile import _nvrtc_ok, _profile_archs

    from engine import kernel_catalog as kc
    from engine.compile import KernelBuilder
    from engine.kcache import KernelCache
    from engine.render import render

    threads = {kc.SAMPLING_THREADS}
    specs = {kc.spec("token_mask", vocab=v, ld=v, threads=t) for t in threads for v in (151936, 1003)}
    specs |= {kc.spec("logprobs", vocab=v, threads=t, top=kc.LP_TOP) for t in threads for v in (151936, 1003)}
    for s in specs:
        src = render(s)
        assert f"{s.entry}(" in src
    c = kc.choice("token_mask", vocab=1003, ld=1003, threads=256)
    assert c.grid(5) == (5, 1, 1)
    assert [a for a, _ in c.args] == ["logits", "slot", "bias_start", "bias", "words", "lp_slot", "raw", "rows"]
    c = kc.choice("logprobs", vocab=1003, threads=256, top=20)
    assert c.grid(3) == (3, 1, 1) and [a for a, _ in c.args] == ["raw", "lp_slot", "lp_k", "ids", "top_ids", "vals", "rows"]
    if not _nvrtc_ok():
        pytest.skip("NVRTC or CUDA headers not available")
    for arch in _profile_archs():
        stats = KernelBuilder(arch, cache=KernelCache(tmp_path), no_compile=False).build_all(list(specs), progress=None)
        assert all(k.cubin for k in stats.kernels)


def test_a_masked_prefill_head_runs_the_kernel_on_its_row(fake):  # noqa: F811
    runner, drv = fake
    vocab = runner.plan.values["logits"].width
    drv.h2d.clear()
    runner.step([StepItem(0, list(range(1, 21)), 0, [0, 1], True, GREEDY, allowed=pack_bits({4}, vocab))])
    names = [(n, g) for n, g, _ in drv.launches]
    assert names[-2][0].startswith("token_mask") and names[-2][1] == (1, 1, 1) and names[-1][0].startswith("argmax")
    assert drv.h2d[-1] == runner._prep.offsets["mask_words"] - runner._prep.offset + 4 * runner._prep.width


def test_the_logprobs_capacity_is_the_apis():
    from engine.kernel_catalog import LP_TOP
    from engine.sampling import MAX_LOGPROBS

    assert LP_TOP == MAX_LOGPROBS


def test_logprobs_slots_are_packed_in_row_order_and_capped():
    from engine.ir import LP_SLOTS

    block = PrepBlock(LP_SLOTS + 2, 50, 0)
    block.bind(np.zeros(block.nbytes, np.uint8))
    lp = [_item(r, SamplingParams(logprobs=r % 21)) for r in range(LP_SLOTS + 1)]
    with pytest.raises(ValueError, match="logprobs"):
        block.pack(lp, logprobs=True)
    size = block.pack([_item(0), lp[5], lp[7], _item(3, SamplingParams(logprobs=2), sample=False)], logprobs=True)
    assert block.lp_slot[:5].tolist() == [-1, 0, 1, -1, -1] and block.lp_k[:2].tolist() == [5, 7]
    assert block.lp_rows == [(1, 0), (2, 1)] and size == block.offsets["mask_words"]  # no masked row
    assert block.offsets["lp_ids"] >= block.offsets["mask_words"] + 4 * block.rows * block.width  # outputs after the upload
    block.pack([lp[5]])  # without device logprobs: no slot
    assert (block.lp_slot == -1).all() and block.lp_rows == []
