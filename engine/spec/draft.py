"""The draft-model proposer: a smaller checkpoint with the target's tokenizer, run through the
Runner protocol beside the target, with its own paged KV and its own block manager.

For each row it first runs the tokens the draft has not seen yet (the prompt on the first call, as
one chunk; then the one or two tokens the target emitted since, as one-token rows so a CUDA draft
replays its decode graphs), then drafts greedily one token per draft step, all rows of a draft step
batched together. It remembers which tokens its KV holds; on the next call the
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
MAX_DECODE_CATCHUP = 4  # catch-ups up to this many tokens run as decode rows, one per draft step


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
        active: list[tuple[int, ProposeRequest, _Row, int, list[list[int]]]] = []  # (+ chunks to run)
        for i, r in enumerate(requests):
            n = len(r.tokens)
            k = min(r.k, self.runner.max_model_len - n + 1)
            if k < 1:
                continue
            row = self._sync(r.seq_id, r.tokens)
            if not self.blocks.grow(r.seq_id, n + k - 1):  # the draft cache is full: skip this row
                self.release(r.seq_id)
                continue
            new = list(r.tokens[len(row.done) :])
            # a short catch-up (the tokens the target emitted since the last draft) runs as one-token
            # rows, which a CUDA runner replays from its decode graphs; a prompt runs as one chunk
            chunks = [[t] for t in new] if row.done and len(new) <= MAX_DECODE_CATCHUP else [new]
            row.confirmed = n
            active.append((i, r, row, k, chunks))
        while active:
            items = []
            for _i, r, row, _k, chunks in active:
                toks = chunks.pop(0) if chunks else [out[_i].tokens[-1]]
                items.append(self._item(r.seq_id, toks, len(row.done), row.done, sample=not chunks))
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
        self, seq_id: int, tokens: list[int], start: int, history: Sequence[int], sample: bool = True
    ) -> StepItem:
        return StepItem(
            seq_id=seq_id,
            token_ids=tokens,
            start_pos=start,
            block_table=list(self.blocks.table(seq_id)),
            sample=sample,
            sampling=_GREEDY,
            history=history,
        )
