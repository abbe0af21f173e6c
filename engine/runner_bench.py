"""Measure a Runner: decode tok/s (batch x context depth) and prefill tok/s, each against the roofline.

Rows are dicts (decode, prefill, the measured copy bandwidth, the KV cost per layer group); times
are wall-clock around whole ``runner.step`` calls, median of repeats after warm-up. What each
fraction counts (weight and KV bytes read, a MoE model's routed experts, 2 * params * tokens FLOPs)
and how a window pool is stepped: docs/cuda-runtime.md ("tools/bench_runner.py"). `memra bench`
(engine/bench.py) and tools/bench_runner.py call these.

Must not import CUDA itself (the runner does).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from engine.kv_groups import min_window_blocks
from engine.types import SamplingParams, StepItem
from engine.weight_memory import active_expert_fraction

GREEDY = SamplingParams(temperature=0.0)
log = logging.getLogger("memra.bench")


def expert_weight_keys(plan: Any) -> set[str]:
    """The plan weights of the moe_experts steps' stacked expert matrices (their first three
    weights: a seven-weight step's shared expert is dense, read whole every step; and a launch
    may run in a later step: engine.lowering.moe.shared_into_down)."""
    keys = {w.key for w in getattr(plan, "weights", ())}
    return {
        f"L{st.layer}.{name}"
        for st in getattr(plan, "steps", ())
        if st.op.op == "moe_experts"
        for name in st.op.weights[:3]
        if f"L{st.layer}.{name}" in keys
    }


def layer_matrix_params(plan: Any) -> int:
    """Elements of the per-layer matrices one token multiplies by (the 2*params*tokens FLOP count;
    the lm_head runs on one row per prefill, so it is left out): a MoE token uses ``experts_used``
    of the ``experts`` stacked experts."""
    experts = expert_weight_keys(plan)
    total = 0
    for w in plan.weights:
        if w.rows > 1 and (w.layer is not None):
            n = w.rows * w.cols
            total += n * int(plan.dims["experts_used"]) // int(plan.dims["experts"]) if w.key in experts else n
    return total


def streamed_weight_bytes(plan: Any, batch: int = 1) -> int:
    """Bytes one decode step of ``batch`` rows must read: every weight once (the embedding table
    only when it is also the lm_head: an untied table is gathered a row per token), and of a MoE
    model's stacked experts the share its rows route to (weight_memory.active_expert_fraction:
    exactly top_k / E at batch 1, the expected distinct share under uniform routing above)."""
    tied = bool(plan.dims.get("tie_embeddings"))
    experts = expert_weight_keys(plan)
    share = active_expert_fraction(plan.dims, batch) if experts else 1.0
    total = 0
    for w in plan.weights:
        if w.key == "embed" and not tied:
            total += w.cols * 2  # about one row per token
            continue
        total += int(w.nbytes * share) if w.key in experts else w.nbytes
    return total


def kv_bytes_read(plan: Any, batch: int, depth: int) -> int:
    """KV bytes one decode step reads (the attention layers only: a hybrid's linear-attention layers
    keep none; a sliding-window layer, its attention launches' ``window``, at most window keys), plus
    a hybrid's recurrent state, read and written once per row (f32)."""
    d = plan.dims
    keys = 0
    for st in getattr(plan, "steps", ()):
        if st.op.op == "attention":
            launches = st.launches.get("decode", ())
            window = int(launches[0].spec.params.get("window", 0)) if launches else 0
            keys += min(depth + 1, window) if window else depth + 1
    states = sum(sp.slot_bytes for sp in getattr(plan, "states", ()))
    return batch * (keys * 2 * d["kv_dim"] * 2 + 2 * states)


def _slot(runner: Any, b: int) -> int | None:
    """Row b's recurrent-state slot on a hybrid runner (None otherwise)."""
    return b if getattr(runner, "num_state_slots", 0) else None


def _tables(runner: Any, batch: int, length: int, span: int = 1) -> tuple[list[list[int]], list[list[int]] | None] | None:
    """Each row's block table and, on a runner with a window pool, its ``window_table`` (else None);
    None when the rows need more KV blocks, full or window pool, than the runner has. Window block
    ``j`` of row ``b`` is the pool's block ``b * per + j % per``, ``per`` the blocks one step of at
    most ``span`` positions can see, so the blocks behind the window are reused, as the engine's
    window group releases and retakes them (engine.kv_groups)."""
    bs = runner.block_size
    blocks = -(-length // bs)
    if blocks * batch > runner.num_blocks:
        return None
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    if not getattr(runner, "window_kv_blocks", 0):
        return tables, None
    per = min(blocks, min_window_blocks(int(runner.kv_window), span, bs))
    if per * batch > runner.window_kv_blocks:
        return None
    return tables, [[b * per + j % per for j in range(blocks)] for b in range(batch)]


def _tables_or_exit(runner: Any, batch: int, length: int, span: int = 1) -> tuple[list[list[int]], list[list[int]] | None]:
    got = _tables(runner, batch, length, span)
    if got is None:
        raise SystemExit(f"benchmark of {batch} x {length} positions needs more KV blocks than the runner has")
    return got


def graph_buckets(runner: Any) -> tuple[int, ...]:
    """Every decode batch size the runner captures a CUDA graph for (the scheduler's buckets:
    a step of n rows runs the smallest one >= n), or (1, 8, 32) for a runner without graphs."""
    sizes = getattr(getattr(runner, "plan", None), "graph_batch_sizes", None)
    return tuple(sorted(sizes)) if sizes else (1, 8, 32)


def measure_copy(runner: Any) -> dict | None:
    """The runner's measured device-to-device copy bandwidth as a bench row (None where the runner
    has no device to measure: the reference backend)."""
    measure = getattr(runner, "copy_bandwidth_gbs", None)
    if measure is None:
        return None
    try:
        gbs = float(measure())
    except RuntimeError as exc:  # (engine.cuda.CudaError: no room for the two buffers, say)
        log.warning("no copy-bandwidth row: %s", exc)
        return None
    profile_gbs = runner.profile.memory_bandwidth_gbs
    return {"kind": "copy", "gbs": round(gbs, 1), "profile_gbs": profile_gbs, "ratio": round(gbs / profile_gbs, 3)}


def bench_decode(
    runner: Any, batch: int, depth: int, steps: int = 64, repeats: int = 3, copy_gbs: float | None = None
) -> dict:
    tables, windows = _tables_or_exit(runner, batch, depth + steps + 1)

    def items(pos: int) -> list[StepItem]:
        return [
            StepItem(
                seq_id=b,
                token_ids=[(7 * b + pos) % 100 + 1],
                start_pos=pos,
                block_table=tables[b],
                sample=True,
                sampling=GREEDY,
                state_slot=_slot(runner, b),
                window_table=windows[b] if windows else None,
            )
            for b in range(batch)
        ]

    start = max(depth, 1)
    for i in range(3):  # warm-up: graph capture for this bucket
        runner.step(items(start + i))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            runner.step(items(start + i))
        times.append((time.perf_counter() - t0) / steps)
    t = statistics.median(times)
    plan = runner.plan
    nbytes = streamed_weight_bytes(plan, batch) + kv_bytes_read(plan, batch, depth)
    bw = runner.profile.memory_bandwidth_gbs * 1e9
    row = {
        "kind": "decode",
        "batch": batch,
        "depth": depth,
        "step_ms": t * 1e3,
        "tok_s": batch / t,
        "bytes_per_step": nbytes,
        **({"active_expert_fraction": active_expert_fraction(plan.dims, batch)} if expert_weight_keys(plan) else {}),
        "achieved_gbs": nbytes / t / 1e9,
        "roofline_fraction": nbytes / t / bw,
    }
    if copy_gbs:
        row["copy_roofline_fraction"] = nbytes / t / (copy_gbs * 1e9)
    return row


def bench_prefill(runner: Any, tokens: int, repeats: int = 3) -> dict:
    (table,), windows = _tables_or_exit(runner, 1, tokens, _prefill_span(runner, tokens))
    ids = [(i * 31) % min(1000, runner.plan.dims["vocab"] - 1) + 1 for i in range(tokens)]  # (any vocab over 1000: unchanged)
    item = StepItem(seq_id=0, token_ids=ids, start_pos=0, block_table=table, sample=True, sampling=GREEDY,
                    state_slot=_slot(runner, 0), window_table=windows[0] if windows else None)
    runner.step([item])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.step([item])
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    flops = 2 * layer_matrix_params(runner.plan) * tokens
    peak = runner.profile.tensor_tflops_bf16 * 1e12
    return {
        "kind": "prefill",
        "tokens": tokens,
        "ms": t * 1e3,
        "tok_s": tokens / t,
        "tflops": flops / t / 1e12,
        "roofline_fraction": flops / t / peak,
    }


def _prefill_span(runner: Any, tokens: int) -> int:
    """The most positions one prefill pass of the runner writes (it splits a step's prompt into passes
    of ``prefill_chunk_tokens``)."""
    return min(tokens, int(getattr(getattr(runner, "profile", None), "prefill_chunk_tokens", tokens)))


def kv_row(runner: Any) -> dict | None:
    """The KV bytes a sequence costs in each layer group of a CUDA runner (K and V in bf16): the
    full-attention layers' per token; the sliding-window layers' per token and, with a window pool
    (their blocks released behind the window, engine.kv_groups), at most ``ceil(window / block) + 1``
    blocks a decoding sequence whatever its length. Without a window pool the window layers sit in
    the full pool and cost as much a token as the others. None for a runner without KV groups."""
    full = getattr(runner, "kv_full_layers", None)
    if full is None:
        return None
    d, bs = runner.plan.dims, runner.block_size
    token = 2 * 2 * int(d["kv_heads"]) * int(d["head_dim"])  # one layer's K and V of one position
    row: dict[str, Any] = {
        "kind": "kv",
        "block_size": bs,
        "full_layers": len(full),
        "full_blocks": runner.num_blocks,
        "full_bytes_per_token": token * len(full),
    }
    win = runner.kv_window_layers
    if win:
        most = -(-int(runner.kv_window) // bs) + 1
        row.update(
            window=int(runner.kv_window),
            window_layers=len(win),
            window_blocks=runner.window_kv_blocks,
            window_bytes_per_token=token * len(win),
            window_seq_blocks_max=most,
            window_bytes_per_seq_max=most * bs * token * len(win),
        )
    return row


def run_all(
    runner: Any,
    batches=None,
    depths=(0, 4096),
    prefills=(512, 4096),
    steps: int = 64,
    copy: bool = True,
    kv: bool = True,
) -> list[dict]:
    """The copy row first (where the runner measures one and ``copy``), the KV row (``kv_row``,
    where ``kv``), then decode per depth and batch (default: every graph bucket; a row whose KV does
    not fit, full or window pool, is skipped with a warning), then prefill per length."""
    batches = graph_buckets(runner) if batches is None else batches
    rows = []
    copy_row = measure_copy(runner) if copy else None
    if copy_row:
        rows.append(copy_row)
    if kv and (kv_info := kv_row(runner)):
        rows.append(kv_info)
    for depth in depths:
        for batch in batches:
            if depth + steps + 2 > runner.max_model_len:
                continue
            if _tables(runner, batch, depth + steps + 1) is None:
                log.warning("decode batch %d depth %d: more KV blocks than the runner has; skipped", batch, depth)
                continue
            rows.append(bench_decode(runner, batch, depth, steps, copy_gbs=copy_row and copy_row["gbs"]))
    for p in prefills:
        if p > runner.max_model_len:
            continue
        if _tables(runner, 1, p, _prefill_span(runner, p)) is None:
            log.warning("prefill %d: more KV blocks than the runner has; skipped", p)
            continue
        rows.append(bench_prefill(runner, p))
    return rows

