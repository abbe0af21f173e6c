"""BlockManager: allocation, prefix hits, salt isolation, LRU eviction, refcounts, invariants."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, cache_salt_hash

BS = 4
SALT = cache_salt_hash("default")


def prompt(n: int, base: int = 10) -> list[int]:
    return list(range(base, base + n))


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, BS)
    assert bm.allocate(1, prompt(10), SALT) == 0
    assert len(bm.table(1)) == 3 and bm.num_free == 5 and bm.num_used == 3
    assert bm.grow(1, 13) and len(bm.table(1)) == 4
    bm.check_invariants()
    bm.free(1)
    bm.free(1)  # idempotent
    assert bm.num_free == 8 and bm.num_used == 0
    bm.check_invariants()


def test_allocate_refuses_without_space_and_changes_nothing():
    bm = BlockManager(4, BS)
    assert bm.allocate(1, prompt(12), SALT) == 0  # 3 blocks
    assert bm.allocate(2, prompt(8, 50), SALT) is None  # needs 2, 1 left
    assert bm.allocate(2, prompt(4, 50), SALT, headroom_blocks=1) is None  # 1 + headroom 1 > 1
    assert not bm.has_seq(2) and bm.num_free == 1
    assert not bm.grow(1, 20)  # needs 2 more
    assert len(bm.table(1)) == 3
    bm.check_invariants()


def test_prefix_hit_only_after_commit_and_capped_before_last_token():
    bm = BlockManager(16, BS)
    p = prompt(12)
    bm.allocate(1, p, SALT)
    assert bm.allocate(2, p, SALT) == 0  # nothing written yet: no hit
    bm.free(2)
    bm.commit(1, p, 12)
    # 3 full blocks cached, but the hit stops at (12-1)//4 = 2 blocks so one token is left to run
    assert bm.allocate(3, p, SALT) == 8
    assert bm.table(3)[:2] == bm.table(1)[:2]
    assert bm.table(3)[2] != bm.table(1)[2]
    assert bm.allocate(4, p + [99], SALT) == 12  # a longer prompt can use all three
    bm.check_invariants()


def test_divergent_prompts_share_only_the_common_blocks():
    bm = BlockManager(16, BS)
    a = prompt(12)
    bm.allocate(1, a, SALT)
    bm.commit(1, a, 12)
    b = a[:4] + [7, 7, 7, 7] + a[8:] + [1]
    assert bm.allocate(2, b, SALT) == 4  # chained hashes: block 2 matches by content but not by chain
    bm.check_invariants()


def test_salt_isolates_tenants_and_cache_salts():
    bm = BlockManager(32, BS)
    p = prompt(13)
    bm.allocate(1, p, cache_salt_hash("alice"))
    bm.commit(1, p, 13)
    assert bm.allocate(2, p, cache_salt_hash("bob")) == 0
    assert bm.allocate(3, p, cache_salt_hash("alice", "s1")) == 0
    assert bm.allocate(4, p, cache_salt_hash("alice")) == 12
    assert cache_salt_hash("a", "b|1:c") != cache_salt_hash("a|1:b", "c")
    assert not set(bm.table(2)) & set(bm.table(1))
    bm.check_invariants()


def test_refcounts_with_shared_prefix():
    bm = BlockManager(16, BS)
    p = prompt(9)
    bm.allocate(1, p, SALT)
    bm.commit(1, p, 9)
    assert bm.allocate(2, p, SALT) == 8
    shared = bm.table(1)[:2]
    assert [bm._ref[b] for b in shared] == [2, 2]
    bm.free(1)
    assert [bm._ref[b] for b in shared] == [1, 1]
    assert bm.num_cached == 0  # still owned by seq 2
    bm.check_invariants()
    bm.free(2)
    assert bm.num_cached == 2 and bm.num_used == 0
    bm.check_invariants()


def test_lru_evicts_least_recently_freed_first_and_deepest_block_first():
    bm = BlockManager(6, BS)
    a, b = prompt(9, 100), prompt(9, 200)
    for sid, p in ((1, a), (2, b)):
        bm.allocate(sid, p, SALT)
        bm.commit(sid, p, 9)
    bm.free(1)  # a's 2 cached blocks enter the LRU first
    bm.free(2)
    assert bm.num_free == 2 and bm.num_cached == 4
    bm.allocate(3, prompt(12, 300), SALT)  # 3 blocks: 2 free + 1 eviction: a's deeper block
    assert bm.evictions == 1
    assert len(bm.match_prefix(a + [0], SALT)) == 1  # a keeps its first block
    assert len(bm.match_prefix(b + [0], SALT)) == 2
    bm.check_invariants()
    bm.grow(3, 16)  # next eviction: a's first block
    assert bm.match_prefix(a + [0], SALT) == [] and len(bm.match_prefix(b + [0], SALT)) == 2
    bm.check_invariants()


def test_hit_blocks_are_never_evicted_by_the_same_allocation():
    bm = BlockManager(3, BS)
    p = prompt(9)
    bm.allocate(1, p, SALT)
    bm.commit(1, p, 9)
    bm.free(1)  # 2 cached + 1 free
    assert bm.allocate(2, p, SALT) == 8  # reuses both cached blocks, takes the free one
    assert bm.evictions == 0
    bm.check_invariants()


def test_concurrent_identical_prompts_keep_one_cached_copy():
    bm = BlockManager(16, BS)
    p = prompt(8)
    bm.allocate(1, p, SALT)
    bm.allocate(2, p, SALT)
    bm.commit(1, p, 8)
    bm.commit(2, p, 8)  # same keys already cached: seq 2's blocks stay private
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.num_cached == 2 and bm.num_free == 14
    bm.check_invariants()


def test_fork_shares_committed_blocks_read_only():
    bm = BlockManager(16, BS)
    p = prompt(10)
    bm.allocate(1, p, SALT)
    bm.commit(1, p, 10)
    assert bm.fork(1, 2) == 8  # the partial third block is not shared
    assert bm.table(2) == bm.table(1)[:2]
    assert bm.grow(2, 11) and bm.table(2)[2] != bm.table(1)[2]
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    bm.check_invariants()


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(16, BS, enable_prefix_cache=False)
    p = prompt(9)
    bm.allocate(1, p, SALT)
    bm.commit(1, p, 9)
    bm.free(1)
    assert bm.allocate(2, p, SALT) == 0 and bm.num_cached == 0
    bm.check_invariants()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda bm: bm._ref.__setitem__(bm.table(1)[0], 2),  # refcount drift
        lambda bm: bm._free.append(bm.table(1)[0]),  # owned block also free
        lambda bm: bm.table(2).append(bm.table(1)[-1]),  # writable block in two tables
        lambda bm: bm._free.pop(),  # a block lost
    ],
)
def test_check_invariants_catches_corruption(corrupt):
    bm = BlockManager(8, BS)
    bm.allocate(1, prompt(6), SALT)
    bm.allocate(2, prompt(3, 40), SALT)
    bm.check_invariants()
    corrupt(bm)
    with pytest.raises(AssertionError):
        bm.check_invariants()
