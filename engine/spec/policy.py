"""How many tokens to draft for a row this step: off for large batches, else from the row's
measured acceptance rate.

With a per-token acceptance rate ``a``, drafting ``k`` tokens emits ``(1 - a^(k+1)) / (1 - a)``
tokens per verify step on average, at a cost of ``1 + verify_cost * k`` decode steps; the policy
picks the k (0..max) with the best ratio, so a row whose drafts keep failing drops to k = 0 (a
plain decode row). Such a row probes with one token every ``probe_every`` steps so its estimate
can recover. The rate is an exponential moving average of each verify step's per-token estimate
``accepted / (accepted + 1)`` when a token was rejected, 1 when the whole draft was accepted.
Pure Python; must not import numpy, CUDA or the engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RowState:
    """Per-sequence acceptance estimate."""

    rate: float
    idle_steps: int = 0


class SpecPolicy:
    def __init__(
        self,
        max_k: int,
        *,
        max_batch: int = 8,
        verify_cost: float = 0.1,
        initial_rate: float = 0.7,
        smoothing: float = 0.7,
        probe_every: int = 16,
    ):
        self.max_k = max_k
        self.max_batch = max_batch
        self.verify_cost = verify_cost
        self.initial_rate = initial_rate
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.rows: dict[int, RowState] = {}

    def best_k(self, rate: float) -> int:
        """The k in 0..max_k with the most expected tokens per unit of step cost."""
        best, best_gain = 0, 1.0
        for k in range(1, self.max_k + 1):
            tokens = k + 1 if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)
            gain = tokens / (1.0 + self.verify_cost * k)
            if gain > best_gain + 1e-9:
                best, best_gain = k, gain
        return best

    def tokens_for(self, seq_id: int, decode_rows: int) -> int:
        """Draft length for this row this step (0: decode normally)."""
        if decode_rows > self.max_batch:
            return 0
        st = self.rows.get(seq_id)
        if st is None:
            st = self.rows[seq_id] = RowState(self.initial_rate)
        k = self.best_k(st.rate)
        if k == 0:
            st.idle_steps += 1
            if st.idle_steps >= self.probe_every:
                st.idle_steps = 0
                return 1
        return k

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify step of ``drafted`` tokens accepted ``accepted`` of them."""
        if drafted <= 0:
            return
        st = self.rows.setdefault(seq_id, RowState(self.initial_rate))
        s = self.smoothing
        seen = 1.0 if accepted >= drafted else accepted / (accepted + 1)
        st.rate = s * st.rate + (1.0 - s) * seen

    def release(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)
