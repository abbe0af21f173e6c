"""Time the MoE kernels at a real MoE layer shape (Qwen3-30B-A3B by default) on a GPU.

    PYTHONPATH=. python tools/gpu_check_moe.py [--experts 128 --top-k 8 --hidden 2048 --inter 768]
                                               [--quants bf16,q8_0,q4_k,q6_k] [--rows 1,8,32] [--profile h100]

For each storage type and token count: moe_topk, then moe_gemv glu (gate + up + silu) and down
(weighted sum + residual) over random stacked expert weights, and the grouped path (glu_grouped,
down_grouped, moe_combine: one block per expert tile for all its tokens), timed with CUDA events
(median after warm-up). Reports microseconds and GB/s of the distinct expert bytes the step needs (the experts
the tokens chose, each counted once) against the device profile's bandwidth: the batch-1 fraction
is the kernel's share of the roofline on the bytes actually read. Correctness is
tests/gpu/test_moe_kernels.py's job. Uses tools/gpu_kernels_check.py's loader (torch allocator,
cuda.bindings). Must not import gguf.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from engine import quant
from engine.moe_kernels import combine_kernel, expert_gemv_kernel, topk_kernel
from engine.profile import get_profile

ROUTINGS = 16

_spec = importlib.util.spec_from_file_location("gpu_kernels_check", Path(__file__).with_name("gpu_kernels_check.py"))
gk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gk)


def random_stack(qt: str, rows: int, cols: int) -> torch.Tensor:
    """Random bytes of ``rows`` x ``cols`` ``qt`` values on the device, with small f16 scale fields."""
    elems, nbytes = quant.BLOCK_SIZES[qt]
    if qt == "bf16":
        return (torch.randn(rows * cols, device="cuda") * 0.05).to(torch.bfloat16).view(torch.uint8)
    raw = torch.randint(0, 256, (rows * cols // elems, nbytes), dtype=torch.uint8, device="cuda")
    for off in {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[qt]:
        raw[:, off : off + 2] = torch.tensor([0x20, 0x1C], dtype=torch.uint8, device="cuda")  # f16 ~0.004
    return raw.view(-1)


def measure(k, qt: str, rows: int, weights, expert_bytes: int, args, rng) -> dict:
    """One (storage type, token count) row: route, then glu and down, each timed alone. Each timed
    launch takes the next of ROUTINGS routings (different experts), so repeated launches do not find
    the previous launch's experts in L2."""
    e, top, h, inter, rpb = args.experts, args.top_k, args.hidden, args.inter, args.rows_per_block
    wg, wu, wd = weights
    tk = topk_kernel(e, top, True)
    glu = expert_gemv_kernel("glu", qt, inter, h, top, rpb)
    down = expert_gemv_kernel("down", qt, h, inter, top, rpb, residual=True)
    routes = []
    for _ in range(ROUTINGS):
        logits = gk.f32(rng.standard_normal((rows, e)).astype(np.float32))
        ids = torch.zeros((rows, top), dtype=torch.int32, device="cuda")
        wts = torch.zeros((rows, top), dtype=torch.float32, device="cuda")
        k.launch(tk, [ids, wts, logits, rows], rows)
        routes.append((logits, ids, wts))
    distinct = float(np.mean([len(np.unique(r[1].cpu().numpy())) for r in routes]))
    x = torch.randn(rows, h, device="cuda").to(torch.bfloat16)
    act = torch.empty(rows, top, inter, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(rows, h, device="cuda").to(torch.bfloat16)
    nxt = itertools.cycle(routes)

    def run_topk():
        lg, ids, wts = next(nxt)
        k.launch(tk, [ids, wts, lg, rows], rows)

    def run_glu():
        ids = next(nxt)[1]
        k.launch(glu, [act, wg, wu, x, ids, rows], rows)

    def run_down():
        _, ids, wts = next(nxt)
        k.launch(down, [out, wd, act, ids, wts, out, rows], rows)

    slots = max(256, rows * top)
    gglu = expert_gemv_kernel("glu_grouped", qt, inter, h, top, rpb, experts=e, max_slots=slots)
    gdown = expert_gemv_kernel("down_grouped", qt, h, inter, top, rpb, experts=e, max_slots=slots)
    comb = combine_kernel(h, top)
    partial = torch.empty(rows, top, h, device="cuda", dtype=torch.float32)

    def run_grouped():
        _, ids, wts = next(nxt)
        k.launch(gglu, [act, wg, wu, x, ids, rows], rows)
        k.launch(gdown, [partial, wd, act, ids, rows], rows)
        k.launch(comb, [out, partial, wts, out, rows], rows)

    t_topk, t_glu, t_down = gk.bench(run_topk), gk.bench(run_glu), gk.bench(run_down)
    t_grouped = gk.bench(run_grouped)
    moved = distinct * expert_bytes
    gbs = moved / ((t_topk + t_glu + t_down) * 1e-3) / 1e9
    ggbs = moved / ((t_topk + t_grouped) * 1e-3) / 1e9
    return {
        "quant": qt, "rows": rows, "distinct_experts": distinct, "topk_us": round(t_topk * 1e3, 1),
        "glu_us": round(t_glu * 1e3, 1), "down_us": round(t_down * 1e3, 1),
        "expert_mb": round(moved / 1e6, 2), "gbs": round(gbs, 1),
        "roofline": round(gbs / args.bandwidth, 3),
        "grouped_us": round(t_grouped * 1e3, 1), "grouped_roofline": round(ggbs / args.bandwidth, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--quants", default="bf16,q8_0,q4_k,q6_k")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rows-per-block", type=int, default=4)
    ap.add_argument("--profile", default="h200", help="device profile whose bandwidth is the roofline")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    args.bandwidth = get_profile(args.profile).memory_bandwidth_gbs
    torch.zeros(1, device="cuda")
    gk.check(gk.drv.cuInit(0))
    k = gk.Kernels(str(Path.home() / ".cache" / "memra" / "gpu_check_moe"))
    bw = args.bandwidth
    rng = np.random.default_rng(0)
    e, h, inter = args.experts, args.hidden, args.inter
    rows_out = []
    for qt in args.quants.split(","):
        wg, wu, wd = random_stack(qt, e * inter, h), random_stack(qt, e * inter, h), random_stack(qt, e * h, inter)
        expert_bytes = 3 * quant.nbytes_for(qt, (inter, h))
        for rows in (int(r) for r in args.rows.split(",")):
            row = measure(k, qt, rows, (wg, wu, wd), expert_bytes, args, rng)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}; {args.profile} profile bandwidth {bw} GB/s; experts {e}, "
          f"top-k {args.top_k}, hidden {h}, inter {inter}")
    print(f"{'quant':6} {'rows':>4} {'experts':>7} {'topk us':>8} {'glu us':>8} {'down us':>8} {'MB':>7} "
          f"{'GB/s':>7} {'roof':>6} {'grp us':>8} {'grp roof':>8}")
    for r in rows_out:
        print(f"{r['quant']:6} {r['rows']:>4} {r['distinct_experts']:>7} {r['topk_us']:>8} {r['glu_us']:>8} "
              f"{r['down_us']:>8} {r['expert_mb']:>7} {r['gbs']:>7} {r['roofline']:>6} {r['grouped_us']:>8} "
              f"{r['grouped_roofline']:>8}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
