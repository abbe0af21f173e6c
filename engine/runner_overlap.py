"""CudaRunner's overlapped decode steps (engine.types.OverlapRunner, engine.loop_overlap): ``launch``
queues a decode step on the runner's stream and returns at once; ``collect`` waits for it.

A launched step runs the bucket's decode graph without io copies (the same kernels as a synchronous
step's, so the same bits); rows with ``StepItem.prev_row`` take their input token from the previous
launch's ids on the device, and the host rewrites the pinned inputs only after the last launch's
"inputs read" event (docs/cuda-runtime.md). Only decode rows whose next token needs nothing from the
host launch. ``OverlapLaunch`` is a base class of CudaRunner, which passes in the engine.cuda module
it drives; must not import CUDA (neither cuda-python nor engine.cuda).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.runner_steps import _on_host, is_decode_row
from engine.types import MemraError, StepItem

MAX_IN_FLIGHT = 2  # launched steps not yet collected (two pinned output slots)


@dataclass
class Launched:
    """A launched step's handle: its output slot and row count."""

    slot: int
    rows: int


def prev_runs(items: Sequence[StepItem]) -> list[tuple[int, int, int]]:
    """(first row, first previous row, count) of each run of consecutive rows whose input is
    consecutive rows of the previous launch's ids."""
    runs: list[tuple[int, int, int]] = []
    for r, it in enumerate(items):
        p = it.prev_row
        if p is None:
            continue
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, p, 1))
    return runs


class OverlapLaunch:
    """CudaRunner's launch / collect (see the module docstring)."""

    def _alloc_overlap(self, cuda: Any) -> None:
        self._ov_cuda = cuda
        rows = self._max_rows
        self._ov_prev = cuda.alloc(4 * rows)  # the last launch's sampled ids, on the device
        self._ov_out = cuda.PinnedBuffer(4 * rows * MAX_IN_FLIGHT)
        self._ov_done = [cuda.Event(timing=False) for _ in range(MAX_IN_FLIGHT)]
        self._ov_read = cuda.Event(timing=False)  # the last launch has read the pinned inputs
        self._ov_queue: deque[Launched] = deque()
        self._ov_slot = 0
        self._ov_rows = 0  # rows of the last launch (0: none since the last synchronous step)
        self._ov_unread = False  # a launch's H2D may not have read the pinned inputs yet

    def can_launch(self, items: Sequence[StepItem]) -> bool:
        """Plain decode rows, at most the largest graph bucket (engine.types.OverlapRunner)."""
        if not 0 < len(items) <= self._max_rows or self.num_state_slots or self.hidden_tap is not None:
            return False
        return all(
            is_decode_row(it)
            and it.sample
            and not it.draft
            and not _on_host(it)
            and not it.sampling.uses_penalties
            for it in items
        )

    def launch(self, items: Sequence[StepItem]) -> Launched:
        """Queue a decode step (see the module docstring); returns its handle for ``collect``."""
        self._ensure_context()
        if not self.can_launch(items):
            raise MemraError("launch: the items are not plain decode rows", code="internal_error")
        if len(self._ov_queue) >= MAX_IN_FLIGHT:
            raise MemraError(f"launch: {MAX_IN_FLIGHT} launched steps are not collected", code="internal_error")
        runs = prev_runs(items)
        if any(p + c > self._ov_rows for _, p, c in runs):
            raise MemraError("launch: prev_row past the previous launch's rows", code="internal_error")
        for it in items:
            self._check_item(it)
        cu, stream = self._ov_cuda, self.stream
        if self._ov_unread:
            self._ov_read.synchronize()  # the pinned inputs are free to rewrite
        n = len(items)
        bucket, _ = self._fill_decode(items, None, ())
        kind = "greedy" if all(it.sampling.greedy for it in items) else "sample"
        short = max(it.start_pos for it in items) < self.plan.short_context
        self._upload_inputs(bucket, kind)
        tokens = self._in_dev.ptr + self._in_off["tokens"]
        for r, p, c in runs:
            cu.dtod(tokens + 4 * r, self._ov_prev.ptr + 4 * p, 4 * c, stream)
        self._ov_read.record(stream)
        self._ov_unread = True
        self._launch_decode_pass(bucket, kind, short)
        out = self._in_dev.ptr + self._in_off["out_ids"]
        cu.dtod(self._ov_prev.ptr, out, 4 * n, stream)
        slot = self._ov_slot
        self._ov_slot = (slot + 1) % MAX_IN_FLIGHT
        cu.dtoh(self._ov_view(slot)[:n], out, stream)
        self._ov_done[slot].record(stream)
        self._ov_rows = n
        handle = Launched(slot, n)
        self._ov_queue.append(handle)
        return handle

    def collect(self, handle: Launched) -> list[int | None]:
        """Wait for a launched step; its sampled ids (handles in launch order)."""
        if not self._ov_queue or self._ov_queue[0] is not handle:
            raise MemraError("collect: not the oldest launched step", code="internal_error")
        self._ov_queue.popleft()
        self._ov_done[handle.slot].synchronize()
        if not self._ov_queue:
            self._ov_unread = False  # (the stream is idle: a synchronous step may write the inputs)
        return self._ov_view(handle.slot)[: handle.rows].tolist()

    def _ov_view(self, slot: int) -> np.ndarray:
        rows = self._max_rows
        return self._ov_out.view(np.int32, rows, 4 * rows * slot)

    def _sync_step_allowed(self) -> None:
        """A synchronous step runs only with every launch collected (its pinned inputs and the
        ids the next launch reads are the launches')."""
        if self._ov_queue:
            raise MemraError("step: launched steps are not collected", code="internal_error")
        self._ov_rows = 0
