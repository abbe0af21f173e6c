"""Paged-KV block manager: per-sequence block tables, refcounts, and a tenant-salted prefix cache.

The runner owns the KV memory; this module only decides which block id belongs to whom. Each block
is free, cached (a committed full block in the LRU) or used; prefix keys are chained over full
blocks from a (tenant, cache_salt) salt, and a block is registered only by ``commit``, after the
step that wrote its KV (docs/engine-loop.md: "Block manager and its invariants", "Prefix-cache
keying"). A hybrid's state slots are ``engine.state_slots.StateSlotLedger``, a mixin of
``BlockManager``; the cache's entries for a prompt's trailing partial block are
``engine.partial_blocks.PartialBlocks``, another. Pure Python: must not import numpy, CUDA or other
engine modules (``engine.prefix_keys``, ``engine.partial_blocks`` and ``engine.state_slots`` aside).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.partial_blocks import PartialBlocks
from engine.prefix_keys import ChainMemory, chain
from engine.state_slots import StateSlotLedger

_HASH_VERSION = b"memra-prefix-v1"
RELEASED = -1  # a table entry whose block was released (before a sliding window: release_before)


def cache_salt_hash(tenant: str, cache_salt: str = "") -> bytes:
    """The chain seed for a (tenant, cache_salt) pair; length-prefixed so no two pairs collide."""
    t, s = tenant.encode(), cache_salt.encode()
    payload = b"%s|%d:%s|%d:%s" % (_HASH_VERSION, len(t), t, len(s), s)
    return hashlib.blake2b(payload, digest_size=16).digest()


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def aligned_count(start: int, count: int, align: int) -> int:
    """The most of the ``count`` tokens from position ``start`` on that end at a multiple of
    ``align`` (0 when none do): where a hybrid's prefill may cut a prompt that it does not finish
    (its chunked delta rule cuts its chunks on that grid: engine.linear_attn_kernels.state_align)."""
    end = start + count
    return max(0, end - end % align - start)


@dataclass
class _SeqBlocks:
    salt: bytes
    table: list[int] = field(default_factory=list)
    # Chain hashes of the leading full blocks whose KV is written (only kept with the cache enabled).
    hashes: list[bytes] = field(default_factory=list)
    # Leading blocks that are full and written: read-only, safe to share.
    committed: int = 0
    # Keys of the full blocks of the tokens it was admitted with (computed at admission, so a commit
    # does not hash them again), and the live token list of its last commit (remembered at free).
    known_keys: list[bytes] = field(default_factory=list)
    tokens: Sequence[int] = ()
    # --- recurrent state (hybrid models) ---
    state_slot: int | None = None  # this sequence's live state slot
    restore: int | None = None  # pinned snapshot slot its first step starts from
    pending: list[tuple[int, int]] = field(default_factory=list)  # (position, slot) being snapshotted
    released: int = 0  # leading table entries released (RELEASED): a sliding-window group's table
    partial_at: int = 0  # its prompt length, while its trailing partial block waits to be registered


class BlockManager(StateSlotLedger, PartialBlocks):
    """Allocates KV blocks to sequences and keeps the prefix cache. Not thread-safe: one owner thread."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        *,
        state_slots: int = 0,
        snapshot_interval: int = 0,
        partial_blocks: bool = False,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        if snapshot_interval < 0 or snapshot_interval % block_size:
            raise ValueError(
                f"snapshot_interval must be a multiple of the block size {block_size}, got {snapshot_interval}"
            )
        self._init_state_slots(state_slots, snapshot_interval or block_size)
        # (a hybrid resumes from state snapshots at block boundaries: no partial entries)
        self._init_partials(partial_blocks and enable_prefix_cache and not state_slots)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; front = evicted first
        self._by_hash: dict[bytes, int] = {}
        self._seqs: dict[int, _SeqBlocks] = {}
        self.evictions = 0
        self.keys = ChainMemory(block_size)  # prefix keys of recent prompts and finished sequences

    # ----- counters -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks holding reusable cached KV (evictable)."""
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks a new allocation can take: free plus evictable cached."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> set[int]:
        """Ids of the sequences that currently own a block table."""
        return set(self._seqs)

    def table(self, seq_id: int) -> list[int]:
        """The sequence's block table (the live list; copy it before handing it out)."""
        return self._seqs[seq_id].table

    # ----- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], salt: bytes) -> list[int]:
        """Cached block ids covering a prefix of ``token_ids``; never the block of the last token.

        The hit is capped at ``(len(token_ids) - 1) // block_size`` blocks so at least one token is
        left to run (its logits are needed). Takes no references.
        """
        return self._match(token_ids, salt)[0]

    def _match(self, token_ids: Sequence[int], salt: bytes) -> tuple[list[int], list[bytes]]:
        """(hit block ids, the keys of every full block but the last token's)."""
        if not self.enable_prefix_cache:
            return [], []
        keys = self.keys.keys(salt, token_ids, (len(token_ids) - 1) // self.block_size)
        blocks = list(map(self._by_hash.get, keys))
        hits = blocks[: blocks.index(None)] if None in blocks else blocks
        if self.state_slots:  # a hybrid resumes from a state snapshot: end at the deepest one
            while hits and hits[-1] not in self._snap_of_block:
                hits.pop()
        return hits, keys

    # ----- allocation -----------------------------------------------------------------------------
    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        salt: bytes,
        *,
        headroom_blocks: int = 0,
        max_hit_tokens: int | None = None,
        prompt: bool = False,
    ) -> int | None:
        """Give a new sequence a table covering all of ``token_ids``, reusing cached prefix blocks
        (at most ``max_hit_tokens`` positions of them where given).

        ``prompt``: ``token_ids`` is the request's whole prompt and nothing more (not a preempted
        sequence's recompute), so its trailing partial block may hit a partial entry (a copy of the
        entry's block, queued for ``take_copies``) and is registered as one once written
        (engine.partial_blocks; with ``partial_blocks`` on). Succeeds only if, after the allocation,
        ``headroom_blocks`` more blocks would still be available. Returns the number of prefix-hit
        tokens (KV already present), or ``None`` when the blocks are not there (then nothing changed).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        hits, keys = self._match(token_ids, salt)
        if max_hit_tokens is not None:
            hits = hits[: max_hit_tokens // self.block_size]
        partial, src, extra = self._partial_hit(token_ids, salt, hits, keys, prompt and max_hit_tokens is None)
        needed_new = blocks_for(len(token_ids), self.block_size) - len(hits)
        from_lru = list(map(self._ref.__getitem__, hits)).count(0)  # (C loops: a hit costs ~blocks x 10 ns)
        pin = src is not None and not self._ref[src]  # a cached source: kept out of this allocation's reach
        if pin and self.num_available - from_lru - 1 < needed_new + headroom_blocks:
            src, extra, pin = None, 0, False
        if self.num_available - from_lru < needed_new + headroom_blocks:
            return None
        restore = self._snap_of_block[hits[-1]] if self.state_slots and hits else None
        if self.state_slots and self._state_available(exclude=restore) < 1:
            return None  # no live state slot for it (every slot live or pinned)
        seq = _SeqBlocks(salt=salt, table=hits, hashes=keys[: len(hits)], known_keys=keys)
        if self.state_slots:
            if restore is not None:
                self._pinned[restore] = self._pinned.get(restore, 0) + 1
                self._snap_lru.move_to_end(restore)
                seq.restore = restore
            seq.state_slot = self._take_state_slot()
        self._take_refs(hits)  # first, so the fresh allocations below cannot evict them
        seq.committed = len(hits)
        if pin:
            del self._lru[src]  # type: ignore[arg-type]
        for _ in range(needed_new):
            seq.table.append(self._take_fresh())
        if pin:
            self._lru[src] = None  # type: ignore[index]  # (most recently used)
        if src is not None:
            self._copies.append((seq_id, src, seq.table[seq.committed]))  # (hits is the table itself)
            self.partial_hit_tokens += extra
        seq.partial_at = len(token_ids) if partial else 0
        self._seqs[seq_id] = seq
        return seq.committed * self.block_size + extra

    # ----- sliding-window groups (engine.kv_groups) ----------------------------------------------
    def window_hit(self, token_ids: Sequence[int], salt: bytes, max_tokens: int, window: int) -> int:
        """The longest prefix of ``n <= max_tokens`` positions (a whole number of blocks) whose
        window this manager holds cached: the blocks of positions ``n - window + 1 .. n - 1`` (the
        keys the query at position n sees; earlier blocks may have been released). 0 if none."""
        bs = self.block_size
        if not self.enable_prefix_cache or max_tokens < bs:
            return 0
        nb = max_tokens // bs
        present = [k in self._by_hash for k in self.keys.keys(salt, token_ids, nb)]
        for n in range(nb, 0, -1):
            if all(present[max(0, n * bs - window + 1) // bs : n]):
                return n * bs
        return 0

    def allocate_window(
        self, seq_id: int, token_ids: Sequence[int], salt: bytes, hit_tokens: int, window: int
    ) -> bool:
        """A sliding-window group's table for a new sequence whose first ``hit_tokens`` positions
        are a prefix hit (``window_hit``): the entries before the window of position hit_tokens are
        RELEASED, the window's cached blocks are referenced; the table covers the hit only (``grow``
        adds the blocks of each chunk before it runs). False (nothing changed) when the cached
        blocks are gone."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        bs = self.block_size
        n_hit = hit_tokens // bs
        first = max(0, hit_tokens - window + 1) // bs if n_hit else 0
        keys = self.keys.keys(salt, token_ids, (len(token_ids) - 1) // bs) if self.enable_prefix_cache else []
        hits = [self._by_hash.get(k) for k in keys[first:n_hit]]
        if None in hits:
            return False
        seq = _SeqBlocks(salt=salt, table=[RELEASED] * first + hits, hashes=keys[:n_hit], known_keys=keys)
        self._take_refs(hits)  # type: ignore[arg-type]
        seq.committed, seq.released = n_hit, first
        self._seqs[seq_id] = seq
        return True

    def release_before(self, seq_id: int, num_blocks: int) -> int:
        """Release the sequence's committed blocks before table index ``num_blocks`` (a sliding
        window has passed them): their entries become RELEASED; a cached one stays in the prefix
        cache (LRU), the others are free. Returns how many blocks were released."""
        seq = self._seqs[seq_id]
        upto = min(num_blocks, seq.committed)
        dropped = [b for b in seq.table[seq.released : upto] if b != RELEASED]
        seq.table[seq.released : upto] = [RELEASED] * max(0, upto - seq.released)
        self._drop_refs(dropped)
        seq.released = max(seq.released, upto)
        return len(dropped)

    def live_blocks(self, seq_id: int) -> int:
        """The blocks the sequence holds (its table less the released entries)."""
        seq = self._seqs[seq_id]
        return len(seq.table) - sum(1 for b in seq.table[: seq.released] if b == RELEASED)

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Extend the table to cover ``num_tokens`` positions; False (unchanged) if blocks ran out."""
        seq = self._seqs[seq_id]
        need = blocks_for(num_tokens, self.block_size) - len(seq.table)
        if need <= 0:
            return True
        if need > self.num_available:
            return False
        for _ in range(need):
            seq.table.append(self._take_fresh())
        return True

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Speculative rollback: keep only the blocks covering positions ``< num_tokens``.

        The blocks past them held only rejected positions: they are private (never committed,
        since a committed block is full of accepted, written positions) and go back to the free
        list without a hash, so a rejected token never enters the prefix-cache chain. Returns the
        number of blocks freed. Raises ValueError if asked to drop a committed block.
        """
        seq = self._seqs[seq_id]
        keep = blocks_for(max(0, num_tokens), self.block_size)
        if keep < seq.committed:
            raise ValueError(
                f"sequence {seq_id}: truncating to {num_tokens} tokens would drop committed blocks"
            )
        dropped = seq.table[keep:]
        del seq.table[keep:]
        for b in reversed(dropped):
            self._ref[b] -= 1
            if b in self._partial_of:  # (never a prompt's block: a rollback keeps the prompt)
                self._unmap_partial(b)
            assert self._ref[b] == 0 and self._hash[b] is None, f"rolled-back block {b} is shared or cached"
            self._free.appendleft(b)  # reused first: it is likely warm in the runner's caches
        return len(dropped)

    def fork(self, parent_id: int, child_id: int) -> int:
        """Start ``child_id`` sharing the parent's committed (full, written, read-only) blocks.

        Returns the number of tokens whose KV the child shares; the child recomputes the rest into
        fresh blocks (there is no KV copy in the Runner protocol, so partial blocks are not shared).
        """
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already has blocks")
        if self.state_slots:
            raise ValueError("fork is not supported with recurrent state (a hybrid model)")
        parent = self._seqs[parent_id]
        child = _SeqBlocks(salt=parent.salt, hashes=list(parent.hashes), committed=parent.committed)
        for b in parent.table[: parent.committed]:
            if b != RELEASED:
                self._ref[b] += 1
            child.table.append(b)
        child.released = parent.released
        self._seqs[child_id] = child
        return parent.committed * self.block_size

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that positions ``< num_computed`` now hold written KV; cache newly full blocks.

        Call after the runner step that wrote them. A block whose key is already cached (another
        sequence computed the same prefix concurrently) stays private and is freed normally.
        """
        seq = self._seqs[seq_id]
        bs = self.block_size
        full = min(num_computed // bs, len(seq.table))
        if self.enable_prefix_cache and full > len(seq.hashes):
            seq.tokens = token_ids
            start = len(seq.hashes)
            known = seq.known_keys[start:full]  # computed at admission
            if start + len(known) < full:
                prev = known[-1] if known else (seq.hashes[-1] if seq.hashes else seq.salt)
                known += chain(prev, token_ids, bs, start + len(known), full)
            for i, key in enumerate(known, start):
                seq.hashes.append(key)
                block = seq.table[i]
                if key not in self._by_hash and self._hash[block] is None:
                    self._hash[block] = key
                    self._by_hash[key] = block
        seq.committed = max(seq.committed, full)
        if seq.partial_at and num_computed >= seq.partial_at:
            self._register_tail(seq, token_ids)
        if self.state_slots:
            self._commit_state(seq, num_computed)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (no-op for an unknown id). Cached blocks go to the LRU tail.

        Blocks are released last-first so that, among one sequence's blocks, the deepest prefix
        blocks are evicted before the shallow ones other prompts are likelier to share.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if seq.tokens and len(seq.hashes) > len(seq.known_keys):  # it grew past its prompt: a next
            self.keys.remember(seq.salt, seq.tokens, seq.hashes)  # turn may extend it
        if self.state_slots:
            self._free_state(seq)
        self._drop_copies(seq_id)
        self._drop_refs(reversed(seq.table))

    # ----- internals ------------------------------------------------------------------------------
    def _take_refs(self, blocks: Sequence[int]) -> None:
        """One more reference to each cached or used block (a cached one leaves the LRU)."""
        ref, lru = self._ref, self._lru  # (locals, no call per block: a 16k-token hit takes ~1,000)
        for b in blocks:
            r = ref[b]
            if not r:
                del lru[b]
            ref[b] = r + 1

    def _drop_refs(self, blocks: Iterable[int]) -> None:
        """One reference less to each block in order, RELEASED entries skipped; at none a block is cached
        (LRU tail) if it has a key or a partial entry, else free (locals, no call per block: see _take_refs)."""
        ref, hashes, lru, free, partial = self._ref, self._hash, self._lru, self._free, self._partial_of
        for b in blocks:
            if b == RELEASED:
                continue
            r = ref[b] - 1
            ref[b] = r
            if not r:
                if hashes[b] is not None or b in partial:
                    lru[b] = None
                else:
                    free.append(b)

    def _take_fresh(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            if self._hash[block] is not None:
                del self._by_hash[self._hash[block]]  # type: ignore[arg-type]
                self._hash[block] = None
            if block in self._partial_of:
                self._unmap_partial(block)
            self.evictions += 1
            if block in self._snap_of_block:
                self._drop_snapshot(self._snap_of_block[block])
        else:  # callers check availability first; reaching here is a bug
            raise AssertionError("BlockManager: no block available")
        self._ref[block] = 1
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError if any block-state invariant is broken (see module docstring)."""
        n = self.num_blocks
        free_set = set(self._free)
        lru_set = set(self._lru)
        assert len(free_set) == len(self._free), "a block is twice in the free list"
        assert not (free_set & lru_set), "a block is both free and cached"
        owners = [0] * n
        shared_ok = [0] * n  # tables holding the block among their committed (read-only) ones
        for sid, seq in self._seqs.items():
            live = [b for b in seq.table if b != RELEASED]
            assert len(set(live)) == len(live), f"seq {sid}: a block appears twice in its table"
            assert seq.committed <= len(seq.table), (
                f"seq {sid}: committed {seq.committed} > table {len(seq.table)}"
            )
            if self.enable_prefix_cache:
                assert len(seq.hashes) == seq.committed, f"seq {sid}: {len(seq.hashes)} hashes != committed"
            assert all(b == RELEASED for b in seq.table[: seq.released]), f"seq {sid}: released entries"
            for b in seq.table[seq.released :]:
                assert 0 <= b < n, f"seq {sid}: block id {b} out of range"
            for i, b in enumerate(seq.table):
                if b != RELEASED:
                    owners[b] += 1
                    shared_ok[b] += i < seq.committed
        used = 0
        for b in range(n):
            ref = self._ref[b]
            assert ref == owners[b], f"block {b}: refcount {ref} != {owners[b]} owning tables"
            if ref > 0:
                used += 1
                assert b not in free_set and b not in lru_set, f"block {b} is referenced but free/cached"
                assert ref == 1 or shared_ok[b] == ref, f"block {b} shared by {ref} tables but writable in some"
            else:
                in_free, in_lru = b in free_set, b in lru_set
                assert in_free != in_lru, f"block {b}: unreferenced but free={in_free} cached={in_lru}"
                keyed = self._hash[b] is not None or b in self._partial_of
                assert in_lru == keyed, f"block {b}: cached state and keys disagree"
        assert used + len(free_set) + len(lru_set) == n, "free + cached + used != total"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h, f"hash map points at block {b} holding a different key"
        assert sum(1 for h in self._hash if h is not None) == len(self._by_hash), "unmapped hashed block"
        for b in free_set:
            assert self._hash[b] is None, f"free block {b} still has a hash"
        self._check_partial_invariants()
        if self.state_slots:
            self._check_state_invariants()
