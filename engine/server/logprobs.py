"""Render per-token log probabilities (TokenEvent.logprobs) in the OpenAI chat and completions shapes.

Must not import falcon or the engine loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _tok(tokenizer: Any, i: int) -> str:
    try:
        return tokenizer.decode([i], skip_special_tokens=False)
    except TypeError:  # a tokenizer whose decode takes only ids
        return tokenizer.decode([i])


def chat_content(tokenizer: Any, ids: Sequence[int], entries: Sequence[tuple]) -> list[dict]:
    """``choices[].logprobs.content``: one entry per generated token (token, logprob, bytes, top)."""
    out = []
    for tid, (lp, top) in zip(ids, entries, strict=False):
        t = _tok(tokenizer, tid)
        out.append(
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {"token": (s := _tok(tokenizer, j)), "logprob": v, "bytes": list(s.encode())} for j, v in top
                ],
            }
        )
    return out


def completion_logprobs(tokenizer: Any, ids: Sequence[int], entries: Sequence[tuple], offset: int = 0) -> dict:
    """``choices[].logprobs`` of /v1/completions: tokens, token_logprobs, top_logprobs, text_offset
    (``offset``: characters of text already sent before these tokens)."""
    tokens, lps, tops, offsets = [], [], [], []
    at = offset
    for tid, (lp, top) in zip(ids, entries, strict=False):
        t = _tok(tokenizer, tid)
        tokens.append(t)
        lps.append(lp)
        tops.append({_tok(tokenizer, j): v for j, v in top})
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
