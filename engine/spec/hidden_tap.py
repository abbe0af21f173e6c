"""HiddenTap: the target's hidden states per sequence and position, kept for the MTP head.

A runner with a tap (``runner.hidden_tap``) records, after every item it runs, the rows of the MTP
section's ``hidden_from`` value for the item's positions; a write at position p first drops the
rows from p on, so rows below a sequence's computed length are those of its accepted tokens
(docs/speculative.md, "MTP heads"). Holds numpy arrays but does no math; must not import CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_ROWS = 8192  # unconsumed rows kept per sequence


@dataclass
class _Rows:
    first: int  # position of rows[0]
    rows: list[np.ndarray] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.first + len(self.rows)


class HiddenTap:
    def __init__(self, value: str, max_rows: int = MAX_ROWS):
        self.value = value  # the graph value recorded (e.g. the final-normed hidden state `h`)
        self.max_rows = int(max_rows)
        self._seqs: dict[int, _Rows] = {}

    def record(self, seq_id: int, start_pos: int, rows: Any) -> None:
        """Rows [n, hidden] for positions start_pos .. start_pos + n - 1 of ``seq_id``."""
        arr = np.asarray(rows, dtype=np.float32)
        s = self._seqs.get(seq_id)
        if s is None or start_pos < s.first or start_pos > s.end:
            s = self._seqs[seq_id] = _Rows(start_pos)  # first rows, a recompute, or a gap
        del s.rows[start_pos - s.first :]
        s.rows.extend(np.array(r, copy=True) for r in arr)
        over = len(s.rows) - self.max_rows
        if over > 0:
            del s.rows[:over]
            s.first += over

    def span(self, seq_id: int) -> tuple[int, int]:
        """(first, end): the positions first .. end - 1 have rows (end == first: none)."""
        s = self._seqs.get(seq_id)
        return (s.first, s.end) if s is not None else (0, 0)

    def rows(self, seq_id: int, lo: int, hi: int) -> np.ndarray:
        """Rows of positions lo .. hi - 1 as [hi - lo, hidden] (all must be held)."""
        s = self._seqs[seq_id]
        if not s.first <= lo <= hi <= s.end:
            raise KeyError(f"seq {seq_id}: hidden rows {lo}..{hi - 1} not held ({s.first}..{s.end - 1})")
        return np.stack(s.rows[lo - s.first : hi - s.first])

    def consume(self, seq_id: int, upto: int) -> None:
        """Drop the rows of positions below ``upto`` (the head has used them)."""
        s = self._seqs.get(seq_id)
        if s is None:
            return
        n = min(max(0, upto - s.first), len(s.rows))
        del s.rows[:n]
        s.first += n

    def drop(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._seqs)
