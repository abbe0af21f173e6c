"""Decode GEMV (and embed) on the GPU: correctness for every storage type, bandwidth, a bf16 sweep.

Run on a GPU machine: ``PYTHONPATH=. python3 tools/gpu_check_gemv.py --out DIR [--quick]``.
Writes DIR/gpu_check_gemv.json (every row) and DIR/gpu_check_gemv.txt (a short table).

* correctness: every kc.QUANTS type (weights = random GGUF bytes with sane f16 scales, dequantised
  by engine.quant as the reference), batch 1 (bmax 1), 3 and 8 (bmax 8), 13 (a bmax tail: two grid
  rows, the second partial), residual in place, f32 out, staged and unstaged, unroll 1 and 4, an odd
  n (column tail). Outputs are poisoned with NaN; fail on NaN or rel err > 1e-2. embed too.
* bandwidth: GB/s of weight bytes (and the fraction of 4100 GB/s) for the Qwen3-4B, Qwen3-0.6B and
  SmolLM2-135M decode shapes, batch 1 and 8: bf16 for all models, every quantised type for Qwen3-4B
  and the 0.6B lm_head. Each timed launch reads a different copy of the weight (copies cover > 256 MB)
  so the numbers are DRAM, not the 50 MB L2. torch.matmul (x @ W.T, bf16) is timed alongside.
* sweep: bf16 threads x rows_per_block x unroll at batch 1 on a few shapes, to pick the profile's
  gemv tuning.
Each check catches its own exceptions (recorded as ok=false with the error). Needs torch (allocator,
CUDA-event timing, matmul baseline) and cuda.bindings; never imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels_check import DEV, TUNING, Kernels, bf, bf_round, host, i32, nan_like, rel_err  # noqa: E402

from engine import kernel_catalog as kc  # noqa: E402
from engine import quant  # noqa: E402

NAME = "gpu_check_gemv"
PEAK_GBS = 4100.0
TOL = {"bf16": 1e-2, "f32": 1e-2}
RESULTS: list[dict] = []
# byte offsets of the f16 scale/min fields inside one block (random bytes there could be inf/NaN)
F16_FIELDS = {
    "q8_0": [0],
    "q4_0": [0],
    "q4_1": [0, 2],
    "q5_0": [0],
    "q5_1": [0, 2],
    "q4_k": [0, 2],
    "q5_k": [0, 2],
    "q6_k": [208],
}
SHAPES = {  # (n, k) of the decode GEMVs: qkv, o, gate|up, down, lm_head
    "qwen3-4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560)],
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
}


def record(name: str, out: np.ndarray | None, ref: np.ndarray | None, tol: float, **extra) -> dict:
    row = {"kernel": name, **extra}
    if out is not None:
        nan = int(np.isnan(out).sum())
        err = rel_err(np.nan_to_num(out), ref)
        row.update(rel_err=err, nans=nan, ok=bool(nan == 0 and err <= tol), tol=tol)
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    return row


def guarded(label: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # one failing case must not hide the others
        traceback.print_exc()
        record(label, None, None, 0.0, ok=False, error=f"{type(e).__name__}: {e}")


def random_weight(qt: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint8 bytes [n, row_bytes] in storage type qt, dequantised f64 [n, k])."""
    if qt in ("bf16", "f16", "f32"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        if qt == "bf16":
            raw = (w.view(np.uint32) >> 16).astype(np.uint16)
        elif qt == "f16":
            raw = w.astype(np.float16)
        else:
            raw = w
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
        return raw, quant.dequantize(raw.reshape(-1), qt, (n, k)).astype(np.float64)
    elems, nbytes = kc.QUANTS[qt]
    nb = n * k // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    scale = 0.002 if qt.endswith("_k") else 0.01
    for off in F16_FIELDS[qt]:
        raw[:, off : off + 2] = (
            (rng.uniform(0.2, 1.0, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
        )
    deq = quant.dequantize(raw.reshape(-1), qt, (n, k)).astype(np.float64)
    return raw.reshape(n, -1), deq


def gemv_choice(qt, n, k, *, bmax, residual=False, od="bf16", stage=None, **knobs):
    p = kc.linear_params(qt, n, k, TUNING, residual=residual, out_dtype=od, bmax=bmax, stage=stage)
    return kc.choice("gemv", **{**p, **knobs})


# ---- correctness ----

CASES = (  # rows, bmax, residual, out dtype
    (1, 1, False, "bf16"),
    (1, 1, True, "bf16"),
    (1, 1, False, "f32"),
    (3, 8, False, "bf16"),
    (8, 8, True, "bf16"),
    (8, 8, False, "f32"),
    (13, 8, True, "bf16"),
)


def gemv_case(K, rng, qt, raw_t, deq, n, k, rows, bmax, residual, od, stage, unroll):
    c = gemv_choice(qt, n, k, bmax=bmax, residual=residual, od=od, stage=stage, unroll=unroll)
    x = bf_round(rng.standard_normal((rows, k)))
    r = bf_round(rng.standard_normal((rows, n)))
    if residual:
        out = bf(r)  # the residual aliases out (in place, as the plan does)
    else:
        out = nan_like((rows, n), torch.float32 if od == "f32" else torch.bfloat16)
    K.launch(c, [out, raw_t, bf(x), out if residual else 0, rows], rows)
    ref = x @ deq.T + (r if residual else 0)
    record(
        c.spec.entry,
        host(out),
        ref,
        TOL[od],
        check="gemv",
        quant=qt,
        rows=rows,
        bmax=bmax,
        residual=residual,
        out_dtype=od,
        stage=c.spec.params["stage"],
        unroll=unroll,
    )


def check_gemv(K, rng, quick):
    n, k = 1003, 2560  # odd n: the last block's column tail
    for qt in kc.QUANTS:

        def one(qt=qt):
            raw, deq = random_weight(qt, n, k, rng)
            raw_t = torch.from_numpy(raw).to(DEV)
            stages = (False, True) if qt != "f32" else (False,)
            for stage in stages:
                for unroll in (1, 4) if not stage else (2,):
                    for rows, bmax, residual, od in CASES[:3] if quick else CASES:
                        guarded(
                            f"gemv {qt} rows={rows} stage={stage} unroll={unroll}",
                            lambda a=(rows, bmax, residual, od, stage, unroll): gemv_case(
                                K, rng, qt, raw_t, deq, n, k, *a
                            ),
                        )

        guarded(f"gemv {qt} setup", one)


def prologue_case(K, rng, qt, raw_t, deq, n, k, rows, bmax, od, pro):
    """The decode fusions: rmsnorm (x raw, norm weight f32) or silu_mul (x = [gate | up] rows)."""
    eps = 1e-6
    if pro == "norm":
        knobs = dict(prologue="norm", x_stride=k, eps=eps)
        x = bf_round(rng.standard_normal((rows, k)) * 3.0)
        nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
        inv = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
        xin = bf_round(x * inv * nw)
        residual = False
    else:
        knobs = dict(prologue="silu", x_stride=2 * k, u_off=k)
        x = bf_round(rng.standard_normal((rows, 2 * k)) * 2.0)
        g, u = x[:, :k], x[:, k:]
        xin = bf_round(g / (1.0 + np.exp(-g)) * u)
        residual = True
    c = gemv_choice(qt, n, k, bmax=bmax, residual=residual, od=od, **knobs)
    r = bf_round(rng.standard_normal((rows, n)))
    out = bf(r) if residual else nan_like((rows, n), torch.float32 if od == "f32" else torch.bfloat16)
    args = [out, raw_t, bf(x), out if residual else 0, rows]
    if pro == "norm":
        args.append(torch.from_numpy(nw).to(DEV))
    K.launch(c, args, rows)
    ref = xin @ deq.T + (r if residual else 0)
    record(
        c.spec.entry,
        host(out),
        ref,
        TOL[od],
        check=f"gemv_{pro}",
        quant=qt,
        rows=rows,
        bmax=bmax,
        residual=residual,
        out_dtype=od,
        stage=c.spec.params["stage"],
    )


PRO_CASES = ((1, 1, "bf16"), (1, 1, "f32"), (3, 8, "bf16"), (8, 8, "f32"), (13, 8, "bf16"))


def check_prologues(K, rng, quick):
    n, k = 1003, 2560
    for qt in kc.QUANTS:

        def one(qt=qt):
            raw, deq = random_weight(qt, n, k, rng)
            raw_t = torch.from_numpy(raw).to(DEV)
            for pro in ("norm", "silu"):
                for rows, bmax, od in PRO_CASES[:2] if quick else PRO_CASES:
                    guarded(
                        f"gemv {qt} {pro} rows={rows}",
                        lambda a=(rows, bmax, od, pro): prologue_case(K, rng, qt, raw_t, deq, n, k, *a),
                    )

        guarded(f"gemv prologue {qt} setup", one)


def check_embed(K, rng):
    hidden, vocab, rows = 2560, 300, 7
    for qt in kc.QUANTS:

        def one(qt=qt):
            raw, deq = random_weight(qt, vocab, hidden, rng)
            c = kc.choice("embed", quant=qt, hidden=hidden, threads=TUNING["elementwise"]["threads"])
            ids = rng.integers(0, vocab, rows)
            out = nan_like((rows, hidden))
            K.launch(c, [out, torch.from_numpy(raw).to(DEV), i32(ids), rows], rows)
            record(c.spec.entry, host(out), bf_round(deq[ids]), 1e-2, check="embed", quant=qt)

        guarded(f"embed {qt}", one)


# ---- timing ----


def weight_copies(qt, n, k, min_bytes=256 << 20, max_copies=64):
    """Random weight bytes, enough copies that one pass over them does not fit in L2."""
    elems, nbytes = kc.QUANTS[qt]
    size = n * k // elems * nbytes
    copies = max(1, min(max_copies, -(-min_bytes // size)))
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, device=DEV) for _ in range(copies)], size


def bench_ms(fn, reps=20) -> float:
    """Median milliseconds of fn() (CUDA events) after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def graphed(fn):
    """fn's launches captured in a CUDA graph (as the engine replays decode steps): Python launch
    overhead would otherwise starve the GPU for the small shapes. Falls back to fn on failure."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up outside the capture (cuBLAS workspace, module loads)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay
    except Exception:
        traceback.print_exc()
        torch.cuda.synchronize()
        return fn


def time_gemv(K, qt, n, k, rows, *, model="", od="bf16", torch_ref=False, **knobs) -> dict:
    bmax = 1 if rows == 1 else TUNING["gemv"]["max_batch"]
    c = gemv_choice(qt, n, k, bmax=bmax, od=od, **knobs)
    ws, size = weight_copies(qt, n, k)
    xs = c.spec.params["x_stride"] or k
    x = torch.randn(rows, xs, device=DEV).to(torch.bfloat16)
    out = torch.empty(rows, n, device=DEV, dtype=torch.float32 if od == "f32" else torch.bfloat16)
    extra = [torch.ones(k, device=DEV)] if c.spec.params["prologue"] == "norm" else []
    K.fn(c)  # compile/load outside the timing

    def run():
        for w in ws:
            K.launch(c, [out, w, x, 0, rows, *extra], rows)

    us = bench_ms(graphed(run)) * 1e3 / len(ws)
    gbs = size / (us * 1e-6) / 1e9
    row = {
        "check": "gemv_time",
        "kernel": c.spec.entry,
        "model": model,
        "quant": qt,
        "n": n,
        "k": k,
        "rows": rows,
        "out_dtype": od,
        "us": round(us, 2),
        "gbs": round(gbs, 1),
        "frac_peak": round(gbs / PEAK_GBS, 3),
        "copies": len(ws),
        "prologue": c.spec.params["prologue"],
        **{x: c.spec.params[x] for x in ("threads", "rows_per_block", "unroll", "stage", "bmax")},
    }
    if torch_ref and qt == "bf16":
        tws = [w.view(torch.bfloat16).view(n, k) for w in ws]

        def run_t():
            for w in tws:
                torch.matmul(x, w.t())

        tus = bench_ms(graphed(run_t)) * 1e3 / len(tws)
        row.update(torch_us=round(tus, 2), torch_gbs=round(size / (tus * 1e-6) / 1e9, 1))
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    return row


def check_bandwidth(K, quick):
    models = ["qwen3-4b"] if quick else list(SHAPES)
    for model in models:
        for i, (n, k) in enumerate(SHAPES[model]):
            od = "f32" if i == 4 else "bf16"
            for rows in (1, 8):
                guarded(
                    f"time bf16 {model} {n}x{k} rows={rows}",
                    lambda a=(n, k, rows, model, od): time_gemv(
                        K, "bf16", a[0], a[1], a[2], model=a[3], od=a[4], torch_ref=True
                    ),
                )
    for qt in kc.QUANTS:
        if qt == "bf16":
            continue
        shapes = [("qwen3-4b", s) for s in SHAPES["qwen3-4b"]] + [("qwen3-0.6b", SHAPES["qwen3-0.6b"][4])]
        if quick:
            shapes = shapes[:1]
        for model, (n, k) in shapes:
            od = "f32" if n == 151936 else "bf16"
            for rows in (1, 8):
                guarded(
                    f"time {qt} {model} {n}x{k} rows={rows}",
                    lambda a=(qt, n, k, rows, model, od): time_gemv(
                        K, a[0], a[1], a[2], a[3], model=a[4], od=a[5]
                    ),
                )


FUSED_TIMES = (  # Qwen3-4B decode GEMVs with their prologue, next to the plain ones in the table
    ("norm", 6144, 2560, {}),
    ("norm", 19456, 2560, {}),
    ("silu", 2560, 9728, {"x_stride": 19456, "u_off": 9728}),
    ("norm", 151936, 2560, {}),
)


def check_fused_times(K, quick):
    for qt in ("bf16",) if quick else ("bf16", "q8_0", "q4_k", "q6_k"):
        for pro, n, k, kn in FUSED_TIMES:
            od = "f32" if n == 151936 else "bf16"
            knobs = {"prologue": pro, **({"eps": 1e-6, "x_stride": k} if pro == "norm" else kn)}
            for rows in (1, 8):
                guarded(
                    f"time {qt} {pro} {n}x{k} rows={rows}",
                    lambda a=(qt, n, k, rows, od, knobs): time_gemv(
                        K, a[0], a[1], a[2], a[3], model="qwen3-4b", od=a[4], **a[5]
                    ),
                )


def sweep_bf16(K, quick):
    shapes = [(6144, 2560), (2560, 9728), (1024, 3072), (576, 1536)]
    if quick:
        shapes = shapes[:1]
    for n, k in shapes:
        for threads in (128, 256, 512):
            for rpb in (1, 2, 4, 8):
                if rpb > threads // 32:
                    continue
                for unroll in (1, 2, 4, 8):
                    guarded(
                        f"sweep bf16 {n}x{k} t={threads} rpb={rpb} u={unroll}",
                        lambda a=(n, k, threads, rpb, unroll): time_gemv(
                            K,
                            "bf16",
                            a[0],
                            a[1],
                            1,
                            model="sweep",
                            threads=a[2],
                            rows_per_block=a[3],
                            unroll=a[4],
                        ),
                    )


def prebuild(K, quick):
    """Compile every spec the timing uses in parallel up front (keeps the run well under 90 s)."""
    specs = []
    g = TUNING["gemv"]
    for qt in kc.QUANTS:  # the correctness cases (check_gemv, check_embed)
        specs.append(kc.choice("embed", quant=qt, hidden=2560, threads=TUNING["elementwise"]["threads"]).spec)
        for stage in (False, True) if qt != "f32" else (False,):
            for unroll in (1, 4) if not stage else (2,):
                for _rows, bmax, residual, od in CASES[:3] if quick else CASES:
                    specs.append(
                        gemv_choice(
                            qt, 1003, 2560, bmax=bmax, residual=residual, od=od, stage=stage, unroll=unroll
                        ).spec
                    )
    for qt in kc.QUANTS:  # the bandwidth shapes (check_bandwidth)
        shp = (
            [s for ss in SHAPES.values() for s in ss]
            if qt == "bf16"
            else SHAPES["qwen3-4b"] + SHAPES["qwen3-0.6b"][4:]
        )
        for n, k in shp:
            od = "f32" if n in (151936, 49152) else "bf16"
            for bmax in (1, g["max_batch"]):
                try:
                    specs.append(gemv_choice(qt, n, k, bmax=bmax, od=od).spec)
                except Exception:
                    pass
    for qt in kc.QUANTS:
        for _rows, bmax, od in PRO_CASES:
            specs.append(
                gemv_choice(qt, 1003, 2560, bmax=bmax, od=od, prologue="norm", x_stride=2560, eps=1e-6).spec
            )
            specs.append(
                gemv_choice(
                    qt,
                    1003,
                    2560,
                    bmax=bmax,
                    residual=True,
                    od=od,
                    prologue="silu",
                    x_stride=5120,
                    u_off=2560,
                ).spec
            )
        for pro, n, k, kn in FUSED_TIMES:
            od = "f32" if n == 151936 else "bf16"
            knobs = {"prologue": pro, **({"eps": 1e-6, "x_stride": k} if pro == "norm" else kn)}
            for bmax in (1, g["max_batch"]):
                specs.append(gemv_choice(qt, n, k, bmax=bmax, od=od, **knobs).spec)
    for n, k in [(6144, 2560), (2560, 9728), (1024, 3072), (576, 1536)]:
        for threads in (128, 256, 512):
            for rpb in (1, 2, 4, 8):
                for unroll in (1, 2, 4, 8):
                    if rpb <= threads // 32:
                        specs.append(
                            gemv_choice(
                                "bf16", n, k, bmax=1, threads=threads, rows_per_block=rpb, unroll=unroll
                            ).spec
                        )
    K.builder.build_all(list(dict.fromkeys(specs)), jobs=os.cpu_count() or 4, progress=None)


def table() -> str:
    lines = []
    checks = [r for r in RESULTS if "ok" in r]
    bad = [r for r in checks if not r["ok"]]
    lines.append(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok")
    for r in bad:
        lines.append(
            f"  FAIL {r['kernel']}: rel_err={r.get('rel_err')} nans={r.get('nans')} {r.get('error', '')}"
        )
    worst: dict[str, float] = {}
    for r in checks:
        if "rel_err" in r:
            worst[r.get("quant", "?")] = max(worst.get(r.get("quant", "?"), 0.0), r["rel_err"])
    lines.append("worst rel err per type: " + ", ".join(f"{q} {e:.1e}" for q, e in worst.items()))
    lines.append("")
    lines.append(
        f"{'model':<13} {'type':<10} {'n x k':<13} {'rows':>4} {'us':>8} {'GB/s':>7} {'%4100':>6} {'torch GB/s':>10}"
    )
    for r in RESULTS:
        if r.get("check") == "gemv_time" and r["model"] != "sweep":
            lines.append(
                f"{r['model']:<13} {r['quant'] + ('+' + r['prologue'] if r.get('prologue', 'none') != 'none' else ''):<10} "
                f"{str(r['n']) + 'x' + str(r['k']):<13} {r['rows']:>4} "
                f"{r['us']:>8.2f} {r['gbs']:>7.0f} {100 * r['frac_peak']:>5.1f}% {r.get('torch_gbs', ''):>10}"
            )
    sw = [r for r in RESULTS if r.get("model") == "sweep"]
    if sw:
        lines.append("")
        lines.append("bf16 sweep (batch 1), best 3 per shape:")
        for shape in dict.fromkeys((r["n"], r["k"]) for r in sw):
            best = sorted((r for r in sw if (r["n"], r["k"]) == shape), key=lambda r: r["us"])[:3]
            lines.append(
                f"  {shape[0]}x{shape[1]}: "
                + "; ".join(
                    f"t={r['threads']} rpb={r['rows_per_block']} u={r['unroll']} {r['us']:.2f}us {r['gbs']:.0f}GB/s"
                    for r in best
                )
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gemv_check_out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    K = Kernels(os.path.join(args.out, "kcache"))
    rng = np.random.default_rng(1234)
    guarded("prebuild", lambda: prebuild(K, args.quick))
    print(f"prebuild {time.time() - t0:.1f}s", flush=True)
    check_gemv(K, rng, args.quick)
    check_prologues(K, rng, args.quick)
    check_embed(K, rng)
    check_bandwidth(K, args.quick)
    check_fused_times(K, args.quick)
    sweep_bf16(K, args.quick)
    with open(os.path.join(args.out, f"{NAME}.json"), "w") as f:
        json.dump({"seconds": round(time.time() - t0, 1), "results": RESULTS}, f, indent=1)
    text = table()
    with open(os.path.join(args.out, f"{NAME}.txt"), "w") as f:
        f.write(text)
    print(text)
    print(f"total {time.time() - t0:.1f}s")
    return 0 if all(r.get("ok", True) for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
