"""KV block groups for sliding-window models: the full-attention layers' blocks and the window
layers' blocks, each in its own pool with its own BlockManager, behind the one interface the engine
loop, the scheduler and the speculator use (``WindowedBlocks``, a drop-in for a BlockManager).

The window layers (``attention`` ops with a ``window``) read, for a query at position ``p``, only the
keys ``p - window + 1 .. p`` (engine.ops_ref.window_start). So after every commit of ``n`` written
positions the window group releases its blocks wholly before ``window_start(n)`` (their entries
become ``block_manager.RELEASED``; a cached one stays in the group's prefix cache, evictable): a
decoding sequence holds at most ``ceil(window / block_size) + 1`` window blocks, whatever its length.
The full group is the BlockManager it always was; its table is ``StepItem.block_table``, the window
group's ``StepItem.window_table`` (a runner with a window pool: ``runner.window_kv_blocks``).

Prefix cache: both groups key their blocks by the same chained hashes (each manager has its own
map). A hit of ``n`` tokens is valid when the full group has every block of the prefix and the
window group the blocks of positions ``n - window + 1 .. n - 1`` (earlier ones may be gone):
admission takes the longest such ``n`` (``BlockManager.window_hit``). Every other call goes to both
groups (allocate, grow, truncate, commit, free) or reads the full group (counters, tables).

A sequence's window blocks are taken per chunk, not with its prompt: admission references only the
hit's cached window blocks, and the scheduler's ``grow`` before each chunk (a no-op for the full
group, whose table covers the prompt) takes the chunk's; so the window pool may be much smaller
than the full pool: each running sequence holds at most ``ceil((window - 1 + chunk) / block_size) +
2`` window blocks. A ``grow`` the window group cannot serve fails as a full-group one does (a decode
row preempts, a prefill chunk waits). The window pool must hold one sequence's window and step
(``min_window_blocks``) or be as large as the full pool; ``auto_window_blocks`` is the size at which
it never runs short (a runner's default). Pure Python: imports engine.block_manager only; must not
import numpy or CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.block_manager import BlockManager, blocks_for

SPEC_HEADROOM = 16  # tokens a decode row's drafts may add to a step (the window pool's minimum)


class WindowedBlocks:
    """A full-attention BlockManager and a sliding-window one, driven together (see the module
    docstring). ``num_blocks`` and the counters are the full group's (the context checks are about
    it); ``max_step_tokens`` (the most tokens one step gives a sequence) sizes the window pool's
    minimum."""

    def __init__(self, full: BlockManager, window_group: BlockManager, window: int, max_step_tokens: int = 1):
        if window < 1:
            raise ValueError(f"WindowedBlocks needs a window >= 1, got {window}")
        if window_group.block_size != full.block_size:
            raise ValueError("the window group's block size must be the full group's")
        # (a pool as large as the full one always serves: no sequence holds more window blocks
        # than full ones)
        need = min(min_window_blocks(window, max_step_tokens, full.block_size), full.num_blocks)
        if window_group.num_blocks < need:
            raise ValueError(
                f"the window pool ({window_group.num_blocks} blocks) must hold one sequence's window "
                f"and step: at least {need} blocks (window {window}, {max_step_tokens} tokens a step)"
            )
        if full.state_slots:
            raise ValueError("sliding-window KV groups are not supported with recurrent state")
        self.full, self.window_group, self.window = full, window_group, window

    def __getattr__(self, name: str) -> Any:  # counters, keys, block_size ...: the full group's
        return getattr(self.full, name)

    # ----- the window group's own view --------------------------------------------------------
    def window_table(self, seq_id: int) -> list[int]:
        """The sequence's window-group table (RELEASED entries before its window)."""
        return self.window_group.table(seq_id)

    def window_blocks(self, seq_id: int) -> int:
        """The window-group blocks the sequence holds."""
        return self.window_group.live_blocks(seq_id)

    # ----- driven together --------------------------------------------------------------------
    def allocate(
        self, seq_id: int, token_ids: Sequence[int], salt: bytes, *, headroom_blocks: int = 0, prompt: bool = False
    ) -> int | None:
        """BlockManager.allocate over both groups (no partial entries: ``prompt`` is not used)."""
        full_hit = len(self.full.match_prefix(token_ids, salt)) * self.full.block_size
        hit = self.window_group.window_hit(token_ids, salt, full_hit, self.window)
        got = self.full.allocate(seq_id, token_ids, salt, headroom_blocks=headroom_blocks, max_hit_tokens=hit)
        if got is None:
            return None
        if not self.window_group.allocate_window(seq_id, token_ids, salt, got, self.window):
            self.full.free(seq_id)
            return None
        return got

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Both tables cover ``num_tokens`` positions, or False with neither changed."""
        had = len(self.full.table(seq_id))
        if not self.full.grow(seq_id, num_tokens):
            return False
        if not self.window_group.grow(seq_id, num_tokens):
            self.full.truncate(seq_id, had * self.full.block_size)  # (its new blocks are private)
            return False
        return True

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        self.window_group.truncate(seq_id, num_tokens)
        return self.full.truncate(seq_id, num_tokens)

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Commit both groups, then release the window blocks that no later query can see."""
        self.full.commit(seq_id, token_ids, num_computed)
        self.window_group.commit(seq_id, token_ids, num_computed)
        first_visible = max(0, num_computed - self.window + 1)  # window_start of the next position
        self.window_group.release_before(seq_id, first_visible // self.window_group.block_size)

    def free(self, seq_id: int) -> None:
        self.full.free(seq_id)
        self.window_group.free(seq_id)

    def fork(self, parent_id: int, child_id: int) -> int:
        self.window_group.fork(parent_id, child_id)
        return self.full.fork(parent_id, child_id)

    def check_invariants(self) -> None:
        self.full.check_invariants()
        self.window_group.check_invariants()
        assert self.full.seq_ids() == self.window_group.seq_ids(), "the groups hold different sequences"
        for sid in self.full.seq_ids():
            assert len(self.window_group.table(sid)) <= len(self.full.table(sid)), f"seq {sid}: window table longer"


def min_window_blocks(window: int, max_step_tokens: int, block_size: int) -> int:
    """The window blocks one sequence may hold at once: its window before a step's first position
    (window - 1 keys), the step's tokens, and one block of misalignment at each end."""
    return -(-(window - 1 + max_step_tokens) // block_size) + 2


def auto_window_blocks(window: int, block_size: int, max_running: int, prefill_chunk_tokens: int) -> int:
    """The window pool that never runs short under an engine of ``max_running`` sequences and
    ``prefill_chunk_tokens`` prefill tokens a step: each sequence holds its window and one decode
    row's step with drafts (``min_window_blocks(window, 1 + SPEC_HEADROOM)``), and the step's prefill
    chunks take at most the chunk's blocks beyond that. It also holds the engine's minimum (one
    sequence's window and a chunk with drafts)."""
    if min(window, block_size, max_running, prefill_chunk_tokens) < 1:
        raise ValueError(
            f"auto_window_blocks needs positive sizes, got window {window}, block size {block_size}, "
            f"max_running {max_running}, prefill chunk {prefill_chunk_tokens}"
        )
    per_seq = min_window_blocks(window, 1 + SPEC_HEADROOM, block_size)
    return max_running * per_seq + blocks_for(prefill_chunk_tokens, block_size)
