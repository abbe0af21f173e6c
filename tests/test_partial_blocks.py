"""The prefix cache's partial entries (engine.partial_blocks) at the block-manager level: a prompt's
trailing partial block is registered once written, a prompt sent again (or one extending those
tokens inside the block, or a shorter one) takes a copy of it and skips only positions its own cold
run computes by prefill, as the entry's prompt did: never the entry's last position (its decode-row
tail, engine.runner_tail) nor its own last; salts, block-boundary prompts, recomputes, one-token
entries and hybrids get none; eviction, disconnects, rollback and fork keep the invariants
(check_invariants after every operation)."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, cache_salt_hash

BS = 4
SALT = cache_salt_hash("t")


def _bm(n: int = 16, **kw) -> BlockManager:
    return BlockManager(n, BS, partial_blocks=True, **kw)


def _run(bm: BlockManager, sid: int, toks: list[int], *, prompt: bool = True) -> int:
    """Admit ``toks`` and commit its whole prompt (the step that wrote it); the hit tokens."""
    hit = bm.allocate(sid, toks, SALT, prompt=prompt)
    assert hit is not None
    bm.check_invariants()
    bm.commit(sid, toks, len(toks))
    bm.check_invariants()
    return hit


P = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # two full blocks and a partial block of 2 tokens


def test_a_prompt_sent_again_copies_its_partial_block_and_runs_one_token():
    bm = _bm()
    assert _run(bm, 1, P) == 0 and bm.take_copies() == []
    owner = bm.table(1)[2]
    assert _run(bm, 2, P) == 9  # 8 full + 1 of the partial block's 2 (the last token runs)
    t = bm.table(2)
    assert t[:2] == bm.table(1)[:2] and t[2] != owner  # full blocks shared, the partial one a copy
    assert bm.take_copies() == [(owner, t[2])] and bm.take_copies() == []
    assert bm.partial_hit_tokens == 1
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    assert _run(bm, 3, P) == 9  # still cached after both ended (one entry: the second was the same)
    assert len(bm._partial_of) == 1


def test_extensions_inside_the_block_divergence_and_what_gets_no_hit():
    bm = _bm(32)
    _run(bm, 1, P)
    # extends it inside the block: the entry's first token (position 8, prefill in both), not its
    # last (position 9: the entry's decode-row tail, a prefill row in this prompt's cold run)
    assert _run(bm, 2, P + [11]) == 9
    bm.take_copies()
    assert _run(bm, 3, P[:9] + [77, 78]) == 9  # shares one token of the block
    bm.take_copies()
    assert _run(bm, 4, P[:8] + [99]) == 8  # shares none: the full blocks only
    assert _run(bm, 5, P + [11, 12, 13]) == 8  # ends past the block: its last block is never a hit
    assert _run(bm, 6, P + [11, 12]) == 8  # ends on a block boundary: never a partial hit
    hit = bm.allocate(7, P, cache_salt_hash("other"), prompt=True)
    assert hit == 0  # another tenant's salt
    assert bm.allocate(8, P, SALT) == 8  # not a prompt (a preempted sequence's recompute)
    assert bm.take_copies() == []
    bm.check_invariants()


def test_a_copy_stops_before_the_entry_s_last_and_the_prompt_s_last_token():
    """Against an entry of 3 tokens (positions 8, 9 prefill in its cold run, 10 its tail), a prompt
    extending it copies 8 and 9; the same prompt again 8 and 9; a shorter one sharing 2 tokens 8
    (its own 9 is its tail); the extension's entry (4 tokens) then serves the first prompt 8 and 9
    and the extension again 8, 9 and 10 (a prefill row there)."""
    bm = BlockManager(32, 8, partial_blocks=True)  # (8-token blocks: one full block, then the entry)
    long = P[:8] + [9, 10, 11]
    _run(bm, 1, long)
    assert _run(bm, 2, long + [12]) == 10
    bm.take_copies()
    assert list(bm._partial_of.values())[-1][1] == (9, 10, 11, 12)  # (it replaced the entry it extends)
    assert _run(bm, 3, long) == 10
    assert _run(bm, 4, P[:8] + [9, 10]) == 9
    assert _run(bm, 5, long + [12]) == 11
    bm.check_invariants()


def test_only_prompts_register_and_a_longer_entry_replaces_its_prefix():
    bm = _bm(32)
    bm.allocate(1, P, SALT)  # a recompute: no entry
    bm.commit(1, P, len(P))
    assert not bm._partial_of
    _run(bm, 9, P[:9])  # one token in the partial block: its decode-row tail, nothing to copy
    assert not bm._partial_of
    _run(bm, 2, P[:8] + [9, 30])  # two tokens in the partial block
    first = bm.table(2)[2]
    assert bm._partial_of[first][1] == (9, 30)
    bm.free(2)
    bm.free(9)
    assert _run(bm, 3, P[:8] + [9, 30, 11]) == 9  # its entry (9, 30, 11) covers the first one's
    assert bm.take_copies()  # (it hit the first one's token)
    assert list(bm._partial_of.values()) == [(bm._seqs[3].hashes[1], (9, 30, 11))]
    assert first in bm._free  # the replaced entry's block had no other key: free again
    bm.check_invariants()


def test_cached_partial_blocks_are_evicted_last_recently_used_and_forgotten():
    bm = _bm(6)
    _run(bm, 1, P)  # 3 blocks
    bm.free(1)
    assert bm.num_cached == 3 and bm.num_free == 3
    assert _run(bm, 2, list(range(50, 70))) == 0  # 5 blocks: evicts 2 cached ones, LRU first
    assert bm.evictions == 2 and not bm._partial_of  # the partial block went first (freed first)
    bm.check_invariants()


def test_a_hit_s_cached_source_is_not_taken_by_its_own_allocation():
    bm = _bm(4)
    _run(bm, 1, P)
    src = bm.table(1)[2]
    bm.free(1)
    # 4 blocks: P needs 3, the full hits reuse 2, the copy a fresh one: the free block, not src
    assert bm.allocate(2, P, SALT, prompt=True) == 9
    assert bm.take_copies() == [(src, bm.table(2)[2])]
    assert src in bm._lru and src in bm._partial_of
    bm.check_invariants()
    # with the free block held by another sequence, the copy's block could only be the source
    # itself: the hit is the full blocks only, and the partial block recomputed in the evicted one
    bm.free(2)
    _run(bm, 3, [60, 61])
    assert bm.num_free == 0
    assert bm.allocate(4, P, SALT, prompt=True) == 8
    assert bm.take_copies() == [] and src not in bm._partial_of and bm.table(4)[2] == src
    bm.check_invariants()


def test_a_disconnect_before_the_step_drops_the_pending_copy():
    bm = _bm()
    _run(bm, 1, P)
    assert bm.allocate(2, P, SALT, prompt=True) == 9
    bm.free(2)  # the client went away before the step ran
    assert bm.take_copies() == []
    bm.check_invariants()


def test_the_owner_writes_on_rolls_back_and_forks_without_touching_the_entry():
    bm = _bm(32)
    _run(bm, 1, P)
    block = bm.table(1)[2]
    entry = bm._partial_of[block]
    toks = P + [11, 12, 13, 14]  # decoding fills its partial block and starts the next
    assert bm.grow(1, len(toks))
    bm.commit(1, toks, 12)
    assert bm._hash[block] is not None and bm._partial_of[block] == entry  # full now: both keys
    assert bm.truncate(1, 12) == 1  # a rejected draft's block goes; the prompt's stays
    bm.check_invariants()
    assert bm.fork(1, 2) == 12  # the child shares the committed (now full) block
    bm.check_invariants()
    assert _run(bm, 3, P) == 9 and bm.take_copies() == [(block, bm.table(3)[2])]
    for sid in (1, 2, 3):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_used == 0


def test_a_truncate_that_drops_a_registered_block_forgets_it():
    bm = _bm(8)
    _run(bm, 1, P)
    block = bm.table(1)[2]
    bm._seqs[1].committed = 2  # (a rollback into the prompt never happens; the manager stays consistent)
    bm.truncate(1, 8)
    assert block not in bm._partial_of and block in bm._free
    bm.check_invariants()


@pytest.mark.parametrize("kw", [{"state_slots": 4}, {"enable_prefix_cache": False}])
def test_hybrids_and_a_disabled_cache_keep_no_partial_entries(kw):
    bm = BlockManager(16, BS, partial_blocks=True, **kw)
    _run(bm, 1, P)
    assert not bm.partial_blocks and not bm._partial_of
    hit = bm.allocate(2, P, SALT, prompt=True)
    assert hit in (0, 8) and bm.take_copies() == []
    bm.check_invariants()


def test_a_manager_without_partial_blocks_is_unchanged():
    bm = BlockManager(16, BS)
    _run(bm, 1, P)
    assert _run(bm, 2, P) == 8 and bm.take_copies() == []
