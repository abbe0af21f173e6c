"""The token_mask kernel (kernels/token_mask.cu.j2) against engine.sampling on a real GPU: random
logits, random constraint masks (sparse, dense, one token, a mask narrower than the vocabulary) and
random logit-bias lists (repeated tokens, ids past the vocabulary), packed by engine.logit_prep as
the runner packs them. Masked rows must equal apply_token_mask(apply_logit_bias(row)) bit for bit,
unmasked rows must be untouched, a poisoned row past the grid must stay NaN, and the sample kernel
run after it must pick only allowed tokens (greedy rows: the masked argmax). Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import poisoned, upload

from engine import kernel_catalog as kc
from engine.logit_prep import PrepBlock
from engine.sampling import apply_logit_bias, apply_token_mask, unpack_mask
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
        sp = SamplingParams(temperature=temp, logit_bias=bias, seed=r)
        items.append(StepItem(r, [1], 3, [0], True, sp, allowed=allowed))
    return items


@pytest.mark.parametrize("V", [151936, 1003])
def test_token_mask_equals_the_host_samplers_bias_and_mask(kernels, profile, V):
    S = 48
    rng = np.random.default_rng()
    t = profile.tuning["sampling"]["threads"]
    items = _random_items(rng, S, V)
    block = PrepBlock(S, V, 0)
    raw = np.zeros(block.nbytes, np.uint8)
    block.bind(raw)
    assert block.pack(items) is not None
    logits = (rng.standard_normal((S, V)) * 4).astype(np.float32)
    dev = poisoned((S + 1, V), "f32")  # row S stays NaN: past the grid
    from engine import cuda

    cuda.htod(dev.ptr, logits)
    c = kc.choice("token_mask", vocab=V, ld=V, threads=t)
    kernels.launch(
        c, S, logits=dev, slot=upload(block.slot, "i32"), bias_start=upload(block.start, "i32"),
        bias=upload(block.entries.reshape(-1), "i32"), words=upload(block.words.view(np.int32).reshape(-1), "i32"),
        rows=S,
    )
    got = dev.get().astype(np.float32)
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
    for r, it in enumerate(items):
        if it.allowed is not None:
            assert unpack_mask(it.allowed, V)[ids[r]], f"row {r} sampled masked token {ids[r]}"
        if temp[r] == 0.0:
            assert ids[r] == int(np.argmax(got[r])), r
        else:
            assert np.isfinite(got[r, ids[r]]), r
