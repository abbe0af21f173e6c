"""The draft-model proposer: a smaller checkpoint with the target's tokenizer, run through the
Runner protocol beside the target, with its own paged KV and its own block manager.

For each row it first runs the tokens the draft has not seen yet, then drafts greedily one token
per draft step, all rows of a draft step batched together. The catch-up runs each position the way
the target ran it, so that a draft model that is the target itself computes every proposed token
with the target's bits (a CUDA prefill pass and a decode row reduce differently; tests/fixtures/
batch_invariance.py makes decode rows of any batch, and the verify rows, bit-equal to batch-1 decode
rows): the prompt's positions (below ``prompt_len``) in one chunk, which carries ``prompt_len`` so
the runner computes the prompt's tail as decode rows as the target's did
(engine.runner_tail), the rest as prefill; every later position,
the row's last token included (the target runs it as a decode row this step), as a one-token
decode row, so a CUDA draft replays its decode graphs. A catch-up of more than MAX_DECODE_CATCHUP generated
tokens (a row that did not speculate for a while: a large batch, a low acceptance rate) runs all
but its last token as one prefill chunk instead, which costs one pass rather than one draft step
a token; its KV then has prefill bits, so a self-draft may later be rejected at a near tie
(acceptance only: the output is the target's either way).

It remembers which tokens its KV holds; on the next call the
positions whose tokens the target did not accept are rolled back (block-manager truncation) before
the catch-up. Its proposals are deterministic (argmax), so verification treats them as point-mass
proposals, which the rejection rule handles exactly for sampled requests too.

A hybrid draft model (recurrent layers: ``runner.num_state_slots`` > 0) keeps each row's recurrent
state in a live slot of its block manager (half the runner's slots); the other half is a pool of
snapshot slots. While it drafts, the state after the catch-up and after each drafted token but the
last is also stored into a pool slot (the items' ``state_snapshots``), so that the next call rolls
the state back to the tokens the target accepted (``runner.copy_state``) before catching up. A
row whose rollback point has no snapshot (a recompute) starts over from its first token.
Must not import numpy or CUDA (the draft runner does its own math).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockManager
from engine.spec.proposer import Draft, ProposeRequest
from engine.types import SamplingParams, StepItem

_GREEDY = SamplingParams(temperature=0.0)
_SALT = b"memra-draft"
MAX_DECODE_CATCHUP = 16  # generated tokens a catch-up runs as decode rows, one per draft step


def catchup_chunks(new: Sequence[int], start: int, prompt_len: int) -> list[list[int]]:
    """The runner items (token lists, in order) that run ``new``, the tokens at positions
    ``start ..``, as the target ran them: positions below the prompt's end (``prompt_len``; 0:
    unknown, every position but the last) as one prefill chunk, every later one as a one-token
    decode row; a run of more than MAX_DECODE_CATCHUP such rows as one chunk but its last token
    (module docstring). A one-token item at position 0 is a prefill for any runner."""
    end = start + len(new)
    prompt_end = min(prompt_len if prompt_len > 0 else end - 1, end - 1)
    cut = max(0, prompt_end - start)
    if len(new) - cut > MAX_DECODE_CATCHUP:
        cut = len(new) - 1
    return ([list(new[:cut])] if cut else []) + [[t] for t in new[cut:]]


@dataclass
class _Row:
    done: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, in order
    confirmed: int = 0  # leading entries of ``done`` known to be the sequence's own tokens
    snaps: dict[int, int] = field(default_factory=dict)  # (hybrid) tokens run -> slot of the state after them


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: Any):
        self.runner = runner
        slots = int(getattr(runner, "num_state_slots", 0) or 0)
        self.hybrid = slots > 0
        live = slots - slots // 2
        self._snap_free = list(range(live, slots))  # (hybrid) the snapshot pool
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_cache=False, state_slots=live)
        self._rows: dict[int, _Row] = {}

    def release(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_snaps(row)
        self.blocks.free(seq_id)

    def _free_snaps(self, row: _Row) -> None:
        self._snap_free.extend(row.snaps.values())
        row.snaps = {}

    def _live_slot(self, seq_id: int) -> int | None:
        return self.blocks.state_for_step(seq_id, 0, 0, 0)[0]

    def _sync(self, seq_id: int, tokens: Sequence[int]) -> _Row | None:
        """The row's state with ``done`` cut back to the prefix it shares with ``tokens`` (None: no
        room for a new row in the draft's block manager)."""
        row = self._rows.get(seq_id)
        if row is None:
            if self.blocks.allocate(seq_id, [], _SALT) is None:
                return None
            row = self._rows[seq_id] = _Row()
        c = min(row.confirmed, len(tokens))
        while c < len(row.done) and c < len(tokens) and row.done[c] == tokens[c]:
            c += 1
        c = min(c, len(tokens) - 1)  # the last token always runs: its logits give the first draft
        if self.hybrid and 0 < c < len(row.done):  # the recurrent state back to c tokens
            src = row.snaps.get(c)
            if src is None:  # no snapshot there: the row starts over
                self.release(seq_id)
                return self._sync(seq_id, tokens)
            self.runner.copy_state(src, self._live_slot(seq_id))
        self._free_snaps(row)
        del row.done[c:]
        self.blocks.truncate(seq_id, c)
        return row

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        out = [Draft() for _ in requests]
        active: list[tuple[int, ProposeRequest, _Row, int, list[list[int]]]] = []  # (+ chunks to run)
        for i, r in enumerate(requests):
            n = len(r.tokens)
            k = min(r.k, self.runner.max_model_len - n + 1)
            if k < 1:
                continue
            row = self._sync(r.seq_id, r.tokens)
            if row is None:
                continue
            if self.hybrid:  # the states after n .. n + k - 2 tokens go to pool slots (rollback points)
                k = min(k, len(self._snap_free) + 1)
                row.snaps = {n + j: self._snap_free.pop() for j in range(k - 1)}
            if not self.blocks.grow(r.seq_id, n + k - 1):  # the draft cache is full: skip this row
                self.release(r.seq_id)
                continue
            chunks = catchup_chunks(r.tokens[len(row.done) :], len(row.done), r.prompt_len)
            row.confirmed = n
            active.append((i, r, row, k, chunks))
        while active:
            items = []
            for _i, r, row, _k, chunks in active:
                toks = chunks.pop(0) if chunks else [out[_i].tokens[-1]]
                items.append(self._item(r.seq_id, toks, len(row.done), row.done, not chunks, row.snaps, r.prompt_len))
                row.done.extend(toks)
            ids = self.runner.step(items)
            keep = []
            for (i, r, row, k, chunks), tok in zip(active, ids, strict=True):
                if chunks:  # still catching up
                    keep.append((i, r, row, k, chunks))
                    continue
                out[i].tokens.append(int(tok))
                if len(out[i].tokens) < k:
                    keep.append((i, r, row, k, chunks))
            active = keep
        return out

    def _item(
        self,
        seq_id: int,
        tokens: list[int],
        start: int,
        history: Sequence[int],
        sample: bool = True,
        snaps: dict[int, int] | None = None,
        prompt_len: int = 0,
    ) -> StepItem:
        slot = snap = None
        if self.hybrid:
            slot = self._live_slot(seq_id)
            snap = (snaps or {}).get(start + len(tokens))
        return StepItem(
            seq_id=seq_id,
            token_ids=tokens,
            start_pos=start,
            block_table=list(self.blocks.table(seq_id)),
            sample=sample,
            sampling=_GREEDY,
            history=history,
            prompt_len=prompt_len,  # (the runner runs the prompt's tail as the target does)
            state_slot=slot,
            state_snapshots=((len(tokens), snap),) if snap is not None else (),
        )
