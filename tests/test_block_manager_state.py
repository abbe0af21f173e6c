"""BlockManager with recurrent-state slots (hybrid models): live slots per sequence, snapshots at
block boundaries attached to cached blocks, prefix hits ending at a snapshot, pinning, LRU eviction."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, cache_salt_hash

SALT = cache_salt_hash("t")


def run_prefill(bm, sid, tokens, chunk=None):
    """Allocate, then 'run' the prompt in chunks (state_for_step + commit); return the snapshot
    requests of each chunk."""
    hit = bm.allocate(sid, tokens, SALT)
    assert hit is not None
    asked, pos = [], hit
    while pos < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - pos)
        slot, restore, snaps = bm.state_for_step(sid, pos, n, len(tokens))
        asked.append((slot, restore, snaps))
        pos += n
        bm.commit(sid, tokens, pos)
        bm.check_invariants()
    return hit, asked


def test_live_slots_and_snapshots_every_block():
    bm = BlockManager(32, 4, state_slots=8)
    toks = list(range(18))
    hit, asked = run_prefill(bm, 0, toks, chunk=7)
    assert hit == 0
    # chunk [0, 7): boundary 4; [7, 14): 8, 12; [14, 18): 16
    assert [[n for n, _ in s] for _, _, s in asked] == [[4], [1, 5], [2]]
    assert bm.num_state_snapshots == 4 and bm.num_state_live == 1
    bm.free(0)
    bm.check_invariants()
    assert bm.num_state_live == 0 and bm.num_state_snapshots == 4
    # the same prompt: the hit is capped at (18-1)//4 = 4 blocks and that block has a snapshot
    hit, asked = run_prefill(bm, 1, toks)
    assert hit == 16 and asked[0][1] is not None  # restore from the snapshot of block 3
    # a longer prompt sharing 10 tokens hits 8 (the snapshot at 8)
    hit, _ = run_prefill(bm, 2, toks[:10] + [99, 98, 97])
    assert hit == 8


def test_sparse_interval_keeps_prompt_tail_and_hits_only_snapshots():
    bm = BlockManager(64, 4, state_slots=8, snapshot_interval=16)
    toks = list(range(30))
    _, asked = run_prefill(bm, 0, toks)
    assert [n for n, _ in asked[0][2]] == [16, 28]  # the interval and the tail (29 // 4 * 4)
    bm.free(0)
    assert run_prefill(bm, 1, toks[:20] + [7])[0] == 16  # blocks 0..3 cached, snapshot only at 16
    with pytest.raises(ValueError):
        BlockManager(8, 4, state_slots=2, snapshot_interval=6)


def test_no_free_slot_means_wait_and_live_state_is_never_evicted():
    bm = BlockManager(32, 4, state_slots=2)
    run_prefill(bm, 0, list(range(9)))  # live + snapshots take every slot they can
    assert bm.num_state_live == 1
    run_prefill(bm, 1, [50 + i for i in range(9)])
    assert bm.num_state_live == 2 and bm.num_state_snapshots == 0  # snapshots had no slot left
    assert bm.allocate(2, [1, 2, 3], SALT) is None  # both slots live: the third waits
    bm.free(0)
    assert bm.allocate(2, [1, 2, 3], SALT) == 0
    bm.check_invariants()


def test_restore_source_is_pinned_until_the_first_commit():
    bm = BlockManager(32, 4, state_slots=3)
    toks = list(range(9))
    run_prefill(bm, 0, toks)
    bm.free(0)
    assert bm.num_state_snapshots == 2
    hit = bm.allocate(1, toks, SALT)
    assert hit == 8
    slot, restore, _ = bm.state_for_step(1, 8, 1, 9)
    # another sequence needing slots may evict the other snapshot, never the pinned one
    assert bm.allocate(2, [70, 71, 72], SALT) == 0
    bm.check_invariants()
    assert restore in bm._block_of_snap
    bm.commit(1, toks, 9)
    assert bm.state_for_step(1, 9, 1, 9)[1] is None  # restored once
    bm.check_invariants()


def test_evicting_a_cached_block_drops_its_snapshot_and_tenants_are_separate():
    bm = BlockManager(4, 4, state_slots=6)
    run_prefill(bm, 0, list(range(9)))
    bm.free(0)
    assert bm.num_state_snapshots == 2
    other = cache_salt_hash("u")
    assert bm.match_prefix(list(range(9)), other) == []
    assert bm.allocate(1, list(range(100, 116)), SALT) == 0  # needs all 4 blocks: evicts both
    assert bm.num_state_snapshots == 0
    bm.check_invariants()
    with pytest.raises(ValueError):
        bm.fork(1, 2)


def test_snapshot_slot_accounting_does_not_scan_every_slot_per_boundary():
    """A cold 16k-token prefill asks for a snapshot at each of its 1,000 block boundaries: with
    1,024 slots all holding snapshots, the slots available are counted in O(1) per boundary (not a
    walk over every slot), and the count agrees with the slots themselves."""
    import cProfile
    import pstats

    bm = BlockManager(4200, 16, state_slots=1024)
    run_prefill(bm, 0, list(range(16 * 1024 + 1)), chunk=8192)  # fills every slot with a snapshot
    bm.free(0)
    assert bm.num_state_snapshots == 1023 and bm._state_available() == 1024
    toks = [t + 100_000 for t in range(16_005)]
    assert bm.allocate(1, toks, SALT) == 0
    prof = cProfile.Profile()
    prof.enable()
    _, _, snaps = bm.state_for_step(1, 0, 8192, len(toks))
    prof.disable()
    assert len(snaps) == 512
    assert pstats.Stats(prof).total_calls < 20 * 512  # type: ignore[attr-defined]
    bm.commit(1, toks, 8192)
    bm.check_invariants()
    unpinned = sum(1 for s in bm._snap_lru if not bm._pinned.get(s))
    assert bm._state_available() == len(bm._state_free) + unpinned


@pytest.mark.parametrize("slots, extra", [(6, 3), (6, 0), (2, 0)])
def test_a_step_with_more_boundaries_than_slots_snapshots_the_deepest_and_the_prompt_tail(slots, extra):
    """One prefill chunk over 20 block boundaries with ``slots - 1`` slots for snapshots: the
    deepest boundaries get them; with a single one, the prompt's last cacheable boundary (what a
    repeat hits), not the boundary after its last token."""
    bm = BlockManager(64, 4, state_slots=slots)
    toks = list(range(20 * 4 + extra))
    tail = ((len(toks) - 1) // 4) * 4
    _, ((_, _, snaps),) = run_prefill(bm, 0, toks)
    got = [n for n, _ in snaps]
    deepest = list(range(4, len(toks) + 1, 4))[-(slots - 1) :]
    assert got == (deepest if slots > 2 else [tail]), got
    bm.free(0)
    assert run_prefill(bm, 1, toks)[0] == tail  # the repeat restores the tail's snapshot


def test_a_long_prompt_writes_at_most_a_slot_count_of_snapshots():
    """A 16k-token prompt in 2,048-token chunks with 64 slots: only the boundaries whose snapshots
    can outlive the prompt's own later ones are written (63: the deepest, the tail among them),
    not one per block (1,000), and its repeat still restores the tail's snapshot."""
    bm = BlockManager(2100, 16, state_slots=64)
    toks = list(range(16_005))
    _, asked = run_prefill(bm, 0, toks, chunk=2048)
    written = [start + n for (_, _, snaps), start in zip(asked, range(0, 16_005, 2048), strict=True) for n, _ in snaps]
    assert len(written) == 63 and written == list(range(16_000 - 62 * 16, 16_001, 16))
    bm.free(0)
    assert run_prefill(bm, 1, toks)[0] == 16_000
    bm.check_invariants()
