"""CudaRunner's recurrent state (hybrid models): the device arrays of the plan's ``StatePlan``s
(one per stateful op and layer, f32, [state slots + 1, slot bytes]; the last slot is the sink that
padding decode rows write) and each step's per-row state inputs.

A row's kernels read the state from ``state_in`` (the live slot; a prefix-cache snapshot slot on a
restore; -1 for zeros at a sequence's first token), write it to ``state_out`` (the live slot) and,
for a token with ``state_snap`` >= 0, also store the state after it into that snapshot slot. These
are step inputs in the packed input block, so a decode step stays one graph replay and snapshots /
restores are device copies inside the kernels. Slots are handed out by engine.block_manager (live
sequences and snapshots alike); the runner only holds the arrays. Past the sink, ``spec_state_slots``
scratch slots hold the state after each draft position of a speculative verify pass
(engine.spec.cuda_verify), the one of the last accepted position copied back into the live slot. ``StateSlots`` is a CudaRunner
base class; driver calls go through the ``engine.cuda`` module CudaRunner passes in. Must not import
cuda-python.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from engine.linear_attn_kernels import state_align
from engine.types import MemraError, StepItem

MAX_STATE_SLOTS = 1024
STATE_SHARE = 0.25  # of the KV budget (kv_memory_fraction of free memory) a hybrid's default slots take
SPEC_STATE_SLOTS = 16  # scratch slots of a speculative verify pass (its draft tokens, all rows together)


class StateSlots:
    """Recurrent-state arrays and inputs of CudaRunner (engine.runner_cuda); see the module docstring."""

    num_state_slots: int = 0
    state_bytes: int = 0  # bytes of one slot over every stateful layer
    spec_state_slots: int = 0  # scratch slots past the sink (speculative verify)
    # the token grid a prefill pass that does not end its item must end on (the chunked delta
    # rule's chunk: engine.linear_attn_kernels.state_align); the scheduler cuts on it too
    state_align: int = 1
    # verify leaves every sequence's state at its last accepted position (engine.loop admits
    # speculation on a hybrid runner that does: engine.types.VerifyingRunner)
    verify_restores_state = True

    def _alloc_states(self, cuda: Any, state_slots: int | None) -> None:
        plans = self.plan.states
        self._state_cuda = cuda
        self._state_bufs: dict[str, Any] = {}
        self.state_bytes = sum(sp.slot_bytes for sp in plans)
        self.state_align = state_align(la for st in self.plan.steps for la in st.launches.get("prefill", ()))
        if not plans:
            self.num_state_slots = 0
            return
        min_slots = max(self.plan.graph_batch_sizes) + 1
        if state_slots is None:
            free, _ = self.ctx.mem_info()
            budget = int(free * self.profile.kv_memory_fraction * STATE_SHARE)
            state_slots = max(min_slots, min(MAX_STATE_SLOTS, budget // self.state_bytes - SPEC_STATE_SLOTS))
        if state_slots < 1:
            raise MemraError(f"state_slots must be >= 1 for a hybrid model, got {state_slots}", param="state_slots")
        self.num_state_slots = int(state_slots)
        self._state_sink = self.num_state_slots
        self.spec_state_slots = SPEC_STATE_SLOTS
        self._spec_scratch0 = self._state_sink + 1
        for sp in plans:
            buf = cuda.alloc(sp.slot_bytes * (self.num_state_slots + 1 + self.spec_state_slots))
            cuda.memset(buf.ptr, 0, buf.nbytes)
            self._state_bufs[sp.name] = buf

    def _state_ptr(self, name: str) -> int:
        return self._state_bufs[name].ptr

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every layer's recurrent state of slot ``src`` into slot ``dst`` (device copies)."""
        self._check_slots(None, src, dst)
        self._copy_slot(src, dst)
        self.stream.synchronize()

    def _copy_slot(self, src: int, dst: int) -> None:
        """Queue the copies of slot ``src`` (scratch slots included) into ``dst`` on the stream."""
        for sp in self.plan.states:
            base = self._state_bufs[sp.name].ptr
            self._state_cuda.dtod(base + dst * sp.slot_bytes, base + src * sp.slot_bytes, sp.slot_bytes, self.stream)

    def spec_scratch(self) -> range:
        """The scratch slots of a speculative verify pass (engine.spec.cuda_verify)."""
        return range(self._spec_scratch0, self._spec_scratch0 + self.spec_state_slots) if self.num_state_slots else range(0)

    def _check_slots(self, it: StepItem | None, *slots: int | None) -> None:
        for s in slots:
            if s is not None and not 0 <= s < self.num_state_slots:
                who = f"seq {it.seq_id}: " if it is not None else ""
                raise MemraError(f"{who}state slot {s} is out of range 0..{self.num_state_slots - 1}", code="internal_error")

    def _live_slot(self, it: StepItem) -> int:
        if it.state_slot is None:
            raise MemraError(f"seq {it.seq_id}: a hybrid model needs a state slot", code="internal_error")
        self._check_slots(it, it.state_slot, it.state_restore, *(s for _, s in it.state_snapshots))
        return it.state_slot

    def _state_start(self, it: StepItem, slot: int) -> int:
        """Where the item's state starts: a restored snapshot, zeros (-1) at position 0, else live."""
        if it.state_restore is not None:
            return it.state_restore
        return -1 if it.start_pos == 0 else slot

    def _fill_state_decode(self, items: Sequence[StepItem], bucket: int) -> None:
        """state_in / state_out / state_snap of a decode pass (padding rows: zeros into the sink)."""
        if not self.num_state_slots:
            return
        v = self._views
        for r, it in enumerate(items):
            slot = self._live_slot(it)
            v["state_in"][r] = self._state_start(it, slot)
            v["state_out"][r] = slot
            snaps = [s for n, s in it.state_snapshots if n == 1]
            if len(snaps) > 1:
                raise MemraError(f"seq {it.seq_id}: two state snapshots after one token", code="internal_error")
            v["state_snap"][r] = snaps[0] if snaps else -1
        v["state_in"][len(items) : bucket] = -1
        v["state_out"][len(items) : bucket] = self._state_sink
        v["state_snap"][len(items) : bucket] = -1

    def _fill_state_prefill(self, s: int, it: StepItem, lo: int, hi: int, row: int) -> None:
        """The state inputs of prefill sequence ``s`` of a pass: tokens lo..hi-1 of ``it`` at pass
        rows row.. (a later chunk of a long item continues from the live slot)."""
        if not self.num_state_slots:
            return
        v = self._views
        slot = self._live_slot(it)
        v["state_in"][s] = self._state_start(it, slot) if lo == 0 else slot
        v["state_out"][s] = slot
        snap = v["state_snap"][row : row + hi - lo]
        snap[:] = -1
        for n, dst in it.state_snapshots:
            if lo < n <= hi:
                if snap[n - lo - 1] != -1:
                    raise MemraError(f"seq {it.seq_id}: two state snapshots after token {n}", code="internal_error")
                snap[n - lo - 1] = dst

    @contextmanager
    def _states_parked(self, rows: int, kind: str) -> Iterator[None]:
        """Inside: the first ``rows`` rows' state inputs point at zeros and the sink (a graph's warm
        run, which must not advance any sequence's state); after: the step's own inputs are back
        in the pinned buffer and on the device."""
        if not self.num_state_slots:
            yield
            return
        v = self._views
        saved = {n: v[n][:rows].copy() for n in ("state_in", "state_out", "state_snap")}
        v["state_in"][:rows] = -1
        v["state_out"][:rows] = self._state_sink
        v["state_snap"][:rows] = -1
        try:
            yield
        finally:
            self.stream.synchronize()  # (the parked inputs' upload has been read)
            for n, arr in saved.items():
                v[n][:rows] = arr
            self._upload_inputs(rows, kind)

    def _free_states(self) -> None:
        for buf in self._state_bufs.values():
            buf.free()
        self._state_bufs.clear()


def state_inputs() -> tuple[tuple[str, type, str], ...]:
    """The packed-input entries the stateful kernels read (engine.runner_cuda's _ROW_INPUTS)."""
    return (("state_in", np.int32, "row"), ("state_out", np.int32, "row"), ("state_snap", np.int32, "token"))
