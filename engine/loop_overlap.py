"""Overlapped decode steps for the engine loop (``EngineConfig.overlap``): while the runner runs
decode step n, the engine thread schedules step n+1 and queues it (its input tokens step n's
sampled ids, still on the device: ``StepItem.prev_row``), then reads step n's tokens.

Only a batch of plain decode rows overlaps; anything else collects the step in flight and runs
synchronously, and a request that stopped at step n has its step n+1 row dropped, so greedy and
seeded output is the same with the overlap on or off (docs/engine-loop.md, "Overlapped decode
steps"). ``OverlapLoop`` is a base class of engine.loop.Engine; must not import engine.loop, numpy
or CUDA.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

from engine.scheduler import Scheduled
from engine.types import StepItem

log = logging.getLogger("memra.engine")

PENDING_TOKEN = -1  # StepItem.token_ids of a row whose input the previous launch sampled


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    batch: list[Scheduled]
    items: list[StepItem]
    handle: Any


def overlap_capable(runner: Any, speculator: Any, state_slots: int, windowed: bool) -> bool:
    """Whether steps may overlap on this engine (engine.types.OverlapRunner, no speculator, no
    recurrent state slots, one KV pool); logs why not when they may not."""
    why = None
    if not all(callable(getattr(runner, m, None)) for m in ("can_launch", "launch", "collect")):
        why = f"the {runner.backend} runner cannot queue steps"
    elif speculator is not None:
        why = "speculative decoding"
    elif state_slots:
        why = "a hybrid model's recurrent state"
    elif windowed:
        why = "a sliding-window KV pool"
    if why is not None:
        log.info("overlapped decode steps: off (%s)", why)
    return why is None


def plain_row(s: Scheduled) -> bool:
    """A decode row whose next token needs nothing from the host."""
    seq, sp = s.seq, s.seq.sampling
    return (
        s.count == 1
        and s.sample
        and s.start > 0
        and seq.request.constraint is None
        and not sp.needs_host
        and not sp.uses_penalties
    )


class OverlapLoop:
    """Engine's overlapped step (see the module docstring). Uses Engine's scheduler, blocks, lock,
    ``_schedule``, ``_item``, ``_run_sync``, ``_apply`` and ``_fail_step``."""

    _pending: InFlight | None = None
    _overlap = False
    # (oldest waiting seq id, requests ended so far) after a synchronous schedule that left that
    # request waiting with a running slot free: it waits for blocks, and until a request ends (or
    # another becomes the oldest) no admission can succeed, so the steps may go on overlapping
    _blocked: tuple[int, int] | None = None

    def _ended(self) -> int:
        n = self._n
        return n["finished"] + n["aborted"] + n["errors"]

    @property
    def overlaps(self) -> bool:
        """Whether decode steps overlap (EngineConfig.overlap, on a runner and model that can)."""
        return self._overlap

    def _step_overlap(self) -> None:
        pend = self._pending
        if pend is None:
            batch, items = self._schedule()
            sched = self.scheduler
            self._blocked = None
            if sched.waiting and len(sched.running) < sched.max_running and not sched.preempted_this_step:
                self._blocked = (sched.waiting[0].seq_id, self._ended())
            if not batch:
                return
            if all(plain_row(s) for s in batch) and self.runner.can_launch(items):
                self._launch(batch, items)
            else:
                self._run_sync(batch, items)
            return
        with self._lock:
            follow = self._follow(pend)
        if follow is not None and not self.runner.can_launch(follow[1]):
            follow = None
        if follow is not None and not self._launch(*follow):
            self._drop_pending(pend)
            if self.on_step is not None:
                self.on_step(self)
            return
        self._collect(pend)

    def _launch(self, batch: list[Scheduled], items: list[StepItem]) -> bool:
        """Queue a step; on a runner error its requests (and the step in flight's) fail."""
        try:
            handle = self.runner.launch(items)
        except Exception as exc:
            pend, self._pending = self._pending, None
            seqs = {id(s.seq): s for s in (pend.batch if pend else [])} | {id(s.seq): s for s in batch}
            self._fail_step(list(seqs.values()), exc)
            return False
        self._pending = InFlight(batch, items, handle)
        return True

    def _collect(self, pend: InFlight) -> None:
        """Read ``pend``'s tokens and post-process them (the step after it, if any, stays queued)."""
        if self._pending is pend:
            self._pending = None
        try:
            sampled = self.runner.collect(pend.handle)
            if len(sampled) != len(pend.items):
                raise RuntimeError(f"runner returned {len(sampled)} results for {len(pend.items)} items")
            tokens = [[operator.index(t)] for t in sampled]
        except Exception as exc:
            later = self._pending
            seqs = {id(s.seq): s for s in pend.batch + (later.batch if later else [])}
            self._drop_pending(later)
            self._fail_step(list(seqs.values()), exc)
        else:
            self._apply(pend.batch, pend.items, tokens)
        if self.on_step is not None:
            self.on_step(self)

    def _drop_pending(self, pend: InFlight | None = None) -> None:
        """Wait for a queued step and forget its tokens (its requests already failed or ended)."""
        pend = pend or self._pending
        self._pending = None
        if pend is not None:
            try:
                self.runner.collect(pend.handle)
            except Exception:  # the step's requests have their final events already
                pass

    def _follow(self, pend: InFlight) -> tuple[list[Scheduled], list[StepItem]] | None:
        """Step n+1 of the step in flight, or None when it must run synchronously once that one is
        read. Grows the rows' block tables by the position n+1 writes. Called under the lock."""
        sched = self.scheduler
        rows = [(r, s) for r, s in enumerate(pend.batch) if self._live.get(s.seq.request.request_id) is s.seq]
        if not rows or len(rows) != len(sched.running):
            return None  # every request ended, or a running one is prefilling
        if sched.waiting and len(sched.running) < sched.max_running:
            if self._blocked != (sched.waiting[0].seq_id, self._ended()):
                return None  # an admission may happen: schedule it
        limit = self.runner.max_model_len
        batch: list[Scheduled] = []
        items: list[StepItem] = []
        for r, s in rows:
            seq = s.seq
            if not plain_row(s) or seq.num_computed != s.start or len(seq.token_ids) != s.start + 1:
                return None
            if seq.num_generated + 1 >= seq.max_tokens or len(seq.token_ids) + 1 >= limit:
                continue  # step n gives its last token
            if not self.blocks.grow(seq.seq_id, s.start + 2):
                return None  # no block: the synchronous step preempts
            nxt = Scheduled(seq, s.start + 1, 1, True)
            batch.append(nxt)
            items.append(
                StepItem(
                    seq_id=seq.seq_id,
                    token_ids=(PENDING_TOKEN,),
                    start_pos=nxt.start,
                    block_table=list(self.blocks.table(seq.seq_id)),
                    sample=True,
                    sampling=seq.sampling,
                    history=seq.token_ids,
                    prompt_len=seq.prompt_len,
                    prompt_memo=seq.prompt_memo,
                    num_generated=seq.num_generated + 1,
                    prev_row=r,
                )
            )
        return (batch, items) if batch else None
