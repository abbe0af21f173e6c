"""A prompt's last positions run as decode rows on the CUDA runner (issue #34: cold and warm-prefix TTFT).

A prefill pass of a few rows costs about as much as one of a few hundred (its GEMMs decode the
weights in their tile loads whatever the row count), and a decode row reduces otherwise than a
prefill pass (GEMVs, not the prefill GEMM), so the same position gets other bits from each. A
prompt's *tail* is the positions the runner runs as decode rows, after the prefill passes, by a
rule of absolute position that a cold prompt, a chunked one and a prefix-cache hit all follow, so
a warm request computes every position exactly as the cold run did and its output equals the cold
output bit for bit (``tail_count``):

- a dense plan (no recurrent state, no sliding-window pool: ``whole_block_tails`` false): only
  the prompt's last position, where the prompt does not end on a block boundary; every other
  prompt position runs in the prefill pass. The prefix cache's partial entries
  (engine.partial_blocks) then hold prefill-computed KV at all but their prompt's last position,
  which another prompt copies wherever its own cold run computes the position by prefill too (never
  the entry's last, a decode row's: a prompt sent again copies all but its last position and runs
  that one as a tail of one row).
- a hybrid (Gated DeltaNet: its prefix hits restore a state snapshot at a block boundary, never
  in between) and a plan with a sliding-window pool (no partial entries): the prompt's trailing
  partial block, positions from the last block boundary below ``prompt_len`` to the end of the
  prompt, whichever prefill chunk holds them, so a hit that stops at the boundary runs its few
  new tokens as decode rows rather than a prefill pass.

Tails run as rows of one sequence through the plain decode launches, the way a speculative verify
pass runs a draft's k + 1 positions (engine.spec.cuda_verify: one pass of exactly that many rows,
the plan's verify launches below short_context where it has them; a hybrid's stateful launches
once per row, in order, each row reading the state the row before wrote). Past the plan's
``short_context`` a dense plan's tail pass runs its attention as the prefill key split's per-span
partials + fold (the TAIL launches, engine.lowering.attention: each sequence's K/V read once per
span for all of its rows, where the decode kernel reads them once a row), so those rows agree with
plain decode rows to rounding, not bit for bit; a hybrid's keep the decode launches. Decode rows
are row-count invariant (the verify launches, the TAIL attention by absolute position), so a tail
packed with other prompts' tails gets the bits it gets alone.

``tail_count`` is the rule (pure; tests/fixtures/path_bits.py dispatches with it too),
``run_tails`` runs the tails of a step's items after their prefill parts, ``tail_captures``
captures the CUDA graphs of every tail pass length one at a time (engine.runner_steps
``warm_up``: when the runner is built, or by the engine thread after the server is ready, between
requests), so no warm request pays for a capture; one that comes first captures its graph itself.

Reaches the driver only through the runner's methods; must not import CUDA or engine.runner_cuda.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from engine.ir import TAIL, TAIL_SEQS
from engine.spec.cuda_verify import has_verify_short, narrow_rows, short_is_safe
from engine.types import SamplingParams, StepItem

_GREEDY = SamplingParams(temperature=0.0)
KINDS = ("greedy", "sample")  # the sampling kinds whose tail graphs are captured ahead


def whole_block_tails(r: Any) -> bool:
    """Whether the runner's prompt tails are whole trailing partial blocks (``tail_count``): a
    hybrid's (recurrent state slots) and with a sliding-window pool; else its last position only."""
    return bool(getattr(r, "num_state_slots", 0) or getattr(r, "window_kv_blocks", 0))


def tail_count(it: StepItem, block_size: int, whole_block: bool) -> int:
    """How many of a prefill item's last tokens are its prompt's tail, run as decode rows (the
    module docstring): where the prompt does not end on a block boundary, its last position
    (``whole_block`` false: a dense plan's rule) or its trailing partial block, positions from the
    last block boundary below ``prompt_len`` to it (``whole_block``: a hybrid's, a window pool's).
    0 for a decode row, a draft, an item reaching past its prompt (a preempted sequence's
    recompute), an item that ends before its tail, a prompt that ends on a block boundary, and an
    item that does not say where its prompt ends (``prompt_len`` 0: a direct runner call such as
    the MTP head's, engine.spec.mtp_cuda, which feeds its pass rows values of its own, or a
    tool's; it runs as prefill, its head on row 0)."""
    n = len(it.token_ids)
    end = it.start_pos + n
    prompt = it.prompt_len
    if it.draft or n == 0 or end > prompt:
        return 0
    boundary = prompt - prompt % block_size
    if boundary == prompt or end <= boundary:
        return 0
    if not whole_block:
        return 1 if end == prompt else 0
    return end - max(boundary, it.start_pos)


def split_item(it: StepItem, tail: int) -> StepItem:
    """The prefill part of an item whose last ``tail`` tokens run as decode rows: the tokens before
    them, sampling nothing, with the state snapshots that fall inside it."""
    keep = len(it.token_ids) - tail
    return replace(
        it,
        token_ids=it.token_ids[:keep],
        sample=False,
        allowed=None,
        state_snapshots=tuple((n, s) for n, s in it.state_snapshots if n <= keep),
    )


def _rows(it: StepItem, tail: int) -> tuple[list[StepItem], list[int]]:
    """Decode rows of the item's last ``tail`` tokens (the last row carries the item's sampling)
    and each row's state snapshot slot (-1: none; a hybrid's, from the item's snapshots)."""
    n = len(it.token_ids)
    first = n - tail
    snaps = dict(it.state_snapshots)
    rows, snap = [], []
    for j in range(first, n):
        last = j == n - 1
        row = StepItem(
            it.seq_id,
            [it.token_ids[j]],
            it.start_pos + j,
            it.block_table,
            it.sample and last,
            it.sampling if last else _GREEDY,
            history=it.history if last else (),
            prompt_len=it.prompt_len,
            prompt_memo=it.prompt_memo if last else None,
            num_generated=it.num_generated if last else 0,
            allowed=it.allowed if last else None,
            state_slot=it.state_slot,
            state_restore=it.state_restore if j == 0 else None,  # (else the prefill part restored it)
            window_table=it.window_table,
        )
        rows.append(row)
        snap.append(snaps.get(j + 1, -1))
    return rows, snap


def has_tail_attention(plan: Any) -> bool:
    """Whether the plan's attention steps have TAIL launches (a dense plan with the prefill key
    split: engine.lowering.attention.tail_attention)."""
    return any(TAIL in st.launches for st in plan.steps)


def _limit(r: Any, short: bool = True) -> int:
    """The most rows of a tail pass: ``narrow_rows``; past short_context with the TAIL attention,
    at most its launches' ``max_rows`` (the key split's partials scratch: split_rows rows)."""
    limit = min(narrow_rows(r.plan, r._max_rows), r._max_rows)
    if short or not r._tail_attention:
        return limit
    bounds = [la.max_rows for st in r.plan.steps for la in st.launches.get(TAIL, ()) if la.max_rows]
    return min([limit, *bounds])


def _uses_tail(r: Any, short: bool) -> bool:
    """Whether a tail pass of this context class runs the TAIL attention."""
    return not short and bool(r._tail_attention) and not r.num_state_slots


def _modes(r: Any) -> tuple[bool, bool]:
    """(short_ok, verify) of a tail pass: a dense plan's verify launches (cuda_verify's rule); a
    hybrid's plain decode launches, short context only where the plan's rope is not folded into
    the attention."""
    safe = short_is_safe(r.plan)
    if r.num_state_slots:
        return safe, False
    return safe or has_verify_short(r.plan), True


def _is_short(r: Any, it: StepItem, short_ok: bool) -> bool:
    return short_ok and it.start_pos + len(it.token_ids) - 1 < r.plan.short_context


def run_tails(r: Any, tails: Sequence[tuple[StepItem, int]]) -> list[int | None]:
    """Run each item's last ``tail`` tokens (its prefill part already ran) as decode rows; returns
    each item's sampled id (None where it samples nothing). A dense plan packs the tails of one
    context class (all rows below short_context or not, as the item alone would run) into passes
    of at most ``_pack_rows`` rows; a tail longer than ``_limit``, and a hybrid's every tail, runs
    alone, in consecutive passes of that many rows. A dense plan's passes past short_context (at
    most TAIL_SEQS tails each) run the TAIL attention (``tail``: rows of one sequence through the
    key split, whichever tails share the pass: a tail packed with others gets the bits it gets
    alone)."""
    out: list[int | None] = [None] * len(tails)
    short_ok, verify = _modes(r)
    hybrid = bool(r.num_state_slots)
    pending: dict[bool, list[tuple[int, list[StepItem]]]] = {True: [], False: []}
    for i, (it, tail) in enumerate(tails):
        rows, snaps = _rows(it, tail)
        short = _is_short(r, it, short_ok)
        limit = _limit(r, short)
        if hybrid or len(rows) > limit:
            for lo in range(0, len(rows), limit):
                part = rows[lo : lo + limit]
                groups = (1,) * len(part) if hybrid else ()
                ids = r._decode(
                    part,
                    short_ok=short_ok,
                    state_snap=snaps[lo : lo + limit] if hybrid else None,
                    groups=groups,
                    exact=True,
                    verify=verify,
                    tail=not hybrid,
                )
            _done(out, i, it, rows[-1], ids[-1])
            continue
        batch = pending[short]
        full = _uses_tail(r, short) and len(batch) == TAIL_SEQS  # (the TAIL launch's sequences)
        if batch and (full or sum(len(rs) for _, rs in batch) + len(rows) > _pack_rows(r, short)):
            _run_batch(r, batch, out, tails, short_ok, verify)
            batch.clear()
        batch.append((i, rows))
    for batch in pending.values():
        if batch:
            _run_batch(r, batch, out, tails, short_ok, verify)
    return out


def _run_batch(r: Any, batch: list[tuple[int, list[StepItem]]], out: list[int | None],
               tails: Sequence[tuple[StepItem, int]], short_ok: bool, verify: bool) -> None:
    rows = [row for _, rs in batch for row in rs]
    ids = r._decode(rows, short_ok=short_ok, exact=True, verify=verify, tail=True)
    at = 0
    for i, rs in batch:
        at += len(rs)
        _done(out, i, tails[i][0], rs[-1], ids[at - 1])


def _done(out: list[int | None], i: int, it: StepItem, last: StepItem, tok: int) -> None:
    if it.sample:
        out[i] = tok
        it.logprobs_out = last.logprobs_out  # (the runner stored the row's logprobs in the row)


def graph_key(r: Any, rows: int, kind: str, short: bool) -> tuple:
    """The runner's ``_graphs`` key of a tail pass of ``rows`` rows (CudaRunner._graph's, io on)."""
    hybrid = bool(r.num_state_slots)
    return (rows, kind, short, True, *(((1,) * rows,) if hybrid else ()), *(() if hybrid else ("verify",)),
            *(("tail",) if _uses_tail(r, short) else ()))  # fmt: skip


def pass_is_short(r: Any, it: StepItem) -> bool:
    """Whether the tail of ``it`` runs the short-context launches."""
    return _is_short(r, it, _modes(r)[0])


def tail_rows(r: Any, short: bool) -> int:
    """The row counts 1 .. this of the tail passes of a context class whose graphs are captured
    ahead (``tail_captures``): ``_limit``, and at most block_size - 1 (a whole trailing partial
    block's rows; where a tail is the prompt's last position only, the one-row tails a pass packs,
    so start-up captures no more graphs than the whole-block rule did), with the TAIL attention at
    most TAIL_SEQS (its sequences, one a one-row tail)."""
    rows = min(r.block_size - 1, _limit(r, short))
    if not whole_block_tails(r) and _uses_tail(r, short):
        rows = min(rows, TAIL_SEQS)
    return rows


def _pack_rows(r: Any, short: bool) -> int:
    """The most rows ``run_tails`` packs into one pass of a context class: ``tail_rows`` for one-row
    tails (every pass a captured graph), ``_limit`` for whole trailing partial blocks (as many
    tails as fit)."""
    return _limit(r, short) if whole_block_tails(r) else tail_rows(r, short)


def tail_captures(r: Any) -> Iterator[int]:
    """Capture the decode graphs every tail pass replays (``tail_rows``: each row count from 1,
    past short_context with the TAIL attention where the plan has it), one per ``next`` (yields 1
    after each): each row count, greedy and sample, short and long context where the plan and
    ``max_model_len`` have both, with their pinned-input copies (the ``io`` graphs a plain step
    replays). The warm run before each capture writes only the sinks (padding rows; a hybrid's
    states parked), and each capture is whole in one ``next``, so steps may run between two
    (engine.loop's background warm-up). A key a request captured meanwhile (``CudaRunner._graph``
    captures on first use) is skipped. A hybrid's are kept for good (``_tail_keys``, set by this
    call: never dropped with the verify groupings). Nothing without graphs."""
    if not r.use_graphs:
        return iter(())
    short_ok, verify = _modes(r)
    hybrid = bool(r.num_state_slots)
    classes = [s for s in (True, False) if (s and short_ok) or (not s and r.max_model_len > r.plan.short_context)]
    if not short_ok:
        classes = [False]
    todo = [
        (rows, kind, short, graph_key(r, rows, kind, short))
        for short in classes
        for rows in range(1, tail_rows(r, short) + 1)
        for kind in KINDS
    ]
    if hybrid:  # (now, before any request runs: kept out of the verify groupings' LRU, _keep_grouping)
        r._tail_keys = r._tail_keys | {key for *_, key in todo}
    return _capture(r, todo, hybrid, verify)


def _capture(r: Any, todo: list[tuple[int, str, bool, tuple]], hybrid: bool, verify: bool) -> Iterator[int]:
    for rows, kind, short, key in todo:
        if key in r._graphs:
            continue
        r._fill_decode([], None, (), rows)  # every row a padding row (the sink block)
        tail = _uses_tail(r, short)
        if tail:  # (the padding rows one sequence of their own)
            r._fill_seq_starts([], rows)
        r._graph(rows, kind, short, io=True, groups=(1,) * rows if hybrid else (), verify=verify, tail=tail)
        yield 1
