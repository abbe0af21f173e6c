"""check_request: the checks the engine makes on a request at submit, before it is queued (what
can be checked without the engine thread): a non-empty prompt of token ids inside the vocabulary,
and a max_tokens that fits the context length and the whole KV cache; it returns the resolved
max_tokens (None: all the room the context and the cache leave). Each failure is a MemraError
naming the parameter (``context_length_exceeded`` where the request does not fit).

The vocabulary check costs in proportion to the ids not seen before (issue #34: a prefix-cache hit
costs O(new tokens)): ``CheckedPrompts`` keeps recent prompts that passed it, and a prompt that
starts with one (the same prompt sent again, a conversation's next turn) checks only the ids after
it. Comparing a remembered prefix (C-level list equality) costs about a tenth of what min/max over
the same ids does. Prompts are remembered per tenant and cache salt, as the prefix cache keys its
blocks, so one tenant's check time never tells whether another sent a prompt.

Must not import CUDA, numpy or any runner.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.block_manager import blocks_for
from engine.types import GenerationRequest, MemraError


class CheckedPrompts:
    """Recent prompts whose ids all lie inside the vocabulary ``[0, vocab)`` (one vocabulary per
    instance: the engine's), least recently used dropped past ``max_tokens`` remembered ids or
    ``max_entries`` prompts, each under its ``scope`` (the tenant and cache salt: a prompt only
    reuses its own scope's). ``checked_ids`` counts the ids range-checked (the tests' counter).
    Thread-safe (requests are submitted from the server's threads)."""

    def __init__(self, vocab: int, max_tokens: int = 1 << 18, max_entries: int = 64):
        self.vocab = vocab
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[Any, list[int]]] = OrderedDict()
        self._tokens = 0
        self._ids = 0
        self.checked_ids = 0

    def in_vocab(self, ids: Sequence[int], scope: Any = None) -> bool:
        """Whether every id of ``ids`` lies in ``[0, vocab)``; checks only the ids after the longest
        prompt remembered under ``scope`` that ``ids`` starts with, and remembers ``ids`` when they
        pass."""
        if not isinstance(ids, list):
            ids = list(ids)  # (list == tuple is never true)
        n = len(ids)
        with self._lock:
            done, best_id = 0, None
            for eid, (sc, prev) in reversed(self._entries.items()):
                m = len(prev)
                # (first and last ids before the slice: a mismatch rarely pays for the comparison)
                if (
                    sc == scope
                    and done < m <= n
                    and prev[0] == ids[0]
                    and prev[-1] == ids[m - 1]
                    and (ids == prev if m == n else ids[:m] == prev)
                ):
                    done, best_id = m, eid
                    if m == n:
                        break
            if best_id is not None:
                self._entries.move_to_end(best_id)
            rest = ids[done:] if done else ids
            self.checked_ids += len(rest)
            if rest and (min(rest) < 0 or max(rest) >= self.vocab):
                return False
            if done < n:
                self._remember(scope, list(ids), best_id)
            return True

    def _remember(self, scope: Any, ids: list[int], extends: int | None) -> None:
        if len(ids) > self.max_tokens // 2:
            return
        if extends is not None:  # the prompt it extends is redundant now
            self._tokens -= len(self._entries.pop(extends)[1])
        self._ids += 1
        self._entries[self._ids] = (scope, ids)
        self._tokens += len(ids)
        while self._tokens > self.max_tokens or len(self._entries) > self.max_entries:
            self._tokens -= len(self._entries.popitem(last=False)[1][1])


def check_request(
    req: GenerationRequest,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    vocab: int | None,
    checked: CheckedPrompts | None = None,
) -> int:
    """``req``'s max_tokens, checked against a context of ``max_model_len`` tokens and a KV cache of
    ``num_blocks`` blocks of ``block_size`` (``vocab``: the tokenizer's size, None: unchecked;
    ``checked``: that vocabulary's memory of prompts already checked, None: check every id)."""
    n = len(req.prompt_ids)
    limit = max_model_len
    kv_tokens = num_blocks * block_size
    if n == 0:
        raise MemraError("the prompt is empty", param="prompt")
    if isinstance(vocab, int):
        ids = req.prompt_ids
        if checked is not None and checked.vocab == vocab:
            ok = checked.in_vocab(ids, (req.tenant, req.cache_salt))
        else:
            ok = min(ids) >= 0 and max(ids) < vocab
        if not ok:
            raise MemraError(f"the prompt holds token ids outside the vocabulary [0, {vocab})", param="prompt")
    if req.max_tokens is None:
        max_tokens = min(limit, kv_tokens) - n
        if max_tokens < 1:
            raise MemraError(
                f"the prompt has {n} tokens, leaving no room to generate: the context length is {limit} "
                f"tokens and the KV cache holds {kv_tokens}",
                code="context_length_exceeded",
                param="messages",
            )
        return max_tokens
    max_tokens = req.max_tokens
    if max_tokens < 1:
        raise MemraError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if n + max_tokens > limit:
        raise MemraError(
            f"this model's maximum context length is {limit} tokens, but the request needs "
            f"{n + max_tokens} ({n} in the prompt + {max_tokens} max_tokens)",
            code="context_length_exceeded",
            param="max_tokens",
        )
    need = blocks_for(n + max_tokens, block_size)
    if need > num_blocks:
        raise MemraError(
            f"the request needs {n + max_tokens} tokens ({n} in the prompt + {max_tokens} max_tokens) = "
            f"{need} KV blocks, but the whole KV cache holds {num_blocks} blocks ({kv_tokens} tokens)",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return max_tokens
