"""Recurrent-state slots of a hybrid model's sequences (engine.block_manager.BlockManager's part).

Each slot is one running sequence's live state, a prefix-cache snapshot attached to a cached block,
or free; when slots run out the least recently used unpinned snapshot is dropped, never a live state
(docs/engine-loop.md, "Recurrent state").

``StateSlotLedger`` is a mixin of ``BlockManager``: it keeps the slot accounting and reads the block
manager's ``_seqs`` (per-sequence ``state_slot`` / ``restore`` / ``pending``), ``_by_hash``,
``_hash``, ``block_size`` and ``enable_prefix_cache`` (the ``seq`` arguments are its
``_SeqBlocks``); the block manager calls ``_init_state_slots``, ``_commit_state``, ``_free_state``,
``_drop_snapshot`` and ``_check_state_invariants``. Pure Python: must not import numpy, CUDA or other engine modules.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StateSlotLedger:
    """Live / snapshot / free state slots of a hybrid model's sequences (module docstring)."""

    def _init_state_slots(self, state_slots: int, snapshot_interval: int) -> None:
        """Slots live / snapshot / free: all free at first."""
        self.state_slots = state_slots
        self.snapshot_interval = snapshot_interval
        self._state_free: deque[int] = deque(range(state_slots))
        self._snap_of_block: dict[int, int] = {}  # block -> snapshot slot (state after its last token)
        self._block_of_snap: dict[int, int] = {}
        self._snap_lru: OrderedDict[int, None] = OrderedDict()  # snapshot slots, LRU first
        self._pinned: dict[int, int] = {}  # snapshot slot -> sequences about to restore it
        self.state_evictions = 0

    @property
    def num_state_live(self) -> int:
        """State slots holding a running sequence's live state."""
        return sum(1 for seq in self._seqs.values() if seq.state_slot is not None)

    @property
    def num_state_snapshots(self) -> int:
        """State slots holding a prefix-cache snapshot."""
        return len(self._block_of_snap)

    def state_for_step(
        self, seq_id: int, start: int, count: int, prompt_len: int
    ) -> tuple[int | None, int | None, list[tuple[int, int]]]:
        """(live slot, snapshot slot to restore first or None, [(n, slot)]) for the sequence's item
        of tokens ``start .. start+count-1``: snapshots after n of them, at the boundaries
        ``_snapshot_wanted`` picks, each into a slot freed or taken from the least recently used
        snapshot. With fewer slots than such boundaries the deepest ones get them, the prompt's
        last cacheable boundary (the one a repeat of the prompt hits) always among them: shallower
        snapshots of the same step would only be evicted by the deeper ones."""
        if not self.state_slots:
            return None, None, []
        seq = self._seqs[seq_id]
        snaps: list[tuple[int, int]] = []
        if self.enable_prefix_cache:
            bs = self.block_size
            tail = ((prompt_len - 1) // bs) * bs  # the deepest boundary a repeat of this prompt can hit
            want = [
                b
                for b in range(((start // bs) + 1) * bs, start + count + 1, bs)
                if self._snapshot_wanted(b, prompt_len, tail) and seq.table[b // bs - 1] not in self._snap_of_block
            ]
            room = self._state_available()
            if len(want) > room:
                keep = set(want[len(want) - room :]) if room > 0 else set()
                if keep and tail in want and tail not in keep:
                    keep.discard(min(keep))
                    keep.add(tail)
                want = [b for b in want if b in keep]
            for b in want:
                block = seq.table[b // bs - 1]
                if block in self._snap_of_block or self._state_available() < 1:
                    continue
                slot = self._take_state_slot()
                seq.pending.append((b, slot))
                snaps.append((b - start, slot))
        return seq.state_slot, seq.restore, snaps

    def _snapshot_wanted(self, b: int, prompt_len: int, tail: int) -> bool:
        """Whether block boundary ``b`` gets a snapshot: the prompt's ``tail`` always; else a
        multiple of ``snapshot_interval``, unless it is a prompt boundary followed by at least as
        many of the prompt's own snapshot boundaries as there are slots for snapshots (one slot is
        the sequence's live state): those would evict it, least recently used, before the prompt
        ends, so a long prompt writes at most a slot count of snapshots, not one per block."""
        if b == tail:
            return True
        iv = self.snapshot_interval
        if b % iv:
            return False
        if b > prompt_len:
            return True
        later = prompt_len // iv - b // iv + (1 if tail > b and tail % iv else 0)
        return later < self.state_slots - 1

    def _state_available(self, exclude: int | None = None) -> int:
        """Free state slots plus unpinned snapshots (less ``exclude`` if it is one), in O(1): every
        pinned slot is a snapshot, so the unpinned ones are the snapshots less the pinned."""
        evictable = len(self._snap_lru) - len(self._pinned)
        if exclude is not None and exclude in self._snap_lru and exclude not in self._pinned:
            evictable -= 1
        return len(self._state_free) + evictable

    def _take_state_slot(self) -> int:
        if self._state_free:
            return self._state_free.popleft()
        for slot in self._snap_lru:  # least recently used unpinned snapshot
            if not self._pinned.get(slot):
                self._drop_snapshot(slot)
                self.state_evictions += 1
                return self._state_free.popleft()
        raise AssertionError("BlockManager: no state slot available")  # callers check first

    def _drop_snapshot(self, slot: int) -> None:
        block = self._block_of_snap.pop(slot)
        del self._snap_of_block[block]
        del self._snap_lru[slot]
        self._state_free.append(slot)

    def _commit_state(self, seq, num_computed: int) -> None:
        """After a step: attach the step's snapshots to their (now cached) blocks, unpin the restore."""
        bs = self.block_size
        for b, slot in seq.pending:
            i = b // bs - 1
            target = self._by_hash.get(seq.hashes[i]) if b <= num_computed and i < len(seq.hashes) else None
            if target is None or target in self._snap_of_block:
                self._state_free.append(slot)  # same prefix snapshotted elsewhere, or not cacheable
                continue
            self._snap_of_block[target] = slot
            self._block_of_snap[slot] = target
            self._snap_lru[slot] = None
        seq.pending = []
        self._unpin(seq)

    def _unpin(self, seq) -> None:
        if seq.restore is not None:
            left = self._pinned[seq.restore] - 1
            if left:
                self._pinned[seq.restore] = left
            else:
                del self._pinned[seq.restore]
            seq.restore = None

    def _free_state(self, seq) -> None:
        self._unpin(seq)
        for _, slot in seq.pending:
            self._state_free.append(slot)
        seq.pending = []
        if seq.state_slot is not None:
            self._state_free.append(seq.state_slot)
            seq.state_slot = None

    def _check_state_invariants(self) -> None:
        live = [seq.state_slot for seq in self._seqs.values() if seq.state_slot is not None]
        pending = [slot for seq in self._seqs.values() for _, slot in seq.pending]
        snaps = list(self._block_of_snap)
        everything = list(self._state_free) + live + pending + snaps
        assert sorted(everything) == list(range(self.state_slots)), "state slots: lost or held twice"
        assert set(self._snap_lru) == set(snaps), "snapshot LRU and snapshot map disagree"
        for slot, block in self._block_of_snap.items():
            assert self._snap_of_block.get(block) == slot, f"snapshot {slot}: block map disagrees"
            assert self._hash[block] is not None, f"snapshot {slot} is attached to uncached block {block}"
        for slot in self._pinned:
            assert slot in self._block_of_snap, f"pinned state slot {slot} is not a snapshot"
        for sid, seq in self._seqs.items():
            assert seq.state_slot is not None, f"seq {sid} has no live state slot"
