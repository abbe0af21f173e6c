"""A decode step's timeline, block by block, on the GPU machine.

    PYTHONPATH=. python tools/gpu_trace_decode.py --model /dev/shm/q4b_q4_k_m.gguf --out $OUT \
        [--variant NAME='section.knob=value; ...'] [--without POST_PASS] [--batch 1] [--replays 3]

Builds every kernel with the block timeline trace (MEMRA_TRACE=1: kernels/_common.cuh.j2 records,
per block, its SM, start, pdl_wait return, a mark (the coop GEMV: x staged, or with wsm its tile
landed) and end, in %globaltimer ns), replays the batch-``--batch`` decode graph ``--replays`` times
back to back and splits the records into the pass's launches (by the entry's tag and, within one
entry, by pdl_wait order and grid size). For the last replay it writes, per launch (times in us
from the replay's first block start):

- ``start`` first / last block start (with programmatic dependent launch a block may start, and
  issue its weight loads, before the previous kernel ends);
- ``wait`` first / last pdl_wait return, ``mark`` median, ``end`` median / last block end;
- ``gap``: this launch's first pdl_wait return minus the last block end of the launch before it
  on the main stream (the dependency's cost), ``body``: its last end minus its first wait return.

and a summary per label (count, mean body / gap / span), the step's span, and the sum of the
gaps. ``--without NAME`` (repeatable) adds a variant planned without that lowering post-pass
(engine.lowering.registry.POST_PASSES: e.g. fold_delta_neighbours, shared_into_down), to measure
what a fusion is worth on the same machine. The trace adds a __syncthreads and a few timer reads per block, so its step is a little
slower than the untraced one (``--replays`` also prints both). Writes trace.txt and trace.json.
Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.render import trace_tag  # noqa: E402  (the tag each traced kernel's records carry)
from engine.runner_probes import TRACE_RECORDS  # noqa: E402  (the trace buffer's capacity)


def split_launches(recs: np.ndarray, launches: list[tuple[str, int]], replays: int) -> list[np.ndarray] | str:
    """The records of each launch of ``replays`` passes, in pass order: ``launches`` is the pass's
    (entry, blocks) sequence. Records of one entry are ordered by pdl_wait return (else start):
    launches of one entry never overlap, since each waits for the kernel before it."""
    tags = (recs[:, 0] & 0xFFFFFFFF).astype(np.int64)
    by_tag: dict[int, np.ndarray] = {}
    for tag in np.unique(tags):
        r = recs[tags == tag]
        key = np.where(r[:, 3] > 0, r[:, 3], r[:, 2])
        by_tag[int(tag)] = r[np.argsort(key, kind="stable")]
    taken: dict[int, int] = {}
    out = []
    for _ in range(replays):
        for entry, blocks in launches:
            tag = trace_tag(entry)
            r = by_tag.get(tag)
            i = taken.get(tag, 0)
            if r is None or i + blocks > len(r):
                have = 0 if r is None else len(r)
                return f"{entry}: {have} records, the pass needs more (at {i} + {blocks})"
            out.append(r[i : i + blocks])
            taken[tag] = i + blocks
    extra = {t: len(r) - taken.get(t, 0) for t, r in by_tag.items() if len(r) != taken.get(t, 0)}
    if extra:
        return f"records left over per tag: {extra}"
    return out


def launch_rows(parts: list[np.ndarray], labels: list[str], side: list[bool], t0: int) -> list[dict]:
    rows = []
    prev_end = None
    for r, label, on_side in zip(parts, labels, side, strict=True):
        us = lambda v: round((int(v) - t0) / 1e3, 2)  # noqa: E731
        start, wait, mark, end = r[:, 2], r[:, 3], r[:, 4], r[:, 5]
        waited = wait[wait > 0]
        marked = mark[mark > 0]
        row = {
            "label": label,
            "side": on_side,
            "blocks": len(r),
            "sms": len(np.unique(r[:, 0] >> 32)),
            "start": [us(start.min()), us(start.max())],
            "wait": [us(waited.min()), us(waited.max())] if len(waited) else None,
            "mark": us(np.median(marked)) if len(marked) else None,
            "end": [us(np.median(end)), us(end.max())],
        }
        first = int(waited.min()) if len(waited) else int(start.min())
        row["body"] = round((int(end.max()) - first) / 1e3, 2)
        row["gap"] = round((first - prev_end) / 1e3, 2) if prev_end is not None and not on_side else None
        if not on_side:
            prev_end = int(end.max())
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r["label"], {"label": r["label"], "count": 0, "body": 0.0, "gap": 0.0, "mark_after_wait": 0.0, "n_mark": 0})
        g["count"] += 1
        g["body"] += r["body"]
        g["gap"] += r["gap"] or 0.0
        if r["mark"] is not None and r["wait"] is not None:
            g["mark_after_wait"] += r["mark"] - r["wait"][0]
            g["n_mark"] += 1
    out = []
    for g in groups.values():
        n = g["count"]
        out.append(
            {
                "label": g["label"],
                "count": n,
                "body_us": round(g["body"] / n, 2),
                "gap_us": round(g["gap"] / n, 2),
                "mark_after_wait_us": round(g["mark_after_wait"] / g["n_mark"], 2) if g["n_mark"] else None,
                "total_us": round(g["body"] + g["gap"], 1),
            }
        )
    out.sort(key=lambda g: -g["total_us"])
    return out


def trace_variant(cuda, model, profile, batch: int, replays: int, save: Path | None = None) -> dict:
    from gpu_decode_profile import pass_labels, time_graph

    from engine import runner_bench
    from engine.runner_cuda import CudaRunner, _decode_mode

    runner = CudaRunner(model, profile, num_blocks=4096, max_model_len=8192)
    try:
        wall = runner_bench.bench_decode(runner, batch, 0, steps=16, repeats=1)
        bucket = next(b for b in runner.plan.graph_batch_sizes if b >= batch)
        graph, bound = runner._graphs[(bucket, "greedy", True, True)]
        labels = pass_labels(runner, _decode_mode(bucket, runner.plan.wide_rows), True, "greedy", rows=bucket)
        launches = [(lab.split(":", 1)[1], int(np.prod(b.grid))) for lab, b in zip(labels, bound, strict=True)]
        traced_us = time_graph(cuda, graph, runner.stream, 20)
        per_pass = sum(blocks for _, blocks in launches)
        if per_pass > TRACE_RECORDS:
            raise SystemExit(f"one pass runs {per_pass} blocks, more than the trace buffer's {TRACE_RECORDS} records")
        replays = min(replays, TRACE_RECORDS // per_pass)  # (a wide MoE pass fills the buffer in a few)
        runner.trace_reset()
        for _ in range(replays):
            graph.launch(runner.stream)
        recs = runner.trace_read()
    finally:
        runner.close()
    res = {"wall_tok_s": round(wall["tok_s"], 1), "traced_graph_us": round(traced_us, 1), "records": len(recs),
           "replays": replays}
    if save is not None:  # the raw records and the pass's launches, for a closer look
        np.savez_compressed(save, records=recs, entries=np.array([e for e, _ in launches]), labels=np.array(labels))
    parts = split_launches(recs, launches, replays)
    if isinstance(parts, str):
        res["error"] = parts
        return res
    n = len(launches)
    last = parts[(replays - 1) * n :]
    t0 = int(min(p[:, 2].min() for p in last))
    t1 = int(max(p[:, 5].max() for p in last))
    rows = launch_rows(last, labels, [b.side for b in bound], t0)
    res["span_us"] = round((t1 - t0) / 1e3, 1)
    res["gap_sum_us"] = round(sum(r["gap"] or 0.0 for r in rows), 1)
    res["summary"] = summarise(rows)
    res["launches"] = rows
    return res


def report(name: str, res: dict) -> str:
    lines = [
        f"== {name}: span {res.get('span_us')} us, gaps {res.get('gap_sum_us')} us, traced graph "
        f"{res['traced_graph_us']} us, {res['records']} records, wall {res['wall_tok_s']} tok/s"
    ]
    if "error" in res:
        return "\n".join(lines + [f"ERROR {res['error']}"])
    lines.append("   total  count    body     gap  mark-wait  label")
    for g in res["summary"]:
        maw = "" if g["mark_after_wait_us"] is None else f"{g['mark_after_wait_us']:9.2f}"
        lines.append(
            f"{g['total_us']:8.1f}  {g['count']:5d}  {g['body_us']:6.2f}  {g['gap_us']:6.2f}  {maw:>9}  {g['label'][:100]}"
        )
    lines.append("  launches (us from the step's first block start): start first/last, wait first/last, mark, end median/last")
    for r in res["launches"]:
        w = r["wait"] or [0, 0]
        lines.append(
            f"  {'S' if r['side'] else ' '} {r['start'][0]:8.2f} {r['start'][1]:8.2f}  w {w[0]:8.2f} {w[1]:8.2f}"
            f"  m {r['mark'] if r['mark'] is not None else '':>8}  e {r['end'][0]:8.2f} {r['end'][1]:8.2f}"
            f"  gap {r['gap'] if r['gap'] is not None else '':>6}  {r['blocks']:4d}b/{r['sms']:3d}sm  {r['label'][:70]}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "trace_out"))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC")
    ap.add_argument("--without", action="append", default=[], metavar="POST_PASS",
                    help="also trace a variant planned without this lowering post-pass")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--replays", type=int, default=3)
    args = ap.parse_args()
    os.environ["MEMRA_TRACE"] = "1"
    os.environ.setdefault("MEMRA_CACHE_DIR", tempfile.mkdtemp(prefix="memra-cache-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from engine import cuda
    from engine.model import load_model
    from engine.profile import select, with_tuning

    base = select(cuda.detect_devices()[0])
    model = load_model(Path(args.model))
    results, texts = {}, []
    import engine.lowering  # noqa: F401  (every unit and post-pass registered)
    from engine.lowering.registry import POST_PASSES

    variants = [("default", "", "")] + [(*v.split("=", 1), "") for v in args.variant]
    variants += [(f"without_{p}", "", p) for p in args.without]
    for name, spec, without in variants:
        t0 = time.perf_counter()
        saved = list(POST_PASSES)
        try:
            if without:
                if not any(fn.__name__ == without for _, fn in POST_PASSES):
                    raise ValueError(f"no post-pass {without!r} (known: {', '.join(fn.__name__ for _, fn in POST_PASSES)})")
                POST_PASSES[:] = [(o, fn) for o, fn in POST_PASSES if fn.__name__ != without]
            prof = with_tuning(base, spec) if spec.strip() else base
            res = trace_variant(cuda, model, prof, args.batch, args.replays, out / f"records_{name}.npz")
        except Exception as exc:  # one variant's failure must not lose the others
            res = {"error": f"{type(exc).__name__}: {exc}"[:400], "traced_graph_us": None, "records": 0, "wall_tok_s": None}
        finally:
            POST_PASSES[:] = saved
        results[name] = res
        texts.append(report(name, res))
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}", flush=True)
        print(texts[-1][:3000], flush=True)
        (out / "trace.json").write_text(json.dumps(results, indent=1))
        (out / "trace.txt").write_text("\n\n".join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
