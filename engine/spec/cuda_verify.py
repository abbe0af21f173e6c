"""Draft verification on the CUDA runner: the k+1 positions of each draft row scored in one step.

Each verify position becomes its own decode row: row j of a draft item runs token ``token_ids[j]``
at position ``start_pos + j`` over the item's block table. All rows of a step go through the
runner's decode path at once (``CudaRunner._decode(verify=True)``: one captured CUDA graph of the
pass's rows, with the pinned inputs copied in and the argmax ids copied out by the graph), through
the bucket decode kernels: its GEMVs and norms are plain decode's launches (the rmsnorm / silu_mul
launches, then the bucket GEMVs; folding the norms into a verify pass's bucket GEMVs measured slower
on an H100), its short-context attention the plan's verify launches (``VSHORT`` below). Passes
stay below the wide decode (``narrow_rows``), and the bucket kernels give a row the bits of the
batch-1 ones (tests/fixtures/batch_invariance.py checks), so a greedy row's argmax is that of the
plain decode step at its position. The KV of every row is written by the rope kernel before the
attention kernel reads it, so row j sees rows < j of its own sequence. Where the plan folds the rope into the
short-context attention kernel (``attention_decode.fuse_rope``), one kernel would both write and
read those slots, so verification then uses the plan's verify launches (``engine.ir.VSHORT``: the
rope-fused direct attention whose block for row j also rotates and writes the keys of its
sequence's rows < j in the pass, the same bytes their own blocks write, and reads only what it
wrote itself: kernels/attention.cu.j2 ``vfresh``), or the long-context launches where the plan has
none (a hybrid's verify pass).

A verify pass runs exactly its rows (``CudaRunner.verify_exact_rows``: a graph per row count, k + 1
rows for one draft), not the bucket's: padding rows would run every GEMV and attention kernel for
nothing.

Greedy rows without penalties are accepted from the argmax ids alone; other rows read the logits
back and go through ``engine.spec.accept`` on the host.

A hybrid model (recurrent layers: conv1d and the gated delta rule, with per-slot state) cannot run
one sequence's rows in parallel through its stateful kernels. Its verify pass lays the rows out by
draft position (every item's position 0, then every item's position 1, ...) and runs each stateful
launch once per position group, in order (``CudaRunner._decode(groups=...)``): group j reads the
live slot that group j-1 wrote (the item's own start state at j = 0), so every row sees exactly the
state plain decoding would have given it, through the same decode kernels. Every other launch runs
once over all rows, as in plain decode. Row (item, j) also stores its state after token j in a
scratch slot (``CudaRunner.spec_scratch``, past the sink; or in the item's own prefix-cache
snapshot slot where it asks for one after that token); after acceptance the slot of the last
accepted position is copied back into the live slot (device copies on the runner's stream), so
verify leaves each sequence's state at its last accepted token (``verify_restores_state``). A step
whose drafts need more scratch slots than there are is verified in several passes.

The runner's side is one delegating method, ``short_ok`` and (hybrids) ``state_snap`` / ``groups``
on ``_decode``, the scratch slots and ``_copy_slot`` (engine.runner_state). Reaches the driver only
through the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from engine.ir import VSHORT
from engine.spec.accept import accept, accept_greedy_ids
from engine.types import MemraError, SamplingParams, StepItem

_GREEDY = SamplingParams(temperature=0.0)


def short_is_safe(plan: Any) -> bool:
    """False where the plan's short-context decode folds the rope (and its KV write) into the
    attention kernel: rows of one sequence in one launch would race on each other's KV slots."""
    return not any(st.op.op == "rope" and "short" in st.launches and not st.launches["short"] for st in plan.steps)


def has_verify_short(plan: Any) -> bool:
    """Whether every rope step of the plan has verify launches (engine.ir.VSHORT: the rope folded
    into the direct attention, each block writing its sequence's earlier rows' keys itself before
    reading them) for a verify pass below short_context."""
    ropes = [st for st in plan.steps if st.op.op == "rope"]
    return bool(ropes) and all(VSHORT in st.launches for st in ropes)


def narrow_rows(plan: Any, max_rows: int) -> int:
    """The most rows a verify pass takes at once: the largest decode bucket below the wide decode
    (``plan.wide_rows``: linears as GEMMs, whose rows do not get a batch-1 step's bits), so
    several drafts verify in more passes rather than inexactly; ``max_rows``
    where the plan has no wide decode. A single draft longer than that still runs, alone."""
    wide = int(getattr(plan, "wide_rows", 0) or 0)
    below = [b for b in getattr(plan, "graph_batch_sizes", ()) if b < wide] if wide else []
    return max(below) if below else max_rows


def prepare(runner: Any, k: int, max_drafts: int = 8) -> int:
    """Capture ahead the verify graphs that drafts of up to ``k`` tokens may replay (CudaRunner
    .prepare_verify, from engine.spec.build): ``verify_captures`` run through. Returns the graphs
    captured."""
    done = sum(verify_captures(runner, k, max_drafts))
    if done:
        runner.stream.synchronize()
    return done


def verify_captures(runner: Any, k: int, max_drafts: int = 8) -> Iterator[int]:
    """The verify graphs that drafts of up to ``k`` tokens may replay, one capture per ``next``
    (yields 1 after each): every row count from 2 up to ``max_drafts`` drafts of k tokens (at most
    ``narrow_rows``), short and long context, so no round pays for a capture. The warm run before
    each capture writes only the sink block (padding rows); a graph a round captured first is
    skipped. Not for hybrids (their graphs are per row grouping) or without graphs."""
    if not runner.use_graphs or getattr(runner, "num_state_slots", 0):
        return
    most = min(narrow_rows(runner.plan, runner._max_rows), max_drafts * (k + 1))
    vshort = short_is_safe(runner.plan) or has_verify_short(runner.plan)
    for rows in range(2, most + 1):
        for short in (True, False) if vshort else (False,):
            if (rows, "greedy", short, True, "verify") in runner._graphs:  # (CudaRunner._graph's key)
                continue
            runner._fill_decode([], None, (), rows)  # every row a padding row (the sink block)
            runner._graph(rows, "greedy", short, io=True, verify=True)
            yield 1


def verify(runner: Any, items: Sequence[StepItem], during: Callable[[], None] | None = None) -> list[list[int]]:
    """CudaRunner.verify: plain items through ``runner.step``, draft items as decode rows;
    ``during`` runs once the first verify pass is queued, before the wait for it."""
    out: list[list[int]] = [[] for _ in items]
    plain = [i for i, it in enumerate(items) if not it.draft]
    drafts = [i for i, it in enumerate(items) if it.draft]
    for i in drafts:
        it, k = items[i], len(items[i].draft)
        if k >= len(it.token_ids) or list(it.token_ids[-k:]) != list(it.draft):
            raise MemraError(
                f"seq {it.seq_id}: the draft must be the last {k} of the item's tokens", code="internal_error"
            )
        if len(it.token_ids) > runner._max_rows:
            raise MemraError(
                f"seq {it.seq_id}: {len(it.token_ids)} verify rows exceed the largest decode bucket "
                f"{runner._max_rows}",
                code="internal_error",
            )
    if plain:
        for i, tok in zip(plain, runner.step([items[i] for i in plain]), strict=True):
            out[i] = [int(tok)] if items[i].sample else []
    safe = getattr(runner, "_verify_short_ok", None)
    if safe is None:
        safe = runner._verify_short_ok = short_is_safe(runner.plan)
        runner._verify_vshort = not safe and has_verify_short(runner.plan)
    hybrid = bool(getattr(runner, "num_state_slots", 0))
    scratch_slots = len(runner.spec_scratch()) if hybrid else 0
    run_group = _verify_group_hybrid if hybrid else _verify_group
    limit = narrow_rows(runner.plan, runner._max_rows)
    group: list[int] = []
    rows = scratch = 0
    for i in drafts + [-1]:
        n = len(items[i].token_ids) if i >= 0 else 0
        full = rows + n > limit or (hybrid and scratch + n - 1 > scratch_slots)
        if group and (i < 0 or full):
            for j, toks in zip(group, run_group(runner, [items[j] for j in group], safe, during), strict=True):
                out[j] = toks
            group, rows, scratch, during = [], 0, 0, None
        if i >= 0:
            if hybrid and n - 1 > scratch_slots:
                raise MemraError(
                    f"seq {items[i].seq_id}: a draft of {n - 1} tokens needs more than the {scratch_slots} "
                    "state scratch slots",
                    code="internal_error",
                )
            group.append(i)
            rows += n
            scratch += n - 1
    return out


def _verify_group(r: Any, items: list[StepItem], short_ok: bool, during: Callable[[], None] | None) -> list[list[int]]:
    rows: list[StepItem] = []
    spans = []
    for it in items:
        r._check_item(it)
        lo = len(rows)
        for j, tok in enumerate(it.token_ids):
            rows.append(
                StepItem(it.seq_id, [tok], it.start_pos + j, it.block_table, True, _GREEDY, window_table=it.window_table)
            )
        spans.append((lo + len(it.token_ids) - len(it.draft) - 1, len(rows)))
    vshort = not short_ok and r._verify_vshort  # (the rope kernel, then the unfused direct attention)
    ids = r._decode(rows, short_ok=short_ok or vshort, exact=r.verify_exact_rows, verify=True, during=during)
    host = any(not it.sampling.greedy or it.sampling.uses_penalties for it in items)
    logits = r.read_logits(len(rows)) if host else None
    out = []
    for it, (lo, hi) in zip(items, spans, strict=True):
        if logits is not None and (not it.sampling.greedy or it.sampling.uses_penalties):
            out.append(accept(logits[lo:hi], it))
        else:
            out.append(accept_greedy_ids(it.draft, ids[lo:hi]))
    return out


def _verify_group_hybrid(
    r: Any, items: list[StepItem], short_ok: bool, during: Callable[[], None] | None
) -> list[list[int]]:
    """A hybrid's draft items in one decode pass, rows grouped by draft position (module docstring),
    then each sequence's state put back to its last accepted position."""
    ks = [len(it.draft) for it in items]
    order = [(i, j) for j in range(max(ks) + 1) for i, k in enumerate(ks) if j <= k]
    groups = tuple(sum(1 for k in ks if k >= j) for j in range(max(ks) + 1))
    free = iter(r.spec_scratch())
    after: dict[tuple[int, int], int] = {}  # (item, j) -> the slot holding the state after its token j
    for i, it in enumerate(items):
        r._check_item(it)
        own = {n - 1: slot for n, slot in it.state_snapshots}
        r._check_slots(it, it.state_slot, it.state_restore, *own.values())
        for j in range(ks[i] + 1):
            if j in own:
                after[i, j] = own[j]
            elif j < ks[i]:  # (after the last token the state is in the live slot)
                after[i, j] = next(free)
    rows: list[StepItem] = []
    where: dict[tuple[int, int], int] = {}
    for i, j in order:
        it = items[i]
        where[i, j] = len(rows)
        rows.append(
            StepItem(
                it.seq_id,
                [it.token_ids[j]],
                it.start_pos + j,
                it.block_table,
                True,
                _GREEDY,
                state_slot=it.state_slot,
                state_restore=it.state_restore if j == 0 else None,
                window_table=it.window_table,
            )
        )
    snaps = [after.get(ij, -1) for ij in order]
    # (never the VSHORT launches: their attention finds a row's earlier draft rows right before it,
    # and these rows are laid out by draft position)
    ids = r._decode(rows, short_ok=short_ok, state_snap=snaps, groups=groups, during=during)
    host = any(not it.sampling.greedy or it.sampling.uses_penalties for it in items)
    logits = r.read_logits(len(rows)) if host else None
    out = []
    for i, it in enumerate(items):
        at = [where[i, j] for j in range(ks[i] + 1)]
        if logits is not None and (not it.sampling.greedy or it.sampling.uses_penalties):
            toks = accept(logits[at], it)
        else:
            toks = accept_greedy_ids(it.draft, [ids[x] for x in at])
        if len(toks) - 1 < ks[i]:  # a rejected draft token: back to the state after the last accepted one
            r._copy_slot(after[i, len(toks) - 1], it.state_slot)
        out.append(toks)
    return out
