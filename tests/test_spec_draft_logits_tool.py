"""tools/spec_draft_logits.py's bookkeeping on a stub runner (no GPU): the taps key each sampled row's
logits by (sequence, position), decode rows and prefill heads, the target's verify rows only; a
verified draft is compared row by row with the draft's logits, and a rejected token prints both
top-2 lists."""

from __future__ import annotations

import io

import numpy as np
from fixtures.tools import load_tool

from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


class StubRunner:
    """Logits row r of a pass: ``table[(seq, position)]`` (or zeros)."""

    def __init__(self, table):
        self.table, self.last = table, []

    def _decode(self, items, short_ok=True, verify=False):
        self.last = [(it.seq_id, it.start_pos) for it in items]
        return [0] * len(items)

    def _run_prefill_pass(self, segs):
        self.last = [(it.seq_id, it.start_pos + hi - 1) for _, it, _, hi in segs if hi == len(it.token_ids) and it.sample]
        return {}

    def read_logits(self, rows):
        return np.stack([self.table.get(k, np.zeros(4, np.float32)) for k in self.last[:rows]])


def test_taps_and_the_report():
    tool = load_tool("spec_draft_logits")
    row = np.array([0.0, 3.0, 2.5, 1.0], np.float32)  # argmax 1, runner-up 2
    near = np.array([0.0, 2.5, 3.0, 1.0], np.float32)
    t = {(0, 10): row, (0, 11): row, (0, 12): near}
    d = {(0, 9): row, (0, 10): row, (0, 11): row + 1e-3, (0, 12): row}
    target, draft = StubRunner(t), StubRunner(d)
    tt, dt = tool.LogitTap(target, verify_only=True), tool.LogitTap(draft)
    target._decode([StepItem(0, [5], 10, [0], True, GREEDY)])  # a plain decode row: not kept
    assert tt.rows == {}
    draft._run_prefill_pass([(0, StepItem(0, [1, 2, 3], 8, [0], True, GREEDY), 0, 2)])  # chunk not ending: no head
    draft._run_prefill_pass([(0, StepItem(0, [1, 2], 8, [0], True, GREEDY), 0, 2)])
    assert list(dt.rows) == [(0, 9)]
    for pos in (10, 11, 12):
        draft._decode([StepItem(0, [1], pos, [0], True, GREEDY)])
    rows = [StepItem(0, [1], 10 + j, [0], True, GREEDY) for j in range(4)]
    target._decode(rows, verify=True)
    assert set(tt.rows) == {(0, 10), (0, 11), (0, 12), (0, 13)}
    out = io.StringIO()
    report = tool.Report(tt, dt, out)
    item = StepItem(0, [5, 1, 1, 1], 10, [0], True, GREEDY, draft=[1, 1, 1])
    report.compare(item, [1, 1, 2])  # rows 10, 11 accepted; row 12's draft 1 rejected for 2
    line = out.getvalue()
    assert line.startswith("seq 0 pos 13: draft 1 rejected for 2")
    assert "draft top2 1:3.000000 2:2.500000" in line and "target top2 2:3.000000 1:2.500000" in line
    assert "on the 2 accepted rows before it: 1/2" in line  # row 10 bit-equal, row 11 not
    assert (report.rows, report.same, report.drafted, report.accepted) == (3, 1, 3, 2)
    assert "accepted 2 (66.67%)" in report.summary() and "bit-identical 1" in report.summary()
