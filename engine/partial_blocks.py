"""PartialBlocks, the block manager's mixin for the prefix cache's partial entries: a prompt's
trailing partial block (docs/engine-loop.md, "Partial blocks").

The full-block cache stops at the last block boundary of a prompt, so a prompt sent again would
recompute its trailing partial block (up to block_size - 1 tokens). A partial entry remembers the
block that holds those positions' KV, keyed by the chain key of the full blocks before it (so
tenant-salted like them) and the exact tokens of the partial block. Its owner only ever writes
slots past them, so the entry's slots never change while the block lives.

What a copy may take follows engine.runner_tail's rule for a dense plan (partial entries exist
only there: not for a hybrid's state slots or a sliding-window pool): a cold prompt runs every
position in the prefill pass but its last, a decode row, so an entry of L tokens holds
prefill-computed KV at its first L - 1 positions and a decode row's at its last. A new prompt
whose full blocks all hit and whose partial block starts with some of an entry's tokens takes a
*copy* of the entry's block (a fresh block; the runner copies the KV on the device before the
step: ``take_copies``), since it writes its own slots in it, and skips the positions it shares
with the entry, at most the entry's first L - 1 and at most all of its own but its last (at least
one, else no copy): every one of them its own cold run would compute by prefill too, from the
same tokens after the same prefix, so the copied KV holds the cold run's bits (a prefill row's
KV does not depend on the pass or chunk it ran in). The entry's last position is never copied:
a prompt that extends the entry's tokens computes it by prefill, and the same prompt again, whose
last position it is, recomputes it as its one-row tail anyway. So an entry of one token gives
nothing to copy and is not registered. A registered sequence was admitted with only its prompt
and its block is its prompt's last (not a preempted sequence's recompute); a hitting prompt does
not end on a block boundary.

An unreferenced block with a partial entry is cached (LRU, evictable) like a full cached block;
reusing it drops the entry. Pure Python: must not import numpy, CUDA or other engine modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_prefix(a: Sequence[int], b: Sequence[int], cap: int) -> int:
    """How many leading tokens (at most ``cap``) ``a`` and ``b`` share."""
    n = min(cap, len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PartialBlocks:
    """Partial entries and the pending block copies of a BlockManager (see the module docstring).

    Expects the host class's ``_ref``, ``_hash``, ``_lru``, ``_free``, ``_seqs`` and ``block_size``."""

    def _init_partials(self, enabled: bool) -> None:
        self.partial_blocks = enabled
        self._partial_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (chain key, tokens)
        self._partials: dict[bytes, dict[int, tuple[int, ...]]] = {}  # chain key -> {block: tokens}
        self._copies: list[tuple[int, int, int]] = []  # (seq_id, src, dst), in allocation order
        self.partial_hit_tokens = 0

    # ----- lookup and registration ----------------------------------------------------------------
    def _partial_hit(
        self, token_ids: Sequence[int], salt: bytes, hits: list[int], keys: list[bytes], prompt: bool
    ) -> tuple[bool, int | None, int]:
        """(whether the sequence's trailing partial block is registered once written, the entry's
        block it copies or None, the tokens that gives) for an allocation whose full-block ``hits``
        and ``keys`` are ``_match``'s; ``prompt``: ``token_ids`` is a whole prompt (allocate's)."""
        bs = self.block_size  # type: ignore[attr-defined]
        if not (prompt and self.partial_blocks and len(token_ids) % bs):
            return False, None, 0
        if len(hits) < len(token_ids) // bs:
            return True, None, 0
        return (True, *self._partial_match(keys[-1] if hits else salt, token_ids[len(hits) * bs :]))

    def _register_tail(self, seq: Any, token_ids: Sequence[int]) -> None:
        """The commit that wrote ``seq``'s whole prompt (``partial_at`` tokens): its trailing
        partial block becomes an entry."""
        bs = self.block_size  # type: ignore[attr-defined]
        end, seq.partial_at = seq.partial_at, 0
        start = end - end % bs
        if len(seq.hashes) >= start // bs and len(seq.table) > start // bs:
            prev = seq.hashes[start // bs - 1] if start else seq.salt
            self._register_partial(seq.table[start // bs], prev, tuple(token_ids[start:end]))

    def _partial_match(self, prev: bytes, rest: Sequence[int]) -> tuple[int | None, int]:
        """(block, tokens): the entry after chain key ``prev`` sharing the most leading tokens with
        ``rest`` (the prompt's partial block), at most ``len(rest) - 1`` of them and at most the
        entry's tokens less its last (a decode row's KV: the module docstring); (None, 0) if none."""
        entries = self._partials.get(prev)
        if not entries:
            return None, 0
        best, src = 0, None
        for block, toks in entries.items():
            n = common_prefix(toks, rest, min(len(rest), len(toks)) - 1)
            if n > best:
                best, src = n, block
        return src, best

    def _register_partial(self, block: int, prev: bytes, tokens: tuple[int, ...]) -> None:
        """Remember ``block`` as holding the KV of ``tokens`` after chain key ``prev``, unless it
        gives nothing to copy (one token) or an entry already covers them; entries whose tokens are
        a prefix of these are dropped (a prefix's copyable positions are these' too)."""
        if len(tokens) < 2:
            return
        for b, toks in list(self._partials.get(prev, {}).items()):
            if toks[: len(tokens)] == tokens:
                return  # (the same prompt again: the entry it copied from still lives)
            if tokens[: len(toks)] == toks:
                self._forget_partial(b)
        self._partials.setdefault(prev, {})[block] = tokens
        self._partial_of[block] = (prev, tokens)

    def _unmap_partial(self, block: int) -> None:
        """Drop ``block``'s entry from the maps (its placement is the caller's)."""
        prev, _ = self._partial_of.pop(block)
        entries = self._partials[prev]
        del entries[block]
        if not entries:
            del self._partials[prev]

    def _forget_partial(self, block: int) -> None:
        """Drop ``block``'s entry; an unreferenced block left with no key goes from the LRU to the free list."""
        self._unmap_partial(block)
        if not self._ref[block] and self._hash[block] is None:  # type: ignore[attr-defined]
            del self._lru[block]  # type: ignore[attr-defined]
            self._free.append(block)  # type: ignore[attr-defined]

    # ----- the copies a step needs ---------------------------------------------------------------------
    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies of the partial hits since the last call, in
        order; the runner must make them (``copy_blocks``) before the next step runs. Clears them."""
        out = [(src, dst) for _, src, dst in self._copies]
        self._copies.clear()
        return out

    def _drop_copies(self, seq_id: int) -> None:
        if self._copies:
            self._copies = [c for c in self._copies if c[0] != seq_id]

    def _check_partial_invariants(self) -> None:
        n = 0
        for prev, entries in self._partials.items():
            assert entries, "an empty partial-entry map"
            for b, toks in entries.items():
                assert self._partial_of.get(b) == (prev, toks), f"block {b}: partial maps disagree"
                assert 1 < len(toks) < self.block_size, f"block {b}: partial entry of {len(toks)} tokens"  # type: ignore[attr-defined]
                n += 1
        assert n == len(self._partial_of), "a partial entry is in one map only"
        free = set(self._free)  # type: ignore[attr-defined]
        assert not free & set(self._partial_of), "a free block has a partial entry"
        for sid, src, dst in self._copies:
            seq = self._seqs.get(sid)  # type: ignore[attr-defined]
            assert seq is not None and dst in seq.table, f"copy into block {dst} for a sequence without it"
            assert src != dst, f"copy of block {src} onto itself"
