"""Time the batch-1 (per-slot) expert GEMVs of one sparse layer on a GPU: moe_gemv glu / down (f32
decode) against moe_gemv_q8 (int8 x, dp4a) in several block shapes, each kernel alone.

    python tools/bench_moe_gemv.py [--glu-quant q4_k] [--down-quant q6_k,q4_k] [--tokens 1]
        [--shapes 4x4x2,4x2x2,8x2x3,4x4x3,8x1x3,2x4x2] [--sets 24] [--reps 48]

Shapes default to Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert width 768). A shape is
WARPSxROWS_PER_WARPxPREFETCH. Each launch takes the next of ``--sets`` routings (disjoint random
experts where the experts allow), so the expert bytes of consecutive launches differ and come from
DRAM, not from the 50 MB L2. A row: microseconds per launch (``--reps`` launches between two
events, median of 5), the chosen experts' weight bytes over that time (GB/s) and over the
profile's memory bandwidth. Numbers to reason with per kernel; `memra bench` and
tools/gpu_trace_decode.py measure the whole model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))

from bench_moe_gemm import random_stack  # noqa: E402

from engine import cuda  # noqa: E402
from engine.moe_kernels import expert_gemv_kernel, expert_q8_kernel, q8_supported  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--glu-quant", default="q4_k")
    ap.add_argument("--down-quant", default="q6_k,q4_k")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--shapes", default="4x4x2,4x2x2,8x2x3,4x4x3,8x1x3,2x4x2,4x1x3,16x1x3")
    ap.add_argument("--sets", type=int, default=24)
    ap.add_argument("--reps", type=int, default=48)
    args = ap.parse_args()
    from test_moe_kernels import Kit

    kit = Kit(Path.home() / ".cache" / "memra-bench-moe")
    from engine.profile import select

    prof = select(kit.ctx.info)
    rng = np.random.default_rng(0)
    e, top, hid, inter, t = args.experts, args.top_k, args.hidden, args.inter, args.tokens
    print(f"{prof.name}: experts={e} top_k={top} hidden={hid} inter={inter} tokens={t}", flush=True)
    id_sets = []
    for s in range(args.sets):
        perm = np.random.default_rng(s).permutation(e)
        id_sets.append(kit.i32(np.stack([np.roll(perm, -top * j)[:top] for j in range(t)]).astype(np.int32)))
    x = kit.bf(rng.standard_normal((t, hid)) * 0.5)
    act = kit.bf(rng.standard_normal((t, top, inter)) * 0.5)
    wts = kit.f32(np.full((t, top), 1.0 / top))
    out = kit.bf(np.zeros((t, hid)))
    stream = cuda.Stream()
    rows_out = []

    def time_kernel(name: str, k, make_args, nbytes: int) -> None:
        packed = []
        for ids in id_sets:
            a = make_args(ids)
            kit.launch(k, a, t)  # build + warm + check it runs
            packed.append(cuda.KernelArgs([c for _, c in k.args], [getattr(v, "ptr", v) for v in a]))
        run = cuda.PreparedLaunch(kit.fns[k.spec], k.grid(t), k.block, k.smem, stream)
        times = []
        for _ in range(5):
            start, end = cuda.Event(), cuda.Event()
            start.record(stream)
            for r in range(args.reps):
                run(packed[r % len(packed)])
            end.record(stream)
            end.synchronize()
            times.append(end.elapsed_ms(start) * 1e3 / args.reps)
        us = statistics.median(times)
        gbs = nbytes / (us * 1e-6) / 1e9
        rows_out.append((name, us, gbs, gbs / prof.memory_bandwidth_gbs))
        print(f"  {name:52s} {us:8.2f} us {gbs:8.0f} GB/s {100 * gbs / prof.memory_bandwidth_gbs:5.1f}%", flush=True)

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gq = args.glu_quant
    wg, wu = (kit.raw(random_stack(gq, e, inter, hid, rng)) for _ in range(2))
    gbytes = 2 * t * top * inter * wg.shape[1]  # (distinct experts per token and set)
    time_kernel(f"moe_gemv glu {gq}", expert_gemv_kernel("glu", gq, inter, hid, top), lambda ids: [act, wg, wu, x, ids, t], gbytes)
    if q8_supported("glu", gq, hid, top):
        for w, r, pf in shapes:
            k = expert_q8_kernel("glu", gq, inter, hid, top, warps=w, rows_per_warp=r, prefetch=pf)
            time_kernel(f"moe_gemv_q8 glu {gq} w{w} r{r} pf{k.spec.params['prefetch']}", k,
                        lambda ids: [act, wg, wu, x, ids, t], gbytes)
        # the batch-1 plan's glu: it routes the token from router logits itself (a set's logits
        # put its experts on top), default block shape
        rk = expert_q8_kernel("glu", gq, inter, hid, top, route=(e, True))
        wout = kit.f32(np.zeros((t, top)))
        lg_of = {}
        for s, ids in enumerate(id_sets):
            lg = np.random.default_rng(100 + s).standard_normal((t, e)).astype(np.float32)
            for j in range(t):
                lg[j, kit.host(ids)[j].astype(np.int64)] += 8.0
            lg_of[id(ids)] = kit.f32(lg)
        time_kernel(f"moe_gemv_q8 glu {gq} routing (plan default)", rk,
                    lambda ids: [act, wg, wu, x, kit.i32(np.zeros((t, top))), t, wout, lg_of[id(ids)]], gbytes)
    for dq in args.down_quant.split(","):
        wd = kit.raw(random_stack(dq, e, hid, inter, rng))
        dbytes = t * top * hid * wd.shape[1]
        old = expert_gemv_kernel("down", dq, hid, inter, top, residual=True)
        time_kernel(f"moe_gemv down {dq}", old, lambda ids, wd=wd: [out, wd, act, ids, wts, out, t], dbytes)
        if q8_supported("down", dq, inter, top):
            for w, r, pf in shapes:
                k = expert_q8_kernel("down", dq, hid, inter, top, residual=True, warps=w, rows_per_warp=r, prefetch=pf)
                time_kernel(f"moe_gemv_q8 down {dq} w{w} r{r} pf{k.spec.params['prefetch']}", k,
                            lambda ids, wd=wd: [out, wd, act, ids, wts, out, t], dbytes)
    print("\n| kernel | us | GB/s | of bandwidth |\n|---|---|---|---|")
    for name, us, gbs, frac in rows_out:
        print(f"| {name} | {us:.2f} | {gbs:.0f} | {100 * frac:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
