"""Where a decode step's time goes, and tuning A/Bs of it, on the GPU machine.

    PYTHONPATH=. python tools/gpu_decode_profile.py --out $OUT --shapes smollm2-135m,qwen3-0.6b \
        --variant glu='gemv.fuse_glu=false' --variant coop='gemv_coop.types=[bf16]'

For each shape (a random checkpoint with the real shapes, written by tools/make_checkpoint.py under
/dev/shm, or ``--model PATH``) and each variant (the selected profile, then each ``--variant
NAME=SPEC`` with engine.profile.with_tuning's ``section.knob=value; ...`` overrides):

- ``wall``: ``runner.step`` decode time at each ``--batches`` (engine.runner_bench.bench_decode,
  depth 0), i.e. what the engine sees, host work included;
- ``graph``: the same decode graph replayed back to back between CUDA events (GPU time only), so
  ``wall - graph`` is the host's share of a step;
- ``kernels`` (``--breakdown``): each distinct launch of the batch-1 pass (same kernel and grid)
  timed as a graph that runs every instance of it in the pass, each with its own layer's weights
  (so a matrix smaller than L2 is still read from HBM, as in the step), repeated up to at least 20
  launches; the sum against ``graph`` shows what the launches between kernels cost. A launch that
  reads weights also gets its own bandwidth (its weights' bytes over its time, GB/s) and that as a
  fraction of the measured device-to-device copy (``copy_gbs``); the lm_head's GEMV (the launch
  writing the logits) gets its own line, ``head``;
- ``rel``: a variant's logits after a 16-token prefill and one decode step against the first
  variant's (a tuning that changes results shows here; tests/gpu checks correctness properly).

Writes decode_profile.json and decode_profile.txt under --out. Must not be imported by the engine.
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

from engine.ir import pass_key  # noqa: E402
from engine.types import SamplingParams, StepItem  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
COPIES = 20


def pass_labels(runner, mode: str, short: bool, sampling: str, verify: bool = False, rows: int = 0) -> list[str]:
    """One label per launch of a decode pass of ``rows`` rows (0: 1 in decode1, else the largest
    bucket), in CudaRunner._bind_pass order (engine.ir.pass_key); the lm_head's launches (their
    step writes the logits) are labelled ``head:``."""
    labels = []
    n = rows or (1 if mode == "decode1" else max(runner.plan.graph_batch_sizes))
    for step in runner.plan.steps:
        key = pass_key(step, mode, n, short, verify, runner.plan.b1_rows)
        op = "head" if "logits" in step.op.outputs else step.op.op
        for launch in step.launches[key]:
            if launch.runs_at(n):  # (as CudaRunner binds a pass: engine.runner_steps)
                labels.append(f"{op}:{launch.spec.entry}")
    for launch in runner.plan.sampling[sampling]:
        labels.append(f"sample:{launch.spec.entry}")
    return labels


def pass_weight_bytes(runner, mode: str, short: bool, sampling: str, verify: bool = False, rows: int = 0) -> list[int]:
    """The weight bytes each launch of a decode pass reads (its weight args), in pass_labels order."""
    sizes = {w.key: w.nbytes for w in runner.plan.weights}
    out = []
    n = rows or (1 if mode == "decode1" else max(runner.plan.graph_batch_sizes))
    for step in runner.plan.steps:
        for launch in step.launches[pass_key(step, mode, n, short, verify, runner.plan.b1_rows)]:
            if launch.runs_at(n):
                out.append(sum(sizes.get(a.ref, 0) for a in launch.args if a.kind == "weight"))
    return out + [0] * len(runner.plan.sampling[sampling])


def time_graph(cuda, graph, stream, launches: int) -> float:
    """Microseconds per replay of ``graph`` (after two warm replays)."""
    for _ in range(2):
        graph.launch(stream)
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record(stream)
    for _ in range(launches):
        graph.launch(stream)
    e1.record(stream)
    e1.synchronize()
    us = e1.elapsed_ms(e0) * 1e3 / launches
    e0.destroy()
    e1.destroy()
    return us


def breakdown(
    cuda, runner, bound: list, labels: list[str], weight_bytes: list[int], copy_gbs: float | None
) -> list[dict]:
    groups: dict[tuple, dict] = {}
    for b, label, nbytes in zip(bound, labels, weight_bytes, strict=True):
        key = (label, b.grid, b.block, b.smem)
        if key not in groups:
            groups[key] = {"label": label, "grid": list(b.grid), "block": b.block[0], "bound": [], "bytes": 0}
        groups[key]["bound"].append(b)
        groups[key]["bytes"] += nbytes
    rows = []
    for g in groups.values():
        bs = g.pop("bound")
        g["count"] = len(bs)
        reps = -(-COPIES // len(bs))
        runner.stream.synchronize()
        with cuda.capture(runner.stream) as graph:
            for _ in range(reps):
                for b in bs:
                    (b.solo or b.run)(b.args)  # a side-stream launch timed on the main stream
        us = time_graph(cuda, graph, runner.stream, 10) / (reps * len(bs))
        graph.destroy()
        g["us"] = round(us, 2)
        g["total_us"] = round(us * g["count"], 1)
        nbytes = g.pop("bytes") / g["count"]  # one launch's weight bytes (the mean over its instances)
        if nbytes:
            g["weight_bytes"] = int(nbytes)
            g["gbs"] = round(nbytes / (us * 1e-6) / 1e9, 1)
            if copy_gbs:
                g["copy_frac"] = round(g["gbs"] / copy_gbs, 3)
        rows.append(g)
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def probe_logits(runner) -> np.ndarray:
    table = list(range(4))
    ids = [(7 * i) % 500 + 3 for i in range(16)]
    slot = 0 if getattr(runner, "num_state_slots", 0) else None  # a hybrid's recurrent-state slot
    runner.step(
        [StepItem(seq_id=0, token_ids=ids, start_pos=0, block_table=table, sample=True, sampling=GREEDY, state_slot=slot)]
    )
    runner.step(
        [StepItem(seq_id=0, token_ids=[11], start_pos=16, block_table=table, sample=True, sampling=GREEDY, state_slot=slot)]
    )
    return runner.read_logits(1)[0]


def profile_variant(cuda, model, profile, batches, want_breakdown: bool) -> dict:
    from engine import runner_bench
    from engine.runner_cuda import CudaRunner, _decode_mode

    t0 = time.perf_counter()
    runner = CudaRunner(model, profile, num_blocks=4096, max_model_len=8192, window_kv_blocks=0)
    res: dict = {"build_s": round(time.perf_counter() - t0, 2), "kernels_compiled": len(runner._fns)}
    try:
        copy_gbs = float(runner.copy_bandwidth_gbs()) if want_breakdown else None
        if copy_gbs:
            res["copy_gbs"] = round(copy_gbs, 1)
        res["logits"] = probe_logits(runner)
        for batch in batches:
            wall = runner_bench.bench_decode(runner, batch, 0)
            bucket = next(b for b in runner.plan.graph_batch_sizes if b >= batch)
            graph, bound = runner._graphs[(bucket, "greedy", True, True)]
            gpu = time_graph(cuda, graph, runner.stream, 50)
            row = {
                "wall_us": round(wall["step_ms"] * 1e3, 1),
                "graph_us": round(gpu, 1),
                "host_us": round(wall["step_ms"] * 1e3 - gpu, 1),
                "tok_s": round(wall["tok_s"], 1),
                "graph_tok_s": round(batch / gpu * 1e6, 1),
                "roofline": round(wall["roofline_fraction"], 4),
                "launches": len(bound),
            }
            if want_breakdown and batch == batches[0]:
                mode = _decode_mode(bucket, runner.plan.wide_rows)
                labels = pass_labels(runner, mode, True, "greedy", rows=bucket)
                nbytes = pass_weight_bytes(runner, mode, True, "greedy", rows=bucket)
                row["kernels"] = breakdown(cuda, runner, bound, labels, nbytes, copy_gbs)
                row["kernel_sum_us"] = round(sum(k["total_us"] for k in row["kernels"]), 1)
            res[f"b{batch}"] = row
    finally:
        runner.close()
    return res


def checkpoint(shape: str, root: Path) -> Path:
    import make_checkpoint

    path = root / shape
    if not (path / "model.safetensors").exists():
        make_checkpoint.main(["--shape", shape, "--out", str(path), "--seed", "1"])
    return path


def report(results: dict) -> str:
    lines = []
    for shape, variants in results.items():
        for name, res in variants.items():
            if "error" in res:
                lines.append(f"{shape} {name}: ERROR {res['error']}")
                continue
            for key, row in res.items():
                if not key.startswith("b") or not isinstance(row, dict):
                    continue
                lines.append(
                    f"{shape:<14} {name:<10} {key:<4} wall {row['wall_us']:8.1f} us  graph {row['graph_us']:8.1f} us"
                    f"  host {row['host_us']:6.1f} us  {row['tok_s']:9.1f} tok/s ({row['graph_tok_s']:.1f} GPU-only)"
                    f"  {100 * row['roofline']:5.1f} %  {row['launches']} launches  rel {res.get('rel', 0):.2e}"
                )
                for k in row.get("kernels", []):
                    bw = f"  {k['gbs']:7.1f} GB/s" if "gbs" in k else ""
                    bw += f" {100 * k['copy_frac']:5.1f} % of copy" if "copy_frac" in k else ""
                    lines.append(
                        f"    {k['total_us']:8.1f} us  {k['count']:4d} x {k['us']:7.2f}  grid {k['grid']} x {k['block']}{bw}  {k['label'][:110]}"
                    )
                for k in row.get("kernels", []):
                    if k["label"].startswith("head:") and "gbs" in k:
                        frac = f", {100 * k['copy_frac']:.1f} % of the d2d copy ({res.get('copy_gbs')} GB/s)" if "copy_frac" in k else ""
                        lines.append(
                            f"    head: {k['label'][5:]} reads {k['weight_bytes'] / 1e6:.1f} MB in {k['us']:.2f} us: "
                            f"{k['gbs']:.1f} GB/s{frac}"
                        )
                if "kernel_sum_us" in row:
                    lines.append(
                        f"    {row['kernel_sum_us']:8.1f} us  sum of kernels (graph {row['graph_us']} us)"
                    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "decode_profile_out"))
    ap.add_argument(
        "--shapes",
        default=None,
        help="comma-separated checkpoint shapes (default smollm2-135m,qwen3-0.6b; none with --model)",
    )
    ap.add_argument(
        "--model", action="append", default=[], help="a model path (instead of / besides --shapes)"
    )
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel times of the first batch")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MEMRA_CACHE_DIR", tempfile.mkdtemp(prefix="memra-cache-"))

    from engine import cuda
    from engine.model import load_model
    from engine.profile import select, with_tuning

    dev = cuda.detect_devices()[0]
    base = select(dev)
    variants = [("default", "")] + [tuple(v.split("=", 1)) for v in args.variant]
    batches = [int(b) for b in args.batches.split(",")]
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    shapes = args.shapes if args.shapes is not None else ("" if args.model else "smollm2-135m,qwen3-0.6b")
    paths = [(s, checkpoint(s, shm / "memra-prof")) for s in shapes.split(",") if s and s != "none"]
    paths += [(Path(m).name, Path(m)) for m in args.model]
    results: dict = {}
    for shape, path in paths:
        model = load_model(path)
        results[shape] = {}
        first = None
        for name, spec in variants:
            t0 = time.perf_counter()
            try:
                prof = with_tuning(base, spec) if spec.strip() else base
                res = profile_variant(cuda, model, prof, batches, args.breakdown)
            except Exception as exc:  # one variant's failure must not lose the others
                res = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            res["device"] = {"name": dev.name, "profile": base.name}
            logits = res.pop("logits", None)
            if logits is not None:
                if first is None:
                    first = logits
                res["rel"] = float(np.linalg.norm(logits - first) / max(np.linalg.norm(first), 1e-30))
            results[shape][name] = res
            print(f"[{time.perf_counter() - t0:6.1f} s] {shape} {name}: {json.dumps(res)[:300]}", flush=True)
        (out / "decode_profile.json").write_text(json.dumps(results, indent=1, default=str))
    text = report(results)
    (out / "decode_profile.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
