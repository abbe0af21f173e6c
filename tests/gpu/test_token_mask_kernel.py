"""The token_mask and logprobs kernels (kernels/token_mask.cu.j2, kernels/logprobs.cu.j2) against
engine.sampling on a real GPU: random logits, random constraint masks (sparse, dense, one token, a
mask narrower than the vocabulary), random logit-bias lists (repeated tokens, ids past the
vocabulary) and rows asking for logprobs, packed by engine.logit_prep as the runner packs them.
Masked rows must equal apply_token_mask(apply_logit_bias(row)) bit for bit, unmasked rows must be
untouched, a poisoned row past the grid must stay NaN, the raw copy of a logprobs row must be its
raw logits, the sample kernel run after it must pick only allowed tokens (greedy rows: the masked
argmax), and the logprobs kernel must give engine.sampling.token_logprobs of the raw logits (its
unused slots left poisoned). Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.engine_probes import unpack_mask
from gpu_harness import poisoned, upload

from engine import kernel_catalog as kc
from engine.ir import LP_SLOTS
from engine.logit_prep import PrepBlock
from engine.sampling import apply_logit_bias, apply_token_mask, token_logprobs
from engine.types import SamplingParams, StepItem


def _pack(allowed: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.zeros(((vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _random_items(rng, S: int, V: int) -> list[StepItem]:
    items = []
    for r in range(S):
        kind = r % 6
        allowed = None
        if kind in (1, 4):  # sparse
            allowed = _pack(rng.choice(V, int(rng.integers(1, 50)), replace=False), V)
        elif kind == 2:  # dense
            allowed = _pack(np.flatnonzero(rng.random(V) < 0.7), V)
        elif kind == 3:  # a single token
            allowed = _pack([int(rng.integers(0, V))], V)
        elif kind == 5 and r % 4 == 1:  # a mask over a narrower tokenizer (the words past it are 0)
            allowed = _pack(rng.choice(V // 2, 20, replace=False), V // 2 + 7)
        bias: tuple = ()
        if r % 3 == 0 or kind == 4:
            toks = list(rng.integers(0, V, int(rng.integers(1, 12)))) + [V + 5]
            toks += toks[:2]  # repeated tokens: added twice, in order
            bias = tuple((int(t), float(np.float32(rng.uniform(-100, 100)))) for t in toks)
        temp = 0.0 if r % 2 == 0 else 1.0
        lp = int(rng.integers(0, 21)) if r % 5 == 2 and r < 5 * LP_SLOTS else None  # k 0..20
        sp = SamplingParams(temperature=temp, logit_bias=bias, seed=r, logprobs=lp)
        items.append(StepItem(r, [1], 3, [0], True, sp, allowed=allowed))
    return items


@pytest.mark.parametrize("V", [151936, 1003])
def test_token_mask_equals_the_host_samplers_bias_and_mask(kernels, profile, V):
    S = 48
    rng = np.random.default_rng()
    t = kc.SAMPLING_THREADS
    items = _random_items(rng, S, V)
    block = PrepBlock(S, V, 0)
    raw = np.zeros(block.nbytes, np.uint8)
    block.bind(raw)
    assert block.pack(items, logprobs=True) is not None and block.lp_rows
    logits = (rng.standard_normal((S, V)) * 4).astype(np.float32)
    dev = poisoned((S + 1, V), "f32")  # row S stays NaN: past the grid
    from engine import cuda

    cuda.htod(dev.ptr, logits)
    c = kc.choice("token_mask", vocab=V, ld=V, threads=t)
    raw = poisoned((LP_SLOTS, V), "f32")
    lp_slot = upload(block.lp_slot, "i32")
    kernels.launch(
        c, S, logits=dev, slot=upload(block.slot, "i32"), bias_start=upload(block.start, "i32"),
        bias=upload(block.entries.reshape(-1), "i32"), words=upload(block.words.view(np.int32).reshape(-1), "i32"),
        lp_slot=lp_slot, raw=raw, rows=S,
    )
    got = dev.get().astype(np.float32)
    raw_got = raw.get().astype(np.float32)
    for r, s in block.lp_rows:
        assert np.array_equal(raw_got[s], logits[r]), f"row {r}: raw copy"
    assert np.isnan(raw_got[len(block.lp_rows) :]).all(), "token_mask wrote an unused raw slot"
    assert np.isnan(got[S]).all(), "token_mask wrote past its rows"
    for r, it in enumerate(items):
        want = apply_logit_bias(logits[r], it.sampling.logit_bias) if it.sampling.logit_bias else logits[r]
        if it.allowed is not None:
            want = apply_token_mask(want, it.allowed)
        assert np.array_equal(got[r], want), f"row {r}: {np.flatnonzero(got[r] != want)[:8]}"
    # the sampler on the masked logits picks allowed tokens only; greedy rows the masked argmax
    out = poisoned((S,), "i32")
    temp = np.array([it.sampling.temperature for it in items], np.float32)
    seeds = np.array([it.sampling.seed for it in items], np.int64)
    cs = kc.choice("sample", vocab=V, ld=V, threads=t)
    masked_dev = upload(got[:S], "f32")
    kernels.launch(
        cs, S, out=out, logits=masked_dev, temperature=upload(temp, "f32"), top_k=upload(np.zeros(S, np.int32), "i32"),
        top_p=upload(np.ones(S, np.float32), "f32"), min_p=upload(np.zeros(S, np.float32), "f32"),
        seed=upload(seeds, "i64"), step=upload(np.arange(S, dtype=np.int32), "i32"), rows=S,
    )
    ids = out.get()
    top_ids, vals = poisoned((LP_SLOTS, kc.LP_TOP), "i32"), poisoned((LP_SLOTS, kc.LP_TOP + 1), "f32")
    cl = kc.choice("logprobs", vocab=V, threads=t, top=kc.LP_TOP)
    kernels.launch(
        cl, S, raw=raw, lp_slot=lp_slot, lp_k=upload(block.lp_k, "i32"), ids=out, top_ids=top_ids, vals=vals, rows=S
    )
    got_ids, got_vals = top_ids.get(), vals.get()
    for r, s in block.lp_rows:
        k = int(block.lp_k[s])
        want_lp, want_top = token_logprobs(logits[r], int(ids[r]), k)
        assert got_vals[s, 0] == pytest.approx(want_lp, abs=2e-4), r
        assert got_ids[s, :k].tolist() == [tok for tok, _ in want_top], r
        np.testing.assert_allclose(got_vals[s, 1 : 1 + k], [v for _, v in want_top], atol=2e-4)
        assert (got_ids[s, k:] == -1).all() and np.isnan(got_vals[s, 1 + k :]).all(), f"row {r}: wrote past k"
    assert (got_ids[len(block.lp_rows) :] == -1).all() and np.isnan(got_vals[len(block.lp_rows) :]).all()
    for r, it in enumerate(items):
        if it.allowed is not None:
            assert unpack_mask(it.allowed, V)[ids[r]], f"row {r} sampled masked token {ids[r]}"
        if temp[r] == 0.0:
            assert ids[r] == int(np.argmax(got[r])), r
        else:
            assert np.isfinite(got[r, ids[r]]), r
