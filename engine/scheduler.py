"""Continuous-batching scheduler: which sequences run in the next step, and which tokens of each.

Per step: decode rows oldest first (a row that cannot grow preempts the youngest, by recompute),
then prefill chunks within ``prefill_chunk_tokens`` (a chunk that does not finish its sequence ends
on the runner's ``state_align`` grid), then admission strictly in arrival order with one block of
headroom; the rules and their reasons are in docs/engine-loop.md ("Scheduling policy").
Pure Python: must not import numpy, CUDA or the loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockManager, aligned_count, blocks_for
from engine.types import ConfigError, GenerationRequest, SamplingParams


@dataclass(eq=False)
class Sequence:
    """A request's scheduling state. ``token_ids`` is prompt + generated; KV of ``< num_computed`` is written."""

    seq_id: int
    request: GenerationRequest
    sampling: SamplingParams  # with the seed filled in
    token_ids: list[int]
    prompt_len: int
    max_tokens: int  # resolved (never None)
    salt: bytes
    num_computed: int = 0
    cached_tokens: int | None = None  # prefix hit at first admission (usage.cached_tokens)
    running: bool = False
    state: Any = None  # loop-side state (handle, stop checker, timings)
    prompt_memo: dict = field(default_factory=dict)  # StepItem.prompt_memo: the runner's, per sequence

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens whose KV is not yet written (1 for a decode row)."""
        return len(self.token_ids) - self.num_computed

    def __lt__(self, other: Sequence) -> bool:  # arrival order = seq_id order
        return self.seq_id < other.seq_id


@dataclass
class Scheduled:
    """One sequence's share of a step: tokens ``start .. start+count-1``; ``sample`` on the last chunk."""

    seq: Sequence
    start: int
    count: int
    sample: bool


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


class Scheduler:
    """Owns the waiting and running queues (both sorted oldest first) over a BlockManager."""

    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_running: int,
        prefill_chunk_tokens: int,
        max_step_tokens: int,
        state_align: int = 1,
    ):
        if state_align < 1 or blocks.block_size % state_align:
            raise ConfigError(
                f"the runner's state grid ({state_align} tokens: its chunked delta rule's chunk) must divide "
                f"the KV block size {blocks.block_size}"
            )
        if min(prefill_chunk_tokens, max_step_tokens) < state_align:
            raise ConfigError(
                f"engine config: prefill_chunk_tokens ({prefill_chunk_tokens}) and max_step_tokens ({max_step_tokens}) "
                f"must be at least the runner's state grid ({state_align} tokens): a long prompt is cut on it"
            )
        self.state_align = state_align
        self.blocks = blocks
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_step_tokens = max_step_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.preempted_this_step: list[Sequence] = []

    def _take(self, start: int, remaining: int, budget: int) -> int:
        """Tokens of a prefill chunk from ``start``: all ``remaining`` if the budget holds them,
        else the most that end on the state grid (0: none)."""
        if remaining <= budget:
            return remaining
        return aligned_count(start, budget, self.state_align) if self.state_align > 1 else budget

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished/aborted sequence from its queue and release its blocks."""
        if seq.running:
            self.running.remove(seq)
            seq.running = False
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        victim.running = False
        self.blocks.free(victim.seq_id)
        victim.num_computed = 0
        bisect.insort(self.waiting, victim)
        self.counters.preemptions += 1
        self.preempted_this_step.append(victim)

    def schedule(self) -> list[Scheduled]:
        """Decide the next step. Decode rows come first in the returned list, then prefill chunks."""
        out: list[Scheduled] = []
        self.preempted_this_step = []
        budget = self.max_step_tokens
        # 1. decode rows (remaining == 1), oldest first; preempt the youngest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.remaining != 1:
                i += 1
                continue
            while not self.blocks.grow(seq.seq_id, seq.num_computed + 1):
                victim = self.running[-1]  # youngest; never one already scheduled (those are older)
                self._preempt(victim)
                if victim is seq:
                    break
            if not seq.running:
                break  # seq was the youngest and is preempted: nothing after it
            out.append(Scheduled(seq, seq.num_computed, 1, True))
            budget -= 1
            i += 1
        # 2. continue chunked prefills, oldest first. (grow: a no-op for a table that covers the
        # prompt; a sliding-window group takes each chunk's blocks here, engine.kv_groups, and a
        # chunk it has no room for waits)
        prefill = min(self.prefill_chunk_tokens, budget)
        stalled = False
        for seq in self.running:
            if prefill <= 0:
                break
            if seq.remaining <= 1:
                continue
            n = self._take(seq.num_computed, seq.remaining, prefill)
            if not n:
                continue  # no cut on the state grid fits: next step
            if not self.blocks.grow(seq.seq_id, seq.num_computed + n):
                stalled = True
                continue
            out.append(Scheduled(seq, seq.num_computed, n, n == seq.remaining))
            prefill -= n
        # 3. admit waiting sequences in strict arrival order (none while a running prefill waits for
        # window blocks: a younger sequence must not take the blocks an older one waits for)
        while (
            self.waiting
            and prefill > 0
            and len(self.running) < self.max_running
            and not self.preempted_this_step
            and not stalled
        ):
            seq = self.waiting[0]
            total = len(seq.token_ids)
            # One block of headroom for decode growth, unless the sequence can never grow past this.
            max_blocks = blocks_for(seq.prompt_len + seq.max_tokens, self.blocks.block_size)
            headroom = 1 if blocks_for(total, self.blocks.block_size) < max_blocks else 0
            hit = self.blocks.allocate(
                seq.seq_id, seq.token_ids, seq.salt, headroom_blocks=headroom, prompt=total == seq.prompt_len
            )
            if hit is None:
                break  # the oldest waits for space; younger ones must not jump ahead
            n = self._take(hit, total - hit, prefill)
            if not n or not self.blocks.grow(seq.seq_id, hit + n):
                self.blocks.free(seq.seq_id)  # (no cut on the state grid fits, or a window group without room)
                break
            self.waiting.pop(0)
            bisect.insort(self.running, seq)
            seq.running = True
            seq.num_computed = hit
            if seq.cached_tokens is None:
                seq.cached_tokens = min(hit, seq.prompt_len)
            c = self.counters
            c.prefix_query_tokens += total
            c.prefix_hit_tokens += hit
            out.append(Scheduled(seq, seq.num_computed, n, n == seq.remaining))
            prefill -= n
        if stalled and not out and len(self.running) > 1:
            # every runnable sequence is a prefill waiting for window blocks the others hold: the
            # youngest gives its blocks back (the window pool holds one sequence's window and step)
            self._preempt(self.running[-1])
        return out
