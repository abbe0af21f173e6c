"""CudaRunner's hidden-state tap (the MTP head's input, engine.spec.hidden_tap): with a HiddenTap
set (``runner.hidden_tap``), every pass records, per item, the target's final-normed hidden state
of each position it ran.

The head may fold the final RMSNorm into the lm_head GEMV and runs on each prefill item's last row
only, so the tap reads back the final norm's input (every row of the pass) and applies the norm on
the host in f32, as the reference does. ``write_value`` fills an input value's rows from the host
(the CUDA MTP head's input). ``HiddenRows`` is a CudaRunner base class; the copies go through
``CudaRunner.read_value`` and the driver module CudaRunner hands its state arrays
(engine.runner_state). Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine import ops_ref
from engine.types import ConfigError, StepItem


class HiddenRows:
    """The tap of CudaRunner (engine.runner_cuda); see the module docstring."""

    # engine.spec.hidden_tap.HiddenTap set by the MTP proposer (engine.spec.build)
    hidden_tap: Any = None
    _tap_norm: tuple[str, np.ndarray, float] | None = None

    def write_value(self, name: str, rows: np.ndarray) -> None:
        """Rows 0 .. len(rows) - 1 of plan value ``name`` (a value of its own buffer: offset 0, ld =
        width) from f32 ``rows``, bf16-rounded, queued on the runner's stream (a graph input the
        next pass reads: the MTP head's ``eh``)."""
        v = self.plan.values[name]
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if v.offset or v.ld != v.width or rows.ndim != 2 or rows.shape[1] != v.width or v.dtype != "bf16":
            raise ValueError(f"write_value: {name} ({v.dtype}, width {v.width}, ld {v.ld}) from rows {rows.shape}")
        self._state_cuda.htod(self._value_ptr[name], ops_ref.bf16_bits(rows), self.stream)  # (the driver module CudaRunner passed in)

    def _tap_source(self) -> tuple[str, np.ndarray, float]:
        """(the final norm's input value, its f32 weight, eps) for the tapped value."""
        if self._tap_norm is None:
            want = self.hidden_tap.value
            step = next((st for st in reversed(self.plan.steps) if want in st.op.outputs), None)
            if step is None or step.op.op != "rmsnorm" or step.layer is not None:
                raise ConfigError(
                    f"hidden tap: the cuda backend taps a final rmsnorm's output; {want!r} is not one in the "
                    f"{self.plan.family} plan"
                )
            op, dims = step.op, self.model.dims
            w = np.asarray(self.model.dequantize(op.weights[0], None), np.float32)
            offset = op.attrs.get("offset")
            if offset and dims.get(offset):
                w = np.float32(dims[offset]) + w
            self._tap_norm = (op.inputs[0], w, float(dims["rms_eps"]))
        return self._tap_norm

    def _tap_rows(self, rows: int, spans: Sequence[tuple[int, int, int, int]]) -> None:
        """Record pass rows: spans of (seq id, first position, first row, row count)."""
        name, w, eps = self._tap_source()
        h = ops_ref.rmsnorm(self.read_value(name, rows), w, eps)
        for seq, pos, lo, m in spans:
            self.hidden_tap.record(seq, pos, h[lo : lo + m])

    def _tap_prefill(self, segs: Sequence[tuple[int, StepItem, int, int]], n: int) -> None:
        """A prefill pass of ``n`` rows: every segment's rows (``segs`` as in _run_prefill_pass)."""
        if self.hidden_tap is None:
            return
        spans, row = [], 0
        for _, it, lo, hi in segs:
            spans.append((it.seq_id, it.start_pos + lo, row, hi - lo))
            row += hi - lo
        self._tap_rows(n, spans)

    def _tap_decode(self, items: Sequence[StepItem]) -> None:
        """A decode pass: row r holds item r's one position (verify rows included)."""
        if self.hidden_tap is None:
            return
        self._tap_rows(len(items), [(it.seq_id, it.start_pos, r, 1) for r, it in enumerate(items)])
