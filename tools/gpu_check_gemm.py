"""Check and time the tensor-core gemm kernel: bf16 prefill, wide decode (split-K), fused GGUF.

Run on a GPU machine: ``PYTHONPATH=. python3 tools/gpu_check_gemm.py --out DIR [--quick]``.
Correctness: every variant (bf16 / f32 out, residual aliasing out, M and N tails, the wide-decode
tuning, every GGUF type with a decoder vs ``engine.quant.dequantize``) on fresh random inputs from
a fixed seed, outputs poisoned with NaN, relative L2 error against numpy (bf16 out: 1e-2, f32 out:
5e-3 -- inputs are bf16-rounded, so the error is accumulation order and the output rounding).
Timings (CUDA events, median after warm-up): TFLOP/s against the 787 TFLOP/s bf16 peak next to
torch.matmul on the same shape, for a sweep of tile configs per Qwen3-4B / 0.6B shape, so the best
can go into device_profiles/h200.yaml; the wide-decode configs in GB/s of weight bytes read (of
4100 GB/s) at M = 16..128; the fused quantised GEMM (q8_0, q4_k, q6_k) at M = 512 and 4096.
Writes DIR/gpu_check_gemm.json and DIR/gpu_check_gemm.txt; every check catches its own exception.
Uses torch only to allocate, time and as the matmul baseline (never imported by the engine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels_check import (  # noqa: E402
    DEV,
    Kernels,
    Recorder,
    bench,
    bf,
    bf_round,
    check,
    f32,
    host,
    nan_like,
    run_steps,
)

from engine import kernel_catalog as kc  # noqa: E402
from engine import quant  # noqa: E402
from engine.profile import get_profile  # noqa: E402

PROFILE = get_profile("h200")
TUNING = PROFILE.tuning
PEAK_TFLOPS = 787.0
PEAK_GBS = 4100.0
BUDGET_S = 80.0  # stop timing (not checking) past this many seconds
T0 = time.time()
RESULTS: list[dict] = []
KNOBS = kc.GEMM_KNOBS

# Qwen3-4B and Qwen3-0.6B linear shapes (n, k, residual): q|k|v, o_proj, gate|up, down
SHAPES_4B = [(6144, 2560, False), (2560, 4096, True), (19456, 2560, False), (2560, 9728, True)]
SHAPES_06B = [(4096, 1024, False), (1024, 2048, True), (6144, 1024, False), (1024, 3072, True)]
# prefill sweep: (tile_m, tile_n, tile_k, stages, warps, warps_m, split_k, swizzle, fragbuf); the
# first is the first GPU run's best (padded smem, single-buffered fragments) as the baseline
PREFILL_CONFIGS = [
    (128, 128, 64, 3, 8, 2, 1, False, False),
    (128, 128, 64, 3, 8, 2, 1, True, False),
    (128, 128, 64, 3, 8, 2, 1, True, True),
    (128, 128, 64, 4, 8, 2, 1, True, True),
    (128, 128, 32, 4, 8, 2, 1, True, True),
    (128, 256, 64, 3, 8, 2, 1, True, True),  # 64x64 warp tiles from here on
    (256, 128, 64, 3, 8, 4, 1, True, True),
    (128, 128, 64, 4, 4, 2, 1, True, True),
    (64, 128, 64, 4, 4, 2, 1, True, True),  # warp 32x64: more blocks for n=1024/2560 at m=512
    (128, 64, 64, 4, 4, 2, 1, True, True),
    # grouped rasterisation (8 M tiles per group) on top: knobs ..., qprefetch, raster
    (128, 128, 64, 3, 8, 2, 1, True, True, False, True),
    (128, 128, 64, 4, 8, 2, 1, True, True, False, True),
    (256, 128, 64, 3, 8, 4, 1, True, True, False, True),
]
DECODE_CONFIGS = [
    (32, 32, 128, 6, 8, 2, 2, False, False),  # the first run's best
    (32, 32, 128, 6, 8, 2, 2, True, True),
    (32, 32, 128, 8, 8, 2, 2, True, True),
    (64, 32, 128, 4, 8, 2, 2, False, False),
    (64, 32, 128, 4, 8, 2, 2, True, True),
    (32, 64, 128, 4, 8, 2, 2, True, True),
    (16, 32, 256, 4, 8, 1, 4, True, True),
    (16, 16, 256, 4, 8, 1, 8, True, True),
    (16, 16, 256, 6, 8, 1, 8, True, True),  # n=2560: 160 blocks, 2 per SM resident, 40 KB of W in flight each
    (32, 16, 256, 4, 8, 2, 4, True, True),
]


def elapsed() -> float:
    return time.time() - T0


def cs(cfg) -> str:
    """Compact config name: tile_m x tile_n x tile_k / stages / warps / warps_m / split_k (+sw, +fb)."""
    c = cfg_dict(cfg)
    flags = "".join(
        f"+{t}"
        for t, x in (("sw", "swizzle"), ("fb", "fragbuf"), ("qp", "qprefetch"), ("r", "raster"))
        if c[x]
    )
    return f"{c['tile_m']}x{c['tile_n']}x{c['tile_k']}/s{c['stages']}/w{c['warps']}/wm{c['warps_m']}/k{c['split_k']}{flags}"


def cfg_dict(cfg) -> dict:
    """Config tuple -> knobs; trailing bools left out are False."""
    cfg = tuple(cfg)
    return dict(zip(KNOBS, cfg + (False,) * (len(KNOBS) - len(cfg)), strict=True))


def section_cfg(section: str) -> tuple:
    t = {"warps_m": 2, "split_k": 1, **TUNING[section]}
    return tuple(t[x] for x in KNOBS)


def quant_cfgs() -> list[tuple]:
    """The profile's prefill config and with tile_k 64, each also swizzled + double-buffered, and
    with the W-tile register prefetch on top."""
    pre = cfg_dict(section_cfg("gemm"))
    out = [pre, {**pre, "tile_k": 64}]
    out += [{**c, "swizzle": True, "fragbuf": True} for c in out]
    out += [{**c, "qprefetch": True} for c in out[2:]]
    return list(dict.fromkeys(tuple(c[x] for x in KNOBS) for c in out))


def choice(n, k, cfg, **kw) -> kc.KernelChoice:
    """The gemm choice for config ``cfg`` (tile_k adjusted by gemm_params when k needs it)."""
    return kc.choice("gemm", **kc.gemm_params(n, k, {"gemm": cfg_dict(cfg)}, **kw))


_REC = Recorder(RESULTS, "check")
record, guarded = _REC.record, _REC.guarded


# ---- random weights in a storage type: (raw bytes on the device, dequantised f64 on the host) ----

KQUANT_F16 = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def random_weight(qt: str, n: int, k: int, rng, host_ref: bool = True):
    if qt in quant.REPACKED_FROM:  # a device layout: the file type's weight, repacked as at upload
        w, deq = random_weight(quant.REPACKED_FROM[qt], n, k, rng, host_ref)
        return torch.from_numpy(quant.repack(w.cpu().numpy(), qt, n, k).copy()).to(DEV), deq
    if qt == "bf16":
        w = bf_round(rng.standard_normal((n, k)) * 0.05)
        return bf(w), w
    if qt in KQUANT_F16:  # random bytes with sane f16 scales (no K-quant quantiser exists)
        elems, nbytes = kc.QUANTS[qt]
        nb = n * k // elems
        raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
        for off in KQUANT_F16[qt]:
            raw[:, off : off + 2] = (
                (rng.uniform(0.2, 1.0, nb) * 0.002).astype(np.float16).view(np.uint8).reshape(nb, 2)
            )
        raw = raw.reshape(-1)
    else:  # round-to-nearest quantisation of a normal matrix (byte-identical to gguf.quants.quantize)
        raw = np.frombuffer(
            quant.quantize_reference(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qt), np.uint8
        )
    deq = quant.dequantize(raw, qt, (n, k)).astype(np.float64) if host_ref else None
    return torch.from_numpy(raw.copy()).to(DEV), deq


def run(K: Kernels, c: kc.KernelChoice, out, a, w, residual, m: int) -> None:
    K.launch(c, [out, a, w, residual if residual is not None else 0, m], m)


def bench_graph(fns, reps: int = 10) -> float:
    """Median milliseconds per call of the callables ``fns``, captured back to back into one CUDA
    graph (no Python launch overhead between kernels; cycling through several weight copies keeps a
    memory-bound kernel from reading a weight out of the 50 MB L2). Falls back to timing each call
    eagerly when capture fails."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in fns:
                fn()
        return bench(g.replay, reps) / len(fns)
    except Exception as exc:  # capture not possible here: eager timing (includes launch gaps)
        print(f"graph capture failed ({exc}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        return bench(lambda: [fn() for fn in fns], reps) / len(fns)


# ---- correctness ----


def check_one(K, rng, m, n, k, cfg, *, residual=False, out_dtype="bf16", qt="bf16", label=""):
    c = choice(n, k, cfg, residual=residual, out_dtype=out_dtype, quant=qt)
    a = bf_round(rng.standard_normal((m, k)))
    wd, w = random_weight(qt, n, k, rng)
    ref = a @ w.T
    tdt = torch.float32 if out_dtype == "f32" else torch.bfloat16
    if residual:  # h = h + o: the residual aliases out
        r = rng.standard_normal((m, n))
        if out_dtype == "bf16":
            r = bf_round(r)
        out = (f32(r) if out_dtype == "f32" else bf(r)).to(tdt)
        ref = ref + r
        res = out
    else:
        out, res = nan_like((m, n), tdt), None
    run(K, c, out, bf(a), wd, res, m)
    tol = 5e-3 if out_dtype == "f32" else 1e-2
    record(
        f"check {label} {qt} m={m} n={n} k={k} res={int(residual)} out={out_dtype}",
        host(out),
        ref,
        tol,
        entry=c.spec.entry,
        smem=c.smem,
    )


def correctness_cases() -> list[dict]:
    pre, dec = section_cfg("gemm"), section_cfg("gemm_decode")
    cases = [dict(m=513, n=2560, k=9728, cfg=pre, residual=True, label="prefill 4B down")]
    for m in (1, 7, 100, 513):  # M tails; n=1000 is not a multiple of tile_n, 999 is odd
        cases.append(dict(m=m, n=1000, k=512, cfg=pre, residual=m % 2 == 1, label="prefill"))
    cases.append(dict(m=130, n=999, k=256, cfg=pre, label="prefill odd-n"))
    cases.append(dict(m=300, n=576, k=1536, cfg=pre, residual=True, out_dtype="f32", label="prefill"))
    cases.append(dict(m=64, n=1000, k=512, cfg=pre, out_dtype="f32", label="prefill"))
    for m in (16, 33, 100, 128):
        cases.append(dict(m=m, n=2560, k=1024, cfg=dec, residual=True, label="decode"))
    cases.append(dict(m=48, n=1000, k=512, cfg=dec, out_dtype="f32", residual=True, label="decode"))
    for cfg in PREFILL_CONFIGS + DECODE_CONFIGS:  # every swept config, once, with a tail
        cases.append(dict(m=77, n=1040, k=1024, cfg=cfg, residual=True, label=f"cfg {cs(cfg)}"))
    # swizzled smem + double-buffered fragments: tails, odd n, f32 out, tile_k 32 / 64 / 128
    spre, sdec = swz(pre), swz(dec)
    cases.append(dict(m=513, n=2560, k=9728, cfg=spre, residual=True, label="sw prefill 4B down"))
    cases.append(dict(m=130, n=999, k=256, cfg=spre, label="sw prefill odd-n"))
    cases.append(dict(m=300, n=576, k=1536, cfg=spre, residual=True, out_dtype="f32", label="sw prefill"))
    cases.append(dict(m=7, n=1000, k=512, cfg=swz(pre, tile_k=32), residual=True, label="sw tk32 prefill"))
    for m in (513, 1100, 2100):  # raster: one partial group, 8 + 1 and 16 + 1 M tiles
        cases.append(dict(m=m, n=1000, k=512, cfg=swz(pre, raster=True), residual=m == 1100, label="raster"))
    for m in (16, 100):
        cases.append(dict(m=m, n=2560, k=1024, cfg=sdec, residual=True, label="sw decode"))
    cases.append(dict(m=48, n=1000, k=512, cfg=sdec, out_dtype="f32", residual=True, label="sw decode"))
    for qt in kc.QUANTS:  # every GGUF type the catalog has a decoder for
        if qt == "bf16":
            continue
        for m in (1, 100, 513):
            cases.append(dict(m=m, n=576, k=1024, cfg=pre, qt=qt, residual=m == 100, label="prefill"))
        cases.append(dict(m=100, n=576, k=1024, cfg=spre, qt=qt, residual=True, label="sw prefill"))
        qp = swz(pre, qprefetch=True)
        for m in (7, 513):
            cases.append(dict(m=m, n=576, k=1024, cfg=qp, qt=qt, residual=m == 7, label="qp prefill"))
        cases.append(
            dict(m=300, n=1000, k=2048, cfg=swz(pre, tile_k=128, qprefetch=True), qt=qt, label="qp tk128")
        )
        cases.append(dict(m=40, n=1000, k=512, cfg=dec, qt=qt, label="decode"))
    return cases


def swz(cfg: tuple, **over) -> tuple:
    """``cfg`` with swizzled smem and double-buffered fragments (plus any knob overrides)."""
    c = {**cfg_dict(cfg), "swizzle": True, "fragbuf": True, **over}
    return tuple(c[x] for x in KNOBS)


def correctness(K, quick):
    for case in correctness_cases():
        case = dict(case)
        m, n, k, cfg = case.pop("m"), case.pop("n"), case.pop("k"), case.pop("cfg")
        guarded(
            f"check {case.get('label')} m={m} n={n}",
            lambda m=m, n=n, k=k, cfg=cfg, case=case: check_one(
                K, np.random.default_rng(1000 + m + n), m, n, k, cfg, **case
            ),
        )


# ---- timing ----


def time_prefill(K, quick):
    ms_list = (512, 4096) if quick else (512, 2048, 4096)
    for n, k, residual in SHAPES_4B + SHAPES_06B:
        for m in ms_list:
            if elapsed() > BUDGET_S:
                record(f"prefill m={m} n={n} k={k}", skipped="time budget")
                continue
            a = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            w = (torch.randn(n, k, device=DEV) * 0.05).to(torch.bfloat16)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            tms = bench_graph([lambda a=a, w=w: torch.matmul(a, w.T)] * 3)
            fl = 2 * m * n * k
            best = None
            for cfg in PREFILL_CONFIGS:

                def one(cfg=cfg, a=a, w=w, out=out, m=m, n=n, k=k, residual=residual, fl=fl, tms=tms):
                    c = choice(n, k, cfg, residual=residual)
                    ms = bench_graph([lambda: run(K, c, out, a, w, out if residual else None, m)] * 3)
                    tf = fl / ms / 1e9
                    record(
                        f"prefill m={m} n={n} k={k} cfg={cs(cfg)}",
                        m=m,
                        n=n,
                        k=k,
                        cfg=list(cfg),
                        ms=ms,
                        TFLOPs=tf,
                        peak_frac=tf / PEAK_TFLOPS,
                        torch_TFLOPs=fl / tms / 1e9,
                        of_torch=tms / ms,
                    )
                    return tf

                before = len(RESULTS)
                guarded(f"prefill m={m} n={n} k={k} cfg={cs(cfg)}", one)
                row = RESULTS[before] if len(RESULTS) > before else {}
                if "TFLOPs" in row and (best is None or row["TFLOPs"] > best[1]):
                    best = (cfg, row["TFLOPs"])
            if best:
                record(
                    f"BEST prefill m={m} n={n} k={k}",
                    best_cfg=cs(best[0]),
                    TFLOPs=best[1],
                    torch_TFLOPs=fl / tms / 1e9,
                    of_torch=best[1] / (fl / tms / 1e9),
                )


def time_decode(K, quick):
    for n, k, residual in SHAPES_4B:
        wbytes = n * k * 2
        copies = max(4, -(-200_000_000 // wbytes))  # > 4x the L2 in flight per graph replay
        ws = [(torch.randn(n, k, device=DEV) * 0.05).to(torch.bfloat16) for _ in range(copies)]
        for m in (16, 32, 64, 128):
            if elapsed() > BUDGET_S:
                record(f"decode m={m} n={n} k={k}", skipped="time budget")
                continue
            a = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            out = torch.randn(m, n, device=DEV).to(torch.bfloat16)
            tms = bench_graph([lambda a=a, w=w: torch.matmul(a, w.T) for w in ws])
            for cfg in DECODE_CONFIGS:

                def one(
                    cfg=cfg, a=a, out=out, m=m, n=n, k=k, residual=residual, ws=ws, wbytes=wbytes, tms=tms
                ):
                    c = choice(n, k, cfg, residual=residual)
                    ms = bench_graph(
                        [lambda w=w: run(K, c, out, a, w, out if residual else None, m) for w in ws]
                    )
                    gbs = wbytes / ms / 1e6
                    record(
                        f"decode m={m} n={n} k={k} cfg={cs(cfg)}",
                        m=m,
                        n=n,
                        k=k,
                        cfg=list(cfg),
                        ms=ms,
                        GBs=gbs,
                        bw_frac=gbs / PEAK_GBS,
                        torch_GBs=wbytes / tms / 1e6,
                        of_torch=tms / ms,
                    )

                guarded(f"decode m={m} n={n} k={k} cfg={cs(cfg)}", one)
        ws.clear()
        torch.cuda.empty_cache()


def time_quant(K, quick):
    rng = np.random.default_rng(7)
    cfgs = quant_cfgs()
    for qt in ("q8_0", "q4_k", "q6_k"):
        if qt not in kc.QUANTS:
            record(f"quant {qt}", ok=False, error="no decoder in kernel_catalog.QUANTS")
            continue
        for n, k, residual in SHAPES_4B:
            wd, _ = random_weight(qt, n, k, rng, host_ref=False)
            for m in (512, 4096):
                if elapsed() > BUDGET_S:
                    record(f"quant {qt} m={m} n={n} k={k}", skipped="time budget")
                    continue
                a = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
                wb = (torch.randn(n, k, device=DEV) * 0.05).to(torch.bfloat16)
                tms = bench_graph([lambda a=a, wb=wb: torch.matmul(a, wb.T)] * 2)
                fl = 2 * m * n * k
                for cfg in cfgs:

                    def one(
                        cfg=cfg, qt=qt, a=a, out=out, wd=wd, m=m, n=n, k=k, residual=residual, fl=fl, tms=tms
                    ):
                        c = choice(n, k, cfg, residual=residual, quant=qt)
                        ms = bench_graph([lambda: run(K, c, out, a, wd, out if residual else None, m)] * 2)
                        tf = fl / ms / 1e9
                        record(
                            f"quant {qt} m={m} n={n} k={k} cfg={cs(cfg)}",
                            m=m,
                            n=n,
                            k=k,
                            cfg=list(cfg),
                            ms=ms,
                            TFLOPs=tf,
                            peak_frac=tf / PEAK_TFLOPS,
                            torch_bf16_TFLOPs=fl / tms / 1e9,
                        )

                    guarded(f"quant {qt} m={m} n={n} k={k} cfg={cs(cfg)}", one)


def precompile(K: Kernels, quick: bool) -> None:
    """Build every spec the timing uses in parallel (NVRTC misses), so timing is not compile-bound."""
    specs = []
    for n, k, res in SHAPES_4B + SHAPES_06B:
        specs += [choice(n, k, cfg, residual=res).spec for cfg in PREFILL_CONFIGS]
    for n, k, res in SHAPES_4B:
        specs += [choice(n, k, cfg, residual=res).spec for cfg in DECODE_CONFIGS]
        for qt in ("q8_0", "q4_k", "q6_k"):
            if qt in kc.QUANTS:
                for cfg in quant_cfgs():
                    specs.append(choice(n, k, cfg, residual=res, quant=qt).spec)
    for c in correctness_cases():
        kw = {x: c[x] for x in ("residual", "out_dtype") if x in c}
        specs.append(choice(c["n"], c["k"], c["cfg"], quant=c.get("qt", "bf16"), **kw).spec)
    stats = K.builder.build_all(list(dict.fromkeys(specs)), jobs=os.cpu_count() or 4, progress=None)
    record("precompile", specs=len(specs), compiled=stats.compiled, hits=stats.hits, seconds=elapsed())


def _best_overall(rows: list[dict], metric: str, ref: str) -> tuple[str, float, dict] | None:
    """The config with the best geometric mean of metric / ref over the shapes every config ran."""
    by_cfg: dict[str, dict[tuple, float]] = {}
    knobs: dict[str, dict] = {}
    for r in rows:
        if metric in r and ref in r and r.get(ref):
            by_cfg.setdefault(cs(r["cfg"]), {})[(r["m"], r["n"], r["k"])] = r[metric] / r[ref]
            knobs[cs(r["cfg"])] = cfg_dict(r["cfg"])
    if not by_cfg:
        return None
    common = set.intersection(*(set(v) for v in by_cfg.values()))
    if not common:
        return None
    score = {c: float(np.exp(np.mean([np.log(v[s]) for s in common]))) for c, v in by_cfg.items()}
    best = max(score, key=score.get)
    return best, score[best], knobs[best]


def headline(rows: list[dict]) -> str:
    """Best per prefill shape vs torch, best decode GB/s per (M, shape), best quant TFLOP/s, and the
    configs with the best geometric mean (what to put in device_profiles/h200.yaml)."""
    pre = [r for r in rows if r["check"].startswith("prefill ") and "TFLOPs" in r]
    dec = [r for r in rows if r["check"].startswith("decode ") and "GBs" in r]
    qua = [r for r in rows if r["check"].startswith("quant ") and "TFLOPs" in r]
    bad = [r["check"] for r in rows if r.get("ok") is False]
    checks = [r for r in rows if "ok" in r]
    out = [f"HEADLINE  checks: {len(checks) - len(bad)}/{len(checks)} ok; failing: {bad}"]
    base_p, base_d = cs(PREFILL_CONFIGS[0]), cs(DECODE_CONFIGS[0])

    def best_of(group, metric):
        best: dict[tuple, dict] = {}
        base: dict[tuple, float] = {}
        for r in group:
            key = (r.get("quant", ""), r["m"], r["n"], r["k"])
            if key not in best or r[metric] > best[key][metric]:
                best[key] = r
            if cs(r["cfg"]) in (base_p, base_d):
                base[key] = r[metric]
        return best, base

    b, base = best_of(pre, "TFLOPs")
    out.append(f"prefill bf16 (TFLOP/s; baseline = {base_p})")
    for (_, m, n, k), r in sorted(b.items(), key=lambda x: (x[0][2], x[0][3], x[0][1])):
        out.append(
            f"  m={m:5d} n={n:6d} k={k:5d}  best {r['TFLOPs']:6.1f} ({r['TFLOPs'] / PEAK_TFLOPS:.0%} peak)"
            f"  torch {r['torch_TFLOPs']:6.1f}  of_torch {r['of_torch']:.2f}"
            f"  baseline {base.get(('', m, n, k), float('nan')):6.1f}  cfg {cs(r['cfg'])}"
        )
    b, base = best_of(dec, "GBs")
    out.append(f"wide decode bf16 (weight GB/s of {PEAK_GBS:.0f}; baseline = {base_d})")
    for (_, m, n, k), r in sorted(b.items(), key=lambda x: (x[0][2], x[0][3], x[0][1])):
        out.append(
            f"  m={m:5d} n={n:6d} k={k:5d}  best {r['GBs']:6.0f} ({r['bw_frac']:.0%})  torch {r['torch_GBs']:6.0f}"
            f"  baseline {base.get(('', m, n, k), float('nan')):6.0f}  cfg {cs(r['cfg'])}"
        )
    for r in qua:
        r.setdefault("quant", r["check"].split()[1])
    b, _ = best_of(qua, "TFLOPs")
    out.append("quantised prefill (TFLOP/s, fused W-tile decode)")
    for (q, m, n, k), r in sorted(b.items()):
        out.append(
            f"  {q:5s} m={m:5d} n={n:6d} k={k:5d}  best {r['TFLOPs']:6.1f}"
            f"  torch bf16 {r['torch_bf16_TFLOPs']:6.1f}  cfg {cs(r['cfg'])}"
        )
    for name, group, metric, ref in (
        ("gemm", pre, "TFLOPs", "torch_TFLOPs"),
        ("gemm_decode", dec, "GBs", "torch_GBs"),
        ("gemm (quant)", qua, "TFLOPs", "torch_bf16_TFLOPs"),
    ):
        bo = _best_overall(group, metric, ref)
        if bo:
            yaml = ", ".join(f"{x}: {str(v).lower() if isinstance(v, bool) else v}" for x, v in bo[2].items())
            out.append(f"best overall {name}: {bo[0]}  (geomean {bo[1]:.3f} of torch)  yaml {{{yaml}}}")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    lines = [headline(rows), "", f"profile h200 gemm={TUNING['gemm']} gemm_decode={TUNING['gemm_decode']}"]
    keys = (
        "rel_err",
        "nans",
        "ok",
        "ms",
        "TFLOPs",
        "peak_frac",
        "torch_TFLOPs",
        "of_torch",
        "GBs",
        "bw_frac",
        "torch_GBs",
        "torch_bf16_TFLOPs",
        "best_cfg",
        "skipped",
        "error",
    )
    for r in rows:
        extra = " ".join(
            f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r
        )
        lines.append(f"{r['check'][:84]:84s} {extra}")
    bad = [r["check"] for r in rows if r.get("ok") is False]
    lines.append(f"{len(bad)} failing: {bad}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma list of: check,prefill,decode,quant")
    args = ap.parse_args()
    torch.zeros(1, device=DEV)
    from cuda.bindings import driver as drv

    check(drv.cuInit(0))
    print(torch.cuda.get_device_name(), file=sys.stderr)
    K = Kernels("/tmp/memra-kcache")
    guarded("precompile", lambda: precompile(K, args.quick))
    steps = {
        "check": lambda: correctness(K, args.quick),
        "prefill": lambda: time_prefill(K, args.quick),
        "decode": lambda: time_decode(K, args.quick),
        "quant": lambda: time_quant(K, args.quick),
    }
    return run_steps("gpu_check_gemm", steps, RESULTS, table, args, guarded)


if __name__ == "__main__":
    sys.exit(main())
