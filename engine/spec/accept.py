"""Verification of speculative drafts: which proposed tokens the target accepts, and the token after.

``accept(logits, item)`` takes the target's logits at the k+1 verify positions of a StepItem whose
``draft`` holds k proposed tokens (row i scores the token after ``draft[:i]``) and returns the
tokens to emit: the accepted prefix of the draft plus one more (1..k+1 ids).

* Greedy (``temperature == 0``): a draft token is accepted while it equals the argmax of the
  (penalised) target logits; the first mismatch emits the argmax instead, and a fully accepted
  draft emits the argmax of the last row (the bonus token). The output is exactly plain greedy's.
* Sampling: the standard rejection rule. With the target distribution ``p`` (penalties,
  temperature, top-k/top-p/min-p as ``engine.sampling`` does) and the proposal distribution ``q``
  (``item.draft_probs[i]``, or a point mass on the draft token for a deterministic proposer), draft
  token ``d`` is accepted with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn
  from ``max(p - q, 0)`` renormalised, and after a fully accepted draft from ``p``. The emitted
  tokens are then distributed exactly as plain sampling's. Row i's draws come from
  ``engine.sampling.rng_for(seed, num_generated + i)``, so an empty draft samples exactly like
  ``engine.sampling.sample``.

Penalties at row i see ``history + draft[:i]``: the same history plain decoding would have had.
Must not import CUDA or the engine loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.sampling import apply_penalties, draw, filtered_probs, rng_for
from engine.types import StepItem


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The distribution a rejected position draws from: ``max(p - q, 0)`` renormalised (``p`` when
    that is all zero, which happens only when ``q == p``, where nothing is ever rejected)."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0.0 else p


def _row(logits: np.ndarray, item: StepItem, history: list[int]) -> np.ndarray:
    return apply_penalties(np.asarray(logits, dtype=np.float32), item.sampling, history, item.prompt_len)


def accept_greedy_ids(draft: Sequence[int], target_ids: Sequence[int]) -> list[int]:
    """Greedy acceptance from the target's argmax ids at the k+1 verify positions (a device argmax)."""
    out: list[int] = []
    for i, tok in enumerate(target_ids):
        out.append(int(tok))
        if i == len(draft) or int(tok) != int(draft[i]):
            break
    return out


def accept(logits: np.ndarray, item: StepItem) -> list[int]:
    """The tokens to emit for ``item`` given ``logits`` [k+1, vocab] at its verify positions."""
    draft = [int(t) for t in item.draft]
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"accept: {logits.shape[0]} logit rows for a draft of {k} tokens")
    params = item.sampling
    history = list(item.history)
    if params.greedy and not params.uses_penalties:
        return accept_greedy_ids(draft, np.argmax(logits, axis=-1).tolist())
    seed = params.seed if params.seed is not None else 0
    out: list[int] = []
    for i in range(k + 1):
        x = _row(logits[i], item, history + draft[:i])
        if params.greedy:
            tok = int(np.argmax(x))
            out.append(tok)
            if i == k or tok != draft[i]:
                break
            continue
        p = filtered_probs(x, params)
        rng = rng_for(seed, item.num_generated + i)
        if i == k:  # every draft token accepted: the bonus token comes from p itself
            out.append(draw(p, rng.random()))
            break
        d = draft[i]
        if item.draft_probs is None:  # deterministic proposal: q is a point mass on d
            q = np.zeros_like(p)
            q[d] = 1.0
        else:
            q = np.asarray(item.draft_probs[i], dtype=np.float64)
        if rng.random() * q[d] <= p[d] and q[d] > 0.0:
            out.append(d)
            continue
        out.append(draw(residual(p, q), rng.random()))
        break
    return out
