"""The CUDA runner's ahead-of-time work: the passes a prefix-cache hit runs bound and their CUDA
graphs captured (and a speculative decoder's verify graphs), either when the runner is built or
after the server is ready, by the engine thread between requests (issue #34: warm HTTP-ready).

The work is a list of units, each whole in itself (its inputs written, its warm run, its capture),
so a step may run between any two: ``warm_units`` (the warm-prefix passes, engine.runner_tail's
tail graphs) and ``engine.spec.cuda_verify.verify_captures``. ``run_now`` runs them at build
(``CudaRunner(defer_warm_up=False)``, what the bench and tools get); with ``defer_warm_up=True``
the runner keeps them and ``background`` hands the engine loop an iterator that runs one unit per
``next`` (engine.loop: only while no request is scheduled, so a request that arrives waits for at
most one unit). A request that needs a pass before its unit ran binds or captures it itself
(``CudaRunner._graph`` captures on first use; a one-sequence prefill of block_size tokens without
its graph runs the same bound launches eagerly), which is the same launches with the same
arguments, so its output bits are the same; the unit then finds it done and skips it (nothing is
captured twice). Reaches the driver only through the runner's methods; must not import CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from engine.runner_tail import tail_captures

log = logging.getLogger("memra.runner_cuda")

#: a unit's yield: the CUDA graphs it captured (0: a bind only)
Units = Iterator[int]


def warm_units(r: Any) -> Units:
    """The passes a prefix-cache hit runs, one unit each. A hit leaves at most a block's tokens
    and at least one: the prompt's tail runs as decode rows (engine.runner_tail: its last position,
    or a hybrid's trailing partial block; their graphs, ``tail_captures``) after a one-sequence
    prefill pass of the tokens before it that the hit did not copy (a partial-block copy,
    engine.partial_blocks, leaves none), or, for a prompt ending on a boundary, its last block, a
    prefill pass of block_size tokens (bound, and captured into a CUDA graph with graphs on:
    ``capture_prefill_tail``). Those prefill passes of 1 .. block_size tokens of one sequence are
    bound, and the batch-1 head. A shape a request bound first is kept as it is.
    A hybrid's tail graph keys are registered by this call (``tail_captures``), before any request runs."""
    return _units(r, tail_captures(r))


def _units(r: Any, tails: Units) -> Units:
    for n in range(1, r.block_size + 1):
        key = ("prefill", n, 1, n)
        bound = r._prefill_bound.get(key)
        if bound is None:
            bound = r._prefill_bound[key] = r._bind_pass("prefill", n, 1, False, "", max_q=n)
        captured = 0
        if r.use_graphs and n == r.block_size and ("tail", n) not in r._graphs:
            capture_prefill_tail(r, n, bound)
            captured = 1
        yield captured
    for kind in ("greedy", "sample"):
        r._head_bound(1, kind)
    yield 0
    yield from tails


def capture_prefill_tail(r: Any, n: int, bound: list[Any]) -> None:
    """Capture the layers of a one-sequence prefill pass of ``n`` tokens (the same launches as
    the eager pass, so its results are bit-identical): first one warm run outside the capture
    (lazy module loading) whose inputs write only the sinks (KV into the sink block, state
    from zeros into the sink slot), then the capture. The pass reads its tokens, positions,
    slots, block table and state slots from the packed inputs, uploaded before each launch."""
    v, bs = r._views, r.block_size
    v["tokens"][:n] = 0
    v["positions"][:n] = np.arange(n)
    v["slots"][:n] = r._sink_block * bs + np.arange(n) % bs
    v["seq_starts"][:2] = (0, n)
    r._tables[: r._table_ld] = r._sink_block
    r._table_len[0] = 0
    for row in range(n):
        r._pad_window(row)
    with r._states_parked(bs, ""):  # (every row a tail can have)
        r._upload_inputs(1)
        r._run(bound)
    r._graphs[("tail", n)] = (r._captured(bound), bound)  # the bound args outlive the graph


def run_now(r: Any) -> None:
    """Run the warm-prefix units at once (the runner's build), with their log line."""
    t0 = time.perf_counter()
    captured = sum(warm_units(r))
    if captured:
        r.stream.synchronize()
    log.info(
        "warm-prefix passes bound%s in %.3f s (%d graphs)",
        " and captured" if r.use_graphs else "", time.perf_counter() - t0, captured,
    )  # fmt: skip


def background(r: Any, work: list[Callable[[], Units]]) -> Iterator[int]:
    """One unit of ``work`` (each entry makes its units) per ``next``, in the calling thread (the
    engine's: the runner's context made current first); yields the graphs the unit captured. Logs
    the time it took once all ran: from the first unit to the last, and the engine time the units
    themselves took (the rest was requests and idle waits between them)."""
    t0, busy, graphs, units = time.perf_counter(), 0.0, 0, 0
    for make in work:
        it = None
        while True:
            u0 = time.perf_counter()
            r._ensure_context()
            it = it or make()
            try:
                done = next(it)
            except StopIteration:
                busy += time.perf_counter() - u0
                break
            busy += time.perf_counter() - u0
            graphs += done
            units += 1
            yield done
    if graphs:
        r.stream.synchronize()
    log.info(
        "background warm-up done: %d units, %d graphs captured, %.3f s of engine time, %.3f s from the first "
        "unit to the last (after ready; requests ran between units)",
        units, graphs, busy, time.perf_counter() - t0,
    )  # fmt: skip
