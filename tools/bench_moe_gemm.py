"""Time the MoE expert kernels of one sparse layer at a real shape on a GPU: the grouped
tensor-core GEMM path (moe_sort, moe_gemm glu and down, moe_combine) against the grouped GEMV path
(moe_gemv glu_grouped, down_grouped, moe_combine; rows per warp 1 and 4) and, for small token
counts, the per-slot GEMVs (moe_gemv glu, down), for several token counts
and row tiles.

    python tools/bench_moe_gemm.py [--quant q4_k] [--tokens 32,64,128,512,2048] [--tile-m 16,64]
        [--rows-per-warp 1,4] [--slot-max 32]
    python tools/bench_moe_gemm.py --tokens 1,2,4,8,16,32 --tile-m 16      (the decode buckets)

Shapes default to Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert width 768); weights are
random blocks of the storage type (the GPU tests' stacked_weight), routing uniform at random. Each
row: milliseconds per layer (median of 20 after a warm-up), the tensor-core fraction (2 x tokens x
top_k x 3 x width x hidden FLOPs over the profile's tensor_tflops_bf16) and the bytes-read
fraction (the chosen experts' weight bytes over the profile's memory bandwidth). Prints a table
last. Numbers to reason with per layer; `memra bench` measures the whole model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))

from engine import cuda, storage  # noqa: E402
from engine.moe_kernels import (  # noqa: E402
    combine_kernel,
    expert_gemm_kernel,
    expert_gemv_kernel,
    gemm_max_tiles,
    sort_kernel,
)


def random_stack(qt: str, e: int, n: int, k: int, rng) -> np.ndarray:
    """Raw bytes [E * n, row bytes] of a stacked weight: random blocks with small finite f16 scales
    (as test_moe_kernels.stacked_weight, without its f64 dequantised copy), or random bf16 rows."""
    from test_moe_kernels import SCALE_FIELDS

    if qt == "bf16":
        bits = (rng.standard_normal((e * n, k), dtype=np.float32) * 0.05).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    elems, nbytes = storage.BLOCK_SIZES[qt]
    nb = e * n * k // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    for off in SCALE_FIELDS[qt]:
        raw[:, off : off + 2] = (rng.uniform(0.2, 1.0, nb) * 0.002).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw.reshape(e * n, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="q4_k")
    ap.add_argument("--tokens", default="32,64,128,512,2048")
    ap.add_argument("--tile-m", default="16,64")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--rows-per-warp", default="1,4", help="the grouped GEMVs' rows per warp to time")
    ap.add_argument("--slot-max", type=int, default=32, help="time the per-slot GEMVs up to this many tokens")
    args = ap.parse_args()
    from test_moe_kernels import Kit

    kit = Kit(Path.home() / ".cache" / "memra-bench-moe")
    from engine.profile import select

    prof = select(kit.ctx.info)
    rng = np.random.default_rng(0)
    e, top, hid, inter, qt = args.experts, args.top_k, args.hidden, args.inter, args.quant
    raws = [random_stack(qt, e, n, k, rng) for n, k in ((inter, hid), (inter, hid), (hid, inter))]
    wg, wu, wd = (kit.raw(r) for r in raws)
    row_bytes = {m: raws[i].shape[1] for i, m in enumerate(("g", "u", "d"))}
    print(f"{prof.name}: {qt} experts={e} top_k={top} hidden={hid} inter={inter}", flush=True)
    rows_out = []
    stream = cuda.Stream()
    for t in (int(x) for x in args.tokens.split(",")):
        ids = np.stack([rng.choice(e, top, replace=False) for _ in range(t)]).astype(np.int32)
        used = len(np.unique(ids))
        wbytes = used * (inter * (row_bytes["g"] + row_bytes["u"]) + hid * row_bytes["d"])
        flops = 2 * t * top * 3 * inter * hid
        x = kit.bf(rng.standard_normal((t, hid)) * 0.5)
        ids_t, wts = kit.i32(ids), kit.f32(np.full((t, top), 1.0 / top))
        out = kit.bf(np.zeros((t, hid)))
        act = kit.nan_like((t * top, inter))
        partial = kit.nan_like((t, top, hid), "f32")
        paths = {}
        for bm in (int(x) for x in args.tile_m.split(",")):
            tiles = {"tile_m": bm, "warps_m": 1 if bm == 16 else 2}
            glu = expert_gemm_kernel("glu", qt, inter, hid, top, e, **tiles)
            down = expert_gemm_kernel("down", qt, hid, inter, top, e, **tiles)
            perm = kit.i32(np.zeros(t * top))
            tt = kit.i32(np.zeros((1 + gemm_max_tiles(t, top, e, bm), 4)))
            paths[f"gemm m{bm}"] = [
                (sort_kernel(e, top, bm), [perm, tt, ids_t, t]),
                (glu, [act, wg, wu, x, perm, tt, t]),
                (down, [partial, wd, act, perm, tt, t]),
                (combine_kernel(hid, top), [out, partial, wts, out, t]),
            ]
        for rpw in (int(r) for r in args.rows_per_warp.split(",")) if t <= 8192 else ():
            grouped = dict(experts=e, max_slots=max(t, top), rows_per_warp=rpw)
            gg = expert_gemv_kernel("glu_grouped", qt, inter, hid, top, **grouped)
            gd = expert_gemv_kernel("down_grouped", qt, hid, inter, top, **grouped)
            paths[f"grouped rw{rpw}"] = [
                (gg, [act, wg, wu, x, ids_t, t]),
                (gd, [partial, wd, act, ids_t, t]),
                (combine_kernel(hid, top), [out, partial, wts, out, t]),
            ]
        if t <= args.slot_max:  # per (token, slot), as batch 1 and the smallest decode buckets
            sg = expert_gemv_kernel("glu", qt, inter, hid, top)
            sd = expert_gemv_kernel("down", qt, hid, inter, top, residual=True)
            paths["gemv per slot"] = [(sg, [act, wg, wu, x, ids_t, t]), (sd, [out, wd, act, ids_t, wts, out, t])]
        for name, launches in paths.items():
            for k, a in launches:  # build + warm
                kit.launch(k, a, t)
            packed = [
                (
                    cuda.PreparedLaunch(kit.fns[k.spec], k.grid(t), k.block, k.smem, stream),
                    cuda.KernelArgs([c for _, c in k.args], [getattr(v, "ptr", v) for v in a]),
                )
                for k, a in launches
            ]
            times = []
            for _ in range(20):
                start, end = cuda.Event(), cuda.Event()
                start.record(stream)
                for run, kargs in packed:
                    run(kargs)
                end.record(stream)
                end.synchronize()
                times.append(end.elapsed_ms(start))
            ms = statistics.median(times)
            tc = flops / (ms * 1e-3) / (prof.tensor_tflops_bf16 * 1e12)
            bw = wbytes / (ms * 1e-3) / (prof.memory_bandwidth_gbs * 1e9)
            rows_out.append((t, name, ms, tc, bw, used))
            print(f"  tokens {t:5d} {name:13s} {ms:8.3f} ms  {100 * tc:5.1f}% tensor  {100 * bw:5.1f}% bytes ({used} experts)", flush=True)
    print("\n| tokens | path | ms/layer | tensor-core | bytes-read | experts read |\n|---|---|---|---|---|---|")
    for t, name, ms, tc, bw, used in rows_out:
        print(f"| {t} | {name} | {ms:.3f} | {100 * tc:.1f}% | {100 * bw:.1f}% | {used} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
