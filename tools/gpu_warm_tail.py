"""Where a warm-prefix request's GPU time goes: the tail a prefix-cache hit leaves to run (``--tail``
tokens of one sequence after ``--depths`` cached tokens), on the GPU machine.

    PYTHONPATH=. python tools/gpu_warm_tail.py MODEL [--depths 1024,4096,16384] [--tail 7] [--json F]
    ... --depths 1040,4000,15920 --tail 7,4,9 --max-model-len 0 --idle-ms 5   (tools/warm_prefix.py's
        160 / 640 / 2540-word prompts on the GGUFs' byte-level vocabulary, in a runner sized as `memra
        serve`'s; each step also timed after 5 ms of GPU idle, about what a warm send finds)

For each depth: ``runner.step`` of the tail item end to end (host prep + upload + pass + the
sampled id read back): as the engine runs it (the prompt's tail as decode rows, engine.runner_tail:
its last token, a hybrid's trailing partial block, from its captured graph, and eagerly; a dense
model's tokens before it a prefill pass) and as a prefill pass of all the tokens (the path before;
its layers eager, the head after them); the GPU time of that prefill pass's layers and of the
decode rows' graph (replay, events), each per kernel template (each template's
launches captured alone and replayed), so a template whose cost grows with the depth shows; the
decode rows' eager launch loop's host time. Past short_context a dense plan's tail pass runs its
attention as the key split's partials (engine.ir.TAIL); the same rows' pass with the split decode
attention (what the tail rows ran before it: a verify pass's graph of as many rows) is timed beside
it (``rows_decode_attention_*``), on the same machine and KV.
The KV and recurrent state are whatever the cache holds (timing only: the tail's tokens, positions,
block table and state slots are real). Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import cuda  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.runner_cuda import CudaRunner  # noqa: E402
from engine.runner_tail import graph_key, pass_is_short, tail_count, whole_block_tails  # noqa: E402
from engine.types import SamplingParams, StepItem  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def gpu_ms(stream, fn, reps: int = 10) -> float:
    """Milliseconds per call of ``fn`` (which queues work on ``stream``), after one warm call."""
    fn()
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    ms = e1.elapsed_ms(e0) / reps
    e0.destroy()
    e1.destroy()
    return ms


def wall_ms(fn, reps: int = 7, idle_s: float = 0.0) -> float:
    """Median wall milliseconds of ``fn``; ``idle_s``: each call after that long with the GPU idle."""
    out = []
    for _ in range(reps):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def per_template(runner, bound) -> dict[str, float]:
    """GPU ms of the pass's launches grouped by kernel template (each group captured and replayed)."""
    groups = defaultdict(list)
    for b in bound:
        groups[b.fn.name.split("__")[0]].append(b)
    out = {}
    for name, bs in groups.items():
        runner.stream.synchronize()
        with cuda.capture(runner.stream) as graph:
            for b in bs:
                (b.solo or b.run)(b.args)
        out[name] = round(gpu_ms(runner.stream, lambda g=graph: g.launch(runner.stream)), 3)
        graph.destroy()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def measure(runner, depth: int, tail: int, idle_ms: float = 0.0) -> dict:
    bs = runner.block_size
    table = list(range(-(-(depth + tail) // bs)))
    state = dict(state_slot=0, state_restore=1) if runner.num_state_slots else {}
    toks = list(range(3, 3 + tail))
    kw = dict(history=[3] * (depth + tail), **state)
    item = StepItem(0, toks, depth, table, True, GREEDY, prompt_len=depth + tail, **kw)  # a warm hit's tail
    pre = StepItem(0, toks, depth, table, True, GREEDY, **kw)  # (no prompt_len: the same tokens as a prefill)
    n = tail_count(item, bs, whole_block_tails(runner))
    row = {"depth": depth, "tail": tail, "decode_rows": n}
    runner.use_graphs = True
    row["step_graph_ms"] = round(wall_ms(lambda: runner.step([item])), 3)
    if idle_ms:  # as a warm request finds it: the GPU idle since the last send (clocks, caches)
        row["step_graph_after_idle_ms"] = round(wall_ms(lambda: runner.step([item]), idle_s=idle_ms / 1e3), 3)
    row["step_prefill_ms"] = round(wall_ms(lambda: runner.step([pre])), 3)  # the path before engine.runner_tail
    runner.use_graphs = False
    row["step_eager_ms"] = round(wall_ms(lambda: runner.step([item])), 3)
    runner.use_graphs = True
    # the prefill pass's layers (its inputs uploaded by a step of it)
    runner.step([pre])
    bound = runner._prefill_pass_bound(tail, 1, tail)
    runner.stream.synchronize()
    row["prefill_launches"] = len(bound)
    row["prefill_layers_gpu_ms"] = round(gpu_ms(runner.stream, lambda: runner._run(bound)), 3)
    row["prefill_per_template_gpu_ms"] = per_template(runner, bound)
    # the decode rows' pass: its captured graph (inputs in, sampled id out) and its launches
    runner.step([item])
    short = pass_is_short(runner, item)
    key = graph_key(runner, n, "greedy", short)
    graph = runner._graphs.get(key)
    if graph is None:
        return row
    row["rows_attention"] = "tail" if "tail" in key else "decode"
    runner.stream.synchronize()
    row["rows_graph_gpu_ms"] = round(gpu_ms(runner.stream, lambda: graph[0].launch(runner.stream)), 3)
    rows = graph[1]
    t0 = time.perf_counter()
    runner._run(rows)
    row["rows_eager_launch_host_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
    row["rows_launches"] = len(rows)
    runner.stream.synchronize()
    row["rows_per_template_gpu_ms"] = per_template(runner, rows)
    if "tail" in key:  # the same rows through the split decode attention (the pass before TAIL)
        runner.step([item])  # (its inputs in the pinned block again)
        old = runner._graph(n, "greedy", False, io=True, verify=True)
        runner.stream.synchronize()
        row["rows_decode_attention_graph_gpu_ms"] = round(gpu_ms(runner.stream, lambda: old.launch(runner.stream)), 3)
        bound = runner._graphs[(n, "greedy", False, True, "verify")][1]
        row["rows_decode_attention_per_template_gpu_ms"] = per_template(runner, bound)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--depths", default="1024,4096,16384")
    ap.add_argument("--tail", default="7", help="tail tokens: one for every depth, or one per depth (7,4,9)")
    ap.add_argument("--max-model-len", type=int, default=-1,
                    help="the runner's context (-1: the deepest depth + 1024; 0: the model's own, as memra serve)")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="also time the tail's step after this long idle (step_graph_after_idle_ms)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    model = load_model(args.model)
    t0 = time.perf_counter()
    tails = [int(t) for t in args.tail.split(",")]
    if len(tails) not in (1, len(depths)):
        raise SystemExit("gpu_warm_tail: --tail gives one count or one per depth")
    tails = tails * len(depths) if len(tails) == 1 else tails
    mml = max(depths) + 1024 if args.max_model_len < 0 else (args.max_model_len or None)
    runner = CudaRunner(model, max_model_len=mml, state_slots=4)  # (a dense model has none)
    print(f"runner built in {time.perf_counter() - t0:.2f} s ({runner.ctx.info.name})", flush=True)
    rows = []
    for d, tail in zip(depths, tails, strict=True):
        row = measure(runner, d, tail, args.idle_ms)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
