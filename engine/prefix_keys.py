"""Prefix-cache block keys computed in proportion to the new tokens: recent token prefixes are kept
with their key chains, so a prompt sent again, or one that extends an earlier request (a
conversation's next turn), hashes only the blocks past the part it shares with them.

The keys themselves are ``chain_hash``'s (``h_i = BLAKE2b-128(h_{i-1} || tokens of block i as
int64)``); the memory only saves recomputing them, so a key is always a pure function of the salt
and the tokens. Pure Python: must not import numpy, CUDA or other engine modules.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """``H(prev, tokens)``: the prefix-cache key of one full block given its predecessor's key."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain(prev: bytes, tokens: Sequence[int], block_size: int, start: int, stop: int) -> list[bytes]:
    """The keys of blocks ``start .. stop-1`` given ``prev``, the key of block ``start - 1`` (or the
    salt): the tokens are packed once, then one BLAKE2b call per block."""
    data = array("q", tokens[start * block_size : stop * block_size]).tobytes()
    step = 8 * block_size
    out: list[bytes] = []
    blake2b = hashlib.blake2b
    for off in range(0, len(data), step):
        prev = blake2b(prev + data[off : off + step], digest_size=16).digest()
        out.append(prev)
    return out


class ChainMemory:
    """Recent (salt, token prefix, its block keys), least recently used dropped past ``max_tokens``
    remembered tokens or ``max_entries`` entries. Not thread-safe (the block manager's owner thread)."""

    def __init__(self, block_size: int, max_tokens: int = 1 << 18, max_entries: int = 256):
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[bytes, list[int], list[bytes]]] = OrderedDict()
        self._tokens = 0
        self._ids = 0
        self.hashed_blocks = 0  # blocks whose key was computed (not recalled): the test's counter

    def keys(self, salt: bytes, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        """The keys of the first ``n_blocks`` full blocks of ``tokens``, recalled for the longest
        prefix shared with a remembered one, computed for the rest; remembered for next time."""
        if n_blocks <= 0:
            return []
        if not isinstance(tokens, list):
            tokens = list(tokens)
        bs = self.block_size
        best, best_id = 0, None
        for eid, (s, toks, keys) in reversed(self._entries.items()):
            if s != salt or len(keys) <= best or toks[:bs] != tokens[:bs]:
                continue
            n = _shared_blocks(toks, tokens, bs, min(len(keys), n_blocks))
            if n > best:
                best, best_id = n, eid
            if best == n_blocks:
                break
        if best_id is not None:
            self._entries.move_to_end(best_id)
            if best == n_blocks == len(self._entries[best_id][2]):
                return self._entries[best_id][2][:]  # the same prefix again: nothing to remember
        keys = self._entries[best_id][2][:best] if best_id is not None else []
        if best < n_blocks:
            keys += chain(keys[-1] if keys else salt, tokens, bs, best, n_blocks)
            self.hashed_blocks += n_blocks - best
        self.remember(salt, tokens, keys)
        return keys

    def remember(self, salt: bytes, tokens: Sequence[int], keys: list[bytes]) -> None:
        """Keep ``keys`` (the first ``len(keys)`` blocks of ``tokens``) for later prompts."""
        n = len(keys) * self.block_size
        if not keys or n > self.max_tokens // 2:
            return
        for eid, (s, _, old) in list(self._entries.items()):  # an entry this one extends is redundant
            if s == salt and len(old) <= len(keys) and old[-1] == keys[len(old) - 1]:
                self._drop(eid)
        self._ids += 1
        self._entries[self._ids] = (salt, list(tokens[:n]) if not isinstance(tokens, list) else tokens[:n], keys[:])
        self._tokens += n
        while self._tokens > self.max_tokens or len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, eid: int) -> None:
        _, toks, _ = self._entries.pop(eid)
        self._tokens -= len(toks)


def _shared_blocks(a: Sequence[int], b: Sequence[int], block_size: int, cap: int) -> int:
    """How many leading whole blocks (at most ``cap``) ``a`` and ``b`` have in common: one list
    comparison when they share all of them, else a binary search over prefix comparisons."""
    n = min(cap, len(a) // block_size, len(b) // block_size)
    if (a if len(a) == n * block_size else a[: n * block_size]) == b[: n * block_size]:
        return n
    lo, hi = 0, n  # blocks < lo agree; the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * block_size] == b[: mid * block_size]:
            lo = mid
        else:
            hi = mid
    return lo
