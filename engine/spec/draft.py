"""The draft-model proposer: a smaller checkpoint with the target's tokenizer, run through the
Runner protocol beside the target, with its own paged KV and its own block manager.

For each row it first runs the tokens the draft has not seen yet (the prompt on the first call,
then the tokens the target emitted since), then drafts greedily one token per draft step, all rows
of the step batched together. It remembers which tokens its KV holds; on the next call the
positions whose tokens the target did not accept are rolled back (block-manager truncation) before
the catch-up. Its proposals are deterministic (argmax), so verification treats them as point-mass
proposals, which the rejection rule handles exactly for sampled requests too.
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


@dataclass
class _Row:
    done: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, in order
    confirmed: int = 0  # leading entries of ``done`` known to be the sequence's own tokens


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: Any):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_cache=False)
        self._rows: dict[int, _Row] = {}

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        self.blocks.free(seq_id)

    def _sync(self, seq_id: int, tokens: Sequence[int]) -> _Row:
        """The row's state with ``done`` cut back to the prefix it shares with ``tokens``."""
        row = self._rows.get(seq_id)
        if row is None:
            row = self._rows[seq_id] = _Row()
            self.blocks.allocate(seq_id, [], _SALT)
        c = min(row.confirmed, len(tokens))
        while c < len(row.done) and c < len(tokens) and row.done[c] == tokens[c]:
            c += 1
        c = min(c, len(tokens) - 1)  # the last token always runs: its logits give the first draft
        del row.done[c:]
        self.blocks.truncate(seq_id, c)
        return row

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        out = [Draft() for _ in requests]
        rows: list[tuple[int, ProposeRequest, _Row, int]] = []  # (index, request, state, k)
        items: list[StepItem] = []
        for i, r in enumerate(requests):
            n = len(r.tokens)
            k = min(r.k, self.runner.max_model_len - n + 1)
            if k < 1:
                continue
            row = self._sync(r.seq_id, r.tokens)
            if not self.blocks.grow(r.seq_id, n + k - 1):  # the draft cache is full: skip this row
                self.release(r.seq_id)
                continue
            c = len(row.done)
            items.append(self._item(r.seq_id, list(r.tokens[c:]), c, r.tokens))
            row.done.extend(r.tokens[c:])
            row.confirmed = n
            rows.append((i, r, row, k))
        step = 0
        while items:
            ids = self.runner.step(items)
            nxt: list[StepItem] = []
            keep: list[tuple[int, ProposeRequest, _Row, int]] = []
            for (i, r, row, k), tok in zip(rows, ids, strict=True):
                out[i].tokens.append(int(tok))
                if step + 1 < k:
                    nxt.append(self._item(r.seq_id, [int(tok)], len(row.done), row.done))
                    row.done.append(int(tok))
                    keep.append((i, r, row, k))
            items, rows, step = nxt, keep, step + 1
        return out

    def _item(self, seq_id: int, tokens: list[int], start: int, history: Sequence[int]) -> StepItem:
        return StepItem(
            seq_id=seq_id,
            token_ids=tokens,
            start_pos=start,
            block_table=list(self.blocks.table(seq_id)),
            sample=True,
            sampling=_GREEDY,
            history=history,
        )
