"""What the engine loop calls to speculate: attach drafts to a step's decode rows, and account for
what verification accepted.

``attach`` picks the rows that may speculate (decode rows of requests that did not opt out and
have no constraint, logit bias or logprobs: ``may_speculate``), asks the policy how many tokens
each gets this step, asks the proposer for them (outside the engine's state lock: a draft model
runs its own steps), then, under the lock, grows each row's block table to hold the draft
positions (never preempting, and leaving one free block per running sequence so plain decode rows
can still grow next step) and rewrites the row's StepItem: ``token_ids`` gets the draft appended
and ``draft`` holds it. ``settle`` (after the step) feeds the policy and the counters and rolls
the rejected positions back. Must not import numpy or CUDA.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from threading import Lock
from typing import Any

from engine.block_manager import BlockManager, blocks_for
from engine.spec.config import SpecConfig
from engine.spec.policy import SpecPolicy
from engine.spec.proposer import Proposer, ProposeRequest
from engine.types import StepItem

log = logging.getLogger("memra.spec")


@dataclass
class SpecCounters:
    """Totals since start: ``draft_tokens`` proposed and verified, ``accepted_tokens`` of them
    accepted, ``verify_rows`` rows verified with a non-empty draft (each emits accepted + 1)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_rows: int = 0


def summary(stats: Any) -> dict[str, Any]:
    """The speculation figures of an EngineStats (or anything with its ``spec_*`` fields), as
    `memra run --stats` and `memra bench` print them."""
    drafted = int(getattr(stats, "spec_draft_tokens", 0))
    accepted = int(getattr(stats, "spec_accepted_tokens", 0))
    rows = int(getattr(stats, "spec_verify_rows", 0))
    return {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "spec_mean_accepted_length": round((accepted + rows) / rows, 3) if rows else None,
    }


def may_speculate(request: Any) -> bool:
    """Whether a GenerationRequest's decode rows may get drafts: not when it opted out
    (``speculative=False``), nor when it has a constraint, a logit bias or asks for logprobs. Those
    are applied per sampled token by the host sampler (engine.sampling.sample_item), which verify
    rows do not run; such rows decode plainly, one token a step, beside the speculating ones."""
    sampling = request.sampling
    return bool(getattr(request, "speculative", True)) and request.constraint is None and not sampling.needs_host


def _covered(blocks: Any, seq_id: int) -> int:
    """The blocks every table of the sequence has (a sliding-window group's may be shorter:
    engine.kv_groups grows it per step)."""
    n = len(blocks.table(seq_id))
    window_table = getattr(blocks, "window_table", None)
    return min(n, len(window_table(seq_id))) if window_table is not None else n


class Speculator:
    def __init__(self, proposer: Proposer, config: SpecConfig):
        self.proposer = proposer
        self.config = config
        self.policy = SpecPolicy(config.k, max_batch=config.max_batch, verify_cost=config.verify_cost)
        self.counters = SpecCounters()

    @property
    def method(self) -> str:
        return self.config.method

    def attach(
        self,
        batch: Sequence[Any],
        items: list[StepItem],
        blocks: BlockManager,
        lock: Lock,
        *,
        max_model_len: int,
        running: int,
    ) -> None:
        """Give the step's decode rows their drafts (in place). ``batch`` holds scheduler.Scheduled."""
        # (a row whose token is the prompt's last, a one-token prompt or one a prefix hit or chunked
        # prefill left alone, is a prefill for the runner's step, and verify would run it as a
        # decode row: other bits on a GPU, so it never speculates)
        decode = [
            i
            for i, s in enumerate(batch)
            if s.sample and s.count == 1 and s.seq.remaining == 1 and s.start >= max(s.seq.prompt_len, 1)
        ]
        if not decode or len(decode) > self.policy.max_batch:  # large batch: plain decode, no per-row work
            return
        reqs: list[tuple[int, ProposeRequest]] = []
        for i in decode:
            seq = batch[i].seq
            if not may_speculate(seq.request):
                continue
            k = self.policy.tokens_for(seq.seq_id, len(decode))
            # never draft past max_tokens or the context: the last emitted token needs no KV
            k = min(k, seq.max_tokens - seq.num_generated - 1, max_model_len - len(seq.token_ids))
            if k > 0:
                reqs.append((i, ProposeRequest(seq.seq_id, seq.token_ids, k, seq.sampling, seq.prompt_len)))
        if not reqs:
            return
        try:
            drafts = self.proposer.propose([r for _, r in reqs])
        except Exception:  # a broken proposer must not fail requests: decode this step plainly
            log.exception("speculative proposer %s failed; decoding without drafts", self.proposer.name)
            for _, r in reqs:
                self.proposer.release(r.seq_id)
            return
        bs = blocks.block_size
        with lock:
            for (i, r), d in zip(reqs, drafts, strict=True):
                toks = [int(t) for t in d.tokens[: r.k]]
                seq = batch[i].seq
                if not toks or not seq.running:
                    continue
                covered = _covered(blocks, seq.seq_id)
                need = blocks_for(seq.num_computed + 1 + len(toks), bs) - covered
                grown = need > 0 and blocks.num_available - need >= running and blocks.grow(
                    seq.seq_id, seq.num_computed + 1 + len(toks)
                )
                if need > 0 and not grown:
                    toks = toks[: max(0, covered * bs - seq.num_computed - 1)]
                if not toks:
                    continue
                it = items[i]
                it.token_ids = [*it.token_ids, *toks]
                it.draft = toks
                it.draft_probs = d.probs[: len(toks)] if d.probs is not None else None
                if grown:  # (else the item's copy of the tables, engine.loop._item, still holds)
                    it.block_table = list(blocks.table(seq.seq_id))
                    if it.window_table is not None:  # (engine.kv_groups: the window group grew too)
                        it.window_table = list(blocks.window_table(seq.seq_id))

    def verify(self, runner: Any, batch: Sequence[Any], items: list[StepItem], during: Any = None) -> list[list[int]]:
        """``runner.verify(items)``, checked: per item 1..k+1 tokens when it samples, else none.
        ``during``: host work for the time the pass runs on the device (engine.loop_stream), given
        to a runner whose ``verify_during`` is true (it calls it once the pass is queued, before
        waiting for it); other runners' passes are done when ``verify`` returns, and the caller
        runs it then."""
        if during is not None and getattr(runner, "verify_during", False):
            out = runner.verify(items, during=during)
        else:
            out = runner.verify(items)
        if len(out) != len(items):
            raise RuntimeError(f"runner returned {len(out)} results for {len(items)} items")
        res = []
        for s, it, toks in zip(batch, items, out, strict=True):
            toks = [operator.index(t) for t in toks]  # numpy integers are fine, anything else fails
            if not (1 <= len(toks) <= len(it.draft) + 1 if s.sample else not toks):
                raise RuntimeError(f"runner verify returned {len(toks)} tokens for a draft of {len(it.draft)}")
            res.append(toks)
        return res

    def stats(self) -> dict[str, int]:
        """The EngineStats fields of speculation."""
        c = self.counters
        return {
            "spec_draft_tokens": c.draft_tokens,
            "spec_accepted_tokens": c.accepted_tokens,
            "spec_verify_rows": c.verify_rows,
        }

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        c = self.counters
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        c.verify_rows += 1
        self.policy.record(seq_id, drafted, accepted)

    def settle(self, seq_id: int, drafted: int, accepted: int, valid: int, blocks: BlockManager, runner: Any) -> None:
        """After a verified row: count it, give back the blocks past the ``valid`` positions (the
        rejected drafts' KV) and let a runner with per-sequence state roll back to them."""
        self.record(seq_id, drafted, accepted)
        blocks.truncate(seq_id, valid)
        rollback = getattr(runner, "spec_rollback", None)
        if rollback is not None:
            rollback(seq_id, valid)

    def release(self, seq_id: int) -> None:
        """The sequence ended: drop its proposer and policy state."""
        self.policy.release(seq_id)
        self.proposer.release(seq_id)
