"""engine.kv_groups: the sliding-window layers' KV blocks in their own group, released behind the
window. Block level (WindowedBlocks over two BlockManagers: the window group's blocks stay bounded,
releases keep the invariants, a prefix hit stops where the window's blocks are gone) and through the
engine loop on the reference backend with a tiny Gemma 3 (window 8, blocks of 4): a long generation
holds at most ceil(window / block) + 1 window blocks, and outputs with the window pool, with prefix
hits past the window, equal the single-pool and the uncached runs."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_gemma3_safetensors

from engine.block_manager import RELEASED, BlockManager, cache_salt_hash
from engine.kv_groups import WindowedBlocks, min_window_blocks

SALT = cache_salt_hash("t")
BS, WINDOW = 4, 8
BOUND = -(-WINDOW // BS) + 1  # window blocks a decoding sequence may hold


def groups(full=64, window=64, cache=True) -> WindowedBlocks:
    return WindowedBlocks(BlockManager(full, BS, cache), BlockManager(window, BS, cache), WINDOW)


def test_decode_releases_window_blocks_behind_the_window():
    b = groups()
    toks = list(range(100, 103))
    assert b.allocate(1, toks, SALT) == 0
    assert b.grow(1, 3)  # (the window group takes a chunk's blocks before it runs)
    b.commit(1, toks, 3)
    for n in range(3, 120):  # decode: grow by one, commit it
        toks.append(n % 50)
        assert b.grow(1, n + 1)
        b.commit(1, toks, n + 1)
        b.check_invariants()
        assert b.window_blocks(1) <= BOUND
        first = max(0, n + 1 - WINDOW + 1) // BS  # the next query's first visible block
        assert all(e == RELEASED for e in b.window_table(1)[:first])
        assert RELEASED not in b.window_table(1)[first:]
    assert len(b.table(1)) == -(-120 // BS)  # the full group keeps every block
    b.free(1)
    b.check_invariants()
    assert b.window_group.num_used == 0 and b.full.num_used == 0


def test_prefix_hit_needs_the_windows_blocks():
    b = groups(full=64, window=64)
    prompt = list(range(40))
    assert b.allocate(1, prompt, SALT) == 0
    assert b.grow(1, 40)
    b.commit(1, prompt, 40)
    b.free(1)  # every full block cached; the window group's: the last blocks (the rest released)
    assert b.allocate(2, prompt, SALT) == 36  # (the block of the last token is never a hit)
    assert b.grow(2, 40)
    b.commit(2, prompt, 40)
    b.free(2)
    # evict the window group's cached blocks (a fresh sequence takes every window block)
    other = [7] * (64 * BS - 1)
    assert b.window_group.allocate(99, other, cache_salt_hash("x")) == 0
    b.window_group.free(99)
    assert b.window_group.num_cached == 0
    assert b.allocate(3, prompt, SALT) == 0  # the full group still holds the prefix: no window, no hit
    b.check_invariants()


def test_window_hit_is_the_deepest_prefix_whose_window_is_cached():
    w = BlockManager(32, BS)
    prompt = list(range(30))
    assert w.allocate(1, prompt, SALT) == 0
    w.commit(1, prompt, 30)  # blocks of positions 0..27 cached
    w.free(1)  # (deepest first into the LRU: the block of 24..27 is evicted first)
    assert w.window_hit(prompt, SALT, 28, WINDOW) == 28
    assert w.allocate(2, [9] * (w.num_free * BS), cache_salt_hash("y")) == 0  # every free block
    assert w.allocate(3, [5] * BS, cache_salt_hash("z")) == 0  # evicts one cached block: 24..27
    assert w.evictions == 1
    # n = 28 needs positions 21..27 (blocks 5, 6): gone; n = 24 needs 17..23 (blocks 4, 5): there
    assert w.window_hit(prompt, SALT, 28, WINDOW) == 24
    assert w.window_hit(prompt, SALT, 28, 100) == 24  # a wide window needs every block


def test_the_window_pool_must_hold_one_sequences_window_and_step():
    assert min_window_blocks(WINDOW, 16, BS) == -(-(WINDOW - 1 + 16) // BS) + 2
    with pytest.raises(ValueError, match="must hold one sequence's window and step: at least 8 blocks"):
        WindowedBlocks(BlockManager(64, BS), BlockManager(7, BS), WINDOW, 16)
    WindowedBlocks(BlockManager(6, BS), BlockManager(6, BS), WINDOW, 16)  # as large as the full pool


def test_window_blocks_are_taken_per_chunk_and_a_full_window_pool_fails_the_grow():
    b = WindowedBlocks(BlockManager(64, BS), BlockManager(8, BS), WINDOW, 16)
    prompt = list(range(60))
    assert b.allocate(1, prompt, SALT) == 0
    assert b.window_table(1) == [] and len(b.table(1)) == 15  # the prompt's full blocks, no window ones
    for start in range(0, 48, 16):  # chunks of 16: the window group holds the window and the chunk
        assert b.grow(1, start + 16)
        b.commit(1, prompt, start + 16)
        assert b.window_blocks(1) <= min_window_blocks(WINDOW, 16, BS)
    assert b.allocate(2, list(range(100, 140)), SALT) == 0
    assert not b.grow(2, 32)  # 8 window blocks for 32 tokens: the pool holds 8, seq 1 has 2
    assert b.window_table(2) == [] and len(b.table(2)) == 10  # neither table changed
    b.check_invariants()


# ---- through the engine loop, reference backend ------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.model import load_model

    return load_model(write_gemma3_safetensors(tmp_path_factory.mktemp("g"), window=WINDOW, num_hidden_layers=7))


def run(model, waves, *, window_pool=True, cache=True, max_tokens=40, watch=None, pool=None, **cfg):
    """Greedy outputs [(tokens, cached tokens)] of each wave's prompts through the engine (``pool``:
    the window pool's blocks, default the full pool's)."""
    from fixtures.engine_waves import engine_for, run_waves

    from engine.reference import ReferenceRunner

    runner = ReferenceRunner(model, num_blocks=96, block_size=BS, max_model_len=128, window_kv_blocks=pool if window_pool else 0)
    e = engine_for(runner, watch=watch, enable_prefix_cache=cache, **cfg)
    assert isinstance(e.blocks, WindowedBlocks) == window_pool
    return run_waves(e, waves, max_tokens=max_tokens)[0]


def test_engine_long_generation_holds_a_bounded_window_group(tiny):
    prompt = [int(i) for i in np.random.default_rng(1).integers(3, 128, 10)]
    held: list[int] = []

    def watch(e):
        for seq in e.scheduler.running:
            if seq.num_computed >= seq.prompt_len:  # decoding (a prompt's blocks come with it)
                held.append(e.blocks.window_blocks(seq.seq_id))

    got = run(tiny, [[prompt]], max_tokens=100, watch=watch)
    assert held and max(held) <= BOUND, max(held)
    assert got == run(tiny, [[prompt]], window_pool=False, max_tokens=100)


def test_engine_prefix_hits_past_the_window_equal_uncached(tiny):
    """Prompts sharing a prefix longer than the window, chunked prefill and a second wave served from
    the prefix cache: the same tokens as without a prefix cache and without a window pool."""
    rng = np.random.default_rng(2)
    shared = [int(i) for i in rng.integers(3, 128, 30)]
    prompts = [shared + [7, 8, 9], shared + [40], shared[:13], [int(i) for i in rng.integers(3, 128, 21)]]
    cfg = dict(max_running=4, prefill_chunk_tokens=8, max_step_tokens=16)
    plain = run(tiny, [prompts], cache=False, window_pool=False, max_tokens=24, **cfg)
    both = run(tiny, [prompts, prompts], max_tokens=24, **cfg)
    assert [t for t, _ in both] == [t for t, _ in plain] * 2
    assert sum(c for _, c in both[4:]) > 0  # the second wave hit the cache past the window


def test_engine_with_a_small_window_pool_equals_one_pool(tiny, monkeypatch):
    """A window pool of the minimum size (one sequence's window and step): four long prompts (more
    window blocks than the pool at once), chunked, wait or are preempted for window blocks and
    still give the single-pool tokens."""
    rng = np.random.default_rng(3)
    prompts = [[int(i) for i in rng.integers(3, 128, n)] for n in (50, 37, 61, 45)]
    cfg = dict(max_running=4, prefill_chunk_tokens=8, max_step_tokens=16)
    from engine.loop import SPEC_HEADROOM

    small = min_window_blocks(WINDOW, 8 + SPEC_HEADROOM, BS)  # the engine's minimum: 10 blocks
    failed = []
    grow = WindowedBlocks.grow

    def counting(self, seq_id, n):
        ok = grow(self, seq_id, n)
        failed.append(not ok)
        return ok

    monkeypatch.setattr(WindowedBlocks, "grow", counting)
    got = run(tiny, [prompts], max_tokens=20, pool=small, **cfg)
    assert any(failed)  # the window pool ran short: chunks waited, decode rows preempted
    assert [t for t, _ in got] == [t for t, _ in run(tiny, [prompts], window_pool=False, max_tokens=20, **cfg)]


# ---- the automatic window pool size (a runner's default) -----------------------------------------


def test_auto_window_blocks_rule():
    """max_running x (one window and a decode row with drafts) + one prefill chunk's blocks; never
    below the engine's minimum for that chunk (one sequence's window, the chunk and drafts)."""
    from engine.kv_groups import SPEC_HEADROOM, auto_window_blocks

    # Gemma 3 270M on an H100 profile: window 512, blocks of 16, 128 sequences, 2048-token chunks
    assert auto_window_blocks(512, 16, 128, 2048) == 128 * (-(-(512 + SPEC_HEADROOM) // 16) + 2) + 2048 // 16 == 4608
    assert auto_window_blocks(8, 4, 1, 1) == min_window_blocks(8, 1 + SPEC_HEADROOM, 4) + 1
    for window in (1, 5, 8, 512, 4096):
        for bs in (4, 16):
            for chunk in (1, 8, 512, 2048):
                for running in (1, 3, 64):
                    got = auto_window_blocks(window, bs, running, chunk)
                    assert got >= min_window_blocks(window, chunk + SPEC_HEADROOM, bs)
                    assert got >= running * min_window_blocks(window, 1, bs)
    with pytest.raises(ValueError, match="positive sizes"):
        auto_window_blocks(512, 16, 0, 2048)


def _window_grow_failures(pool: int, running: int, chunk: int) -> tuple[list[bool], object]:
    """Window-group grow results of an engine (FakeRunner, block size 4, window 8) running 12
    requests of 5..45-token prompts, ``running`` at a time with ``chunk``-token prefill chunks, over
    a window pool of ``pool`` blocks (the full pool is ample)."""
    from fixtures.engine_waves import engine_for, run_waves
    from fixtures.fake_runner import FakeRunner

    runner = FakeRunner(num_blocks=1024, block_size=BS, max_model_len=256)
    runner.window_kv_blocks, runner.kv_window = pool, WINDOW
    e = engine_for(runner, max_running=running, prefill_chunk_tokens=chunk, max_step_tokens=running + chunk)
    assert isinstance(e.blocks, WindowedBlocks)
    results: list[bool] = []
    grow = e.blocks.window_group.grow

    def counting(seq_id, n):
        results.append(grow(seq_id, n))
        return results[-1]

    e.blocks.window_group.grow = counting
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 100, n)] for n in rng.integers(5, 46, 12)]
    _, stats = run_waves(e, [prompts], max_tokens=30)
    return results, stats


def test_at_the_auto_size_the_window_pool_never_runs_short():
    """An engine whose window pool is auto_window_blocks for its max_running and chunk never fails a
    window-group grow (no chunk waits, no preemption for window blocks); a smaller pool (still above
    the engine's minimum) does, so the window pool is the scarce one there, and every request still
    finishes (no deadlock)."""
    from engine.kv_groups import auto_window_blocks

    pool = auto_window_blocks(WINDOW, BS, 4, 8)
    results, stats = _window_grow_failures(pool, 4, 8)
    assert results and all(results) and stats.preemptions == 0
    results, stats = _window_grow_failures(12, 4, 8)
    assert not all(results)
