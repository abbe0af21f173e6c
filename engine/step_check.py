"""check_step_item: the checks every runner (reference, CUDA, fake) makes on a step item before it
runs: at least one token from a non-negative position, within the context, a block table covering
its positions, the blocks its new positions write in range (the earlier ones were checked when
they were written), token ids inside the vocabulary (but for an overlapped row's pending token).

Must not import CUDA (no ``engine.cuda``, ``engine.nvrtc``, ``cuda.*``) nor any runner.
"""

from __future__ import annotations

from engine.types import MemraError, StepItem


def bad_item(item: StepItem, problem: str) -> MemraError:
    """A step item the scheduler should never have built (an engine bug, not a user error)."""
    return MemraError(f"seq {item.seq_id}: {problem}", code="internal_error")


def check_step_item(item: StepItem, *, max_model_len: int, block_size: int, num_blocks: int, vocab: int) -> int:
    """Raise MemraError naming what is wrong with ``item``; return the number of blocks its positions need."""
    n = len(item.token_ids)
    if n == 0:
        raise bad_item(item, "a step item needs at least one token")
    if item.start_pos < 0:
        raise bad_item(item, f"start_pos {item.start_pos} < 0")
    end = item.start_pos + n
    if end > max_model_len:
        raise MemraError(
            f"seq {item.seq_id}: {end} tokens exceed the maximum context length {max_model_len}",
            code="context_length_exceeded",
        )
    need = -(-end // block_size)
    table = item.block_table
    if len(table) < need:
        raise bad_item(item, f"block_table has {len(table)} blocks, {end} positions need {need}")
    used = table[item.start_pos // block_size : need]  # the blocks this step writes: O(new tokens)
    if min(used) < 0 or max(used) >= num_blocks:
        b = next(b for b in used if not 0 <= b < num_blocks)
        raise bad_item(item, f"block {b} is out of range (num_blocks={num_blocks})")
    ids = item.token_ids if item.prev_row is None else ()  # (a prev_row token is the device's)
    if ids and (min(ids) < 0 or max(ids) >= vocab):  # (min/max: cheap on a long prefill chunk)
        tok = next(t for t in ids if not 0 <= t < vocab)
        raise MemraError(f"token id {tok} is out of range (vocab size {vocab})", param="prompt")
    return need
