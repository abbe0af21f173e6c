"""Decode GEMV (and embed) on the GPU: correctness for every storage type and code path, bandwidth
per variant, fused prologues vs the separate kernels, quantised and small-shape sweeps.

Run on a GPU machine: ``PYTHONPATH=. python3 tools/gpu_check_gemv.py --out DIR [--quick] [--budget S]``.
Writes DIR/gpu_check_gemv.json (every row) and DIR/gpu_check_gemv.txt (headline table first).

* correctness: every kc.QUANTS type (weights = random GGUF bytes with sane f16 scales, dequantised
  by engine.quant as the reference), batch 1 (bmax 1), 3 and 8 (bmax 8), 13 (a bmax tail: two grid
  rows, the second partial), residual in place, f32 out, an odd n (column tail), on every code path:
  unstaged (unroll 4), staged, xsmem (x rows in shared memory), staged + prefetch (+ xsmem), raw-unit
  unroll 8 (q4_k, q5_k); both prologues (norm, silu) plain and with xsmem. Outputs are poisoned with
  NaN; fail on NaN or rel err > 1e-2. embed too.
* bandwidth: GB/s of weight bytes (and the fraction of 4100 GB/s) of the Qwen3-4B decode shapes for
  every type at batch 1 and 8, per variant (base = the default spec; xs, pf, u4, ...), the 0.6B
  lm_head for the headline types, bf16 for Qwen3-0.6B / SmolLM2 too. Each timed launch reads a
  different copy of the weight (copies cover > 256 MB, CUDA-graph replays) so the numbers are DRAM,
  not the 50 MB L2. torch.matmul (x @ W.T, bf16) is timed alongside the bf16 base.
* fused: rmsnorm / silu_mul kernel + plain gemv vs the prologue gemv (plain and xsmem), Qwen3-4B
  qkv, gate|up, down, batch 1 and 8, bf16 / q8_0 / q4_k / q6_k: the verdict for tuning.gemv.fuse_*.
* sweeps (batch 1): q8_0 / q4_k / q6_k / q4_0 threads x rows_per_block x xsmem x (prefetch | unroll)
  on 6144x2560; bf16 threads x rows_per_block x unroll on the small latency-bound shapes.
Timing sections run in that order and are skipped once --budget seconds (default 72) have passed;
--variants REGEX / --rows 1 narrow the bandwidth table to some variants / batch rows.
Each check catches its own exceptions (recorded as ok=false with the error). Needs torch (allocator,
CUDA-event timing, matmul baseline) and cuda.bindings; never imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels_check import (  # noqa: E402
    DEV,
    PROFILE,
    TUNING,
    Kernels,
    Recorder,
    bench,
    bf,
    bf_round,
    host,
    i32,
    nan_like,
    rel_err,
)

from engine import kernel_catalog as kc  # noqa: E402
from engine import quant  # noqa: E402
from engine.types import ConfigError  # noqa: E402

NAME = "gpu_check_gemv"
PEAK_GBS = 4100.0
SMS = PROFILE.sm_count  # the capped q8x grids of the bandwidth sweep: blocks per SM x SMS
TOL = {"bf16": 1e-2, "f32": 1e-2}
# q8x kernels against quant.q8x_round_trip: f32 out is tight (an f32-x kernel misses it by ~4e-3)
Q8X_TOL = {"bf16": 1e-2, "f32": 1e-4}
RESULTS: list[dict] = []
TYPES: list[str] = list(kc.QUANTS)  # the storage types checked and timed (--types narrows it)
SECTIONS: list[str] = ["bandwidth", "fused", "qsweep", "bsweep"]  # the timing sections (--sections)
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


_REC = Recorder(RESULTS, "kernel")
record, guarded = _REC.record, _REC.guarded


def random_weight(qt: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint8 bytes [n, row_bytes] in storage type qt, dequantised f64 [n, k])."""
    if qt in quant.REPACKED_FROM:  # a device layout: the file type's weight, repacked as at upload
        raw, deq = random_weight(quant.REPACKED_FROM[qt], n, k, rng)
        return quant.repack(raw, qt, n, k).reshape(n, -1), deq
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


# the classic gemv layout whatever the profile's gemv_coop says (coop variants ask for coop=True)
CLASSIC = {**TUNING, "gemv_coop": {**TUNING["gemv_coop"], "types": []}}


def gemv_choice(qt, n, k, *, bmax, residual=False, od="bf16", stage=None, **knobs):
    p = kc.linear_params(qt, n, k, CLASSIC, residual=residual, out_dtype=od, bmax=bmax, stage=stage)
    if knobs.get("coop"):
        p.update(stage=False, xsmem=False, xf32=False, prefetch=False, pipeline=False)
        p["coop"] = True
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
NEW_CASES = (CASES[1], CASES[2], CASES[3], CASES[6])


RAW_TYPES = ("q4_k", "q5_k")  # decoders with load_raw/decode_raw (unroll = units in flight)


CHECKS = ""  # --checks: a regex over a gemv variant's knobs ("" = every variant)


def gemv_variants(qt, k=2560):
    """(stage, knobs) of the code paths to check: unstaged unroll 1/4, staged, and the options
    (xsmem, prefetch, raw-unit unroll 8) with a smaller case list."""
    out = [(False, {"unroll": 4}, CASES)]
    stageable = qt not in ("f32",) + tuple(kc.COOP_LAYOUTS.values())  # planes are not chunks of blocks
    if stageable:
        out.append((True, {"unroll": 2}, CASES))
    st = kc.STAGED_DEFAULT[qt]
    out.append((st, {"xsmem": True}, NEW_CASES))
    out.append((st, {"xsmem": True, "xf32": True}, NEW_CASES))
    if qt in kc.COOP_TYPES:  # the warp-cooperative layout: rows per warp 1 and 4, unroll 1 and 4
        for t, rpw, u in ((128, 1, 4), (256, 4, 1), (64, 2, 2)):
            coop = {"coop": True, "threads": t, "rows_per_block": t // 32 * rpw, "unroll": u}
            out.append((False, coop, CASES))
        coop = {"coop": True, "threads": 128, "rows_per_block": 8, "unroll": 2, "xsmem": True}
        out.append((False, coop, CASES))  # x rows staged in shared memory
        for t, rpw, u in ((128, 2, 2), (64, 1, 1)):  # the next segments' loads before the FMAs
            coop = {"coop": True, "threads": t, "rows_per_block": t // 32 * rpw, "unroll": u, "pipeline": True}
            out.append((False, coop, CASES))
    if qt in kc.Q8X_TYPES:  # int8 x rows and __dp4a (checked against quant.q8x_round_trip)
        for t, rpw, u, pipe in ((128, 2, 2, True), (128, 1, 4, False), (256, 4, 1, True), (64, 2, 2, False)):
            q8 = {"coop": True, "threads": t, "rows_per_block": t // 32 * rpw, "unroll": u, "pipeline": pipe, "q8x": True}
            out.append((False, q8, CASES))
        # k split over warp groups (partial sums in shared memory) and capped grids (a block loops
        # over several row tiles: 3 and 5 blocks for the check's rows)
        for t, rpw, u, ks, cap in ((256, 2, 2, 2, 0), (256, 2, 2, 4, 5), (128, 2, 2, 1, 3), (256, 1, 4, 8, 0)):
            q8 = {"coop": True, "threads": t, "rows_per_block": t // 32 // ks * rpw, "unroll": u, "pipeline": True,
                  "q8x": True, "ksplit": ks, "grid_cap": cap}
            out.append((False, q8, CASES))
            if ks > 1 and cap:  # the residual of a block's first tile read after pdl_wait (its later tiles: not)
                out.append((False, {**q8, "early_res": True}, CASES))
        # lanes per row (32 / lanes lane groups per warp, each with its rows), with the pipeline,
        # next-tile loads and capped grids; whole steps on every lane or not, with the k split
        for t, rpw, ln, ks, cap in ((512, 1, 16, 1, 5), (256, 1, 8, 1, 5), (640, 1, 16, 2, 3), (640, 1, 8, 4, 0)):
            q8 = {"coop": True, "threads": t, "rows_per_block": t // 32 // ks * (32 // ln) * rpw, "unroll": 2,
                  "pipeline": True, "tile_pf": True, "q8x": True, "ksplit": ks, "grid_cap": cap, "lanes": ln}
            out.append((False, q8, CASES))
        # the row tile bulk-copied into shared memory (wsm): one tile per block, a capped grid (the
        # next tile's copy once the current one is read), 8 lanes with the k split
        for t, rpw, ln, ks, cap in ((256, 1, 8, 1, 0), (256, 2, 32, 1, 3), (640, 1, 8, 4, 2)):
            q8 = {"coop": True, "threads": t, "rows_per_block": t // 32 // ks * (32 // ln) * rpw, "unroll": 2,
                  "pipeline": True, "q8x": True, "ksplit": ks, "grid_cap": cap, "lanes": ln, "wsm": True}
            out.append((False, q8, CASES))
            # the same tile copied in k chunks, one mbarrier each (wsm_chunk: the lanes' step or
            # whole super-blocks, whichever is longer; the last chunk shorter where k does not divide)
            wc = kc.wsm_chunk_elems(kc.coop_step_elems({**q8, "quant": qt}), k, kc.WSM_CHUNKS_MAX)
            if wc:
                out.append((False, {**q8, "wsm_chunk": wc}, CASES))
            if ks > 1:
                out.append((False, {**q8, "early_res": True}, CASES))
        for sr in (2, 6):  # x loads of several staging rounds in flight (b8: 10 rounds, a partial batch)
            q8 = {"coop": True, "threads": 256, "rows_per_block": 16, "unroll": 2, "pipeline": True, "q8x": True,
                  "grid_cap": 5, "stage_rounds": sr}
            out.append((False, q8, CASES))
    if qt in kc.COOP_TYPES:  # ksplit and grid_cap on the f32-x coop path too
        coop = {"coop": True, "threads": 128, "rows_per_block": 4, "unroll": 2, "pipeline": True, "ksplit": 2, "grid_cap": 3}
        out.append((False, coop, NEW_CASES))
    if stageable:
        out.append((True, {"prefetch": True}, NEW_CASES))
        out.append((True, {"prefetch": True, "xsmem": True}, NEW_CASES))
    if qt in RAW_TYPES:
        out.append((False, {"unroll": 8, "xsmem": True}, NEW_CASES))
    return out


def gemv_case(K, rng, qt, raw_t, deq, n, k, rows, bmax, residual, od, stage, knobs):
    c = gemv_choice(qt, n, k, bmax=bmax, residual=residual, od=od, stage=stage, **knobs)
    x = bf_round(rng.standard_normal((rows, k)))
    r = bf_round(rng.standard_normal((rows, n)))
    if residual:
        out = bf(r)  # the residual aliases out (in place, as the plan does)
    else:
        out = nan_like((rows, n), torch.float32 if od == "f32" else torch.bfloat16)
    K.launch(c, [out, raw_t, bf(x), out if residual else 0, rows], rows)
    ref = x @ deq.T + (r if residual else 0)
    got = host(out)
    tol, extra = TOL[od], {}
    if knobs.get("q8x"):  # the exact twin (int8 x rows), tight for f32 out; the f32-x error recorded
        extra = dict(q8x=True, f32x_rel_err=rel_err(np.nan_to_num(got), ref))
        ref = quant.q8x_round_trip(x).astype(np.float64) @ deq.T + (r if residual else 0)
        tol = Q8X_TOL[od]
    record(
        c.spec.entry,
        got,
        ref,
        tol,
        **extra,
        check="gemv",
        quant=qt,
        k=k,
        rows=rows,
        bmax=bmax,
        residual=residual,
        out_dtype=od,
        stage=c.spec.params["stage"],
        unroll=c.spec.params["unroll"],
        xsmem=c.spec.params["xsmem"],
        prefetch=c.spec.params["prefetch"],
        xf32=c.spec.params["xf32"],
        grid_cap=c.spec.params["grid_cap"],
    )


def check_shapes(qt) -> list[tuple[int, int]]:
    """(n, k) of a type's correctness checks: an odd n (the last block's column tail), k 2560; the
    q4_0r / q4_1r planes also at SmolLM2's k = 576, whose rows are padded to 16 bytes."""
    return [(1003, 2560)] + ([(1003, 576)] if qt in ("q4_0r", "q4_1r") else [])


def check_gemv(K, rng, quick):
    for qt in TYPES:
        for n, k in check_shapes(qt):

            def one(qt=qt, n=n, k=k):
                raw, deq = random_weight(qt, n, k, rng)
                raw_t = torch.from_numpy(raw).to(DEV)
                for stage, knobs, cases in gemv_variants(qt, k):
                    if CHECKS and not re.search(CHECKS, str(knobs)):
                        continue
                    for rows, bmax, residual, od in cases[:3] if quick else cases:
                        guarded(
                            f"gemv {qt} k={k} rows={rows} stage={stage} {knobs}",
                            lambda a=(rows, bmax, residual, od, stage, knobs): gemv_case(
                                K, rng, qt, raw_t, deq, n, k, *a
                            ),
                        )

            guarded(f"gemv {qt} k={k} setup", one)


def prologue_case(K, rng, qt, raw_t, deq, n, k, rows, bmax, od, pro, xsmem=False):
    """xsmem: False, True (bf16 rows in shared memory) or "f32" (xsmem + xf32)."""
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
        residual = od == "bf16"  # the down projection adds the residual; an f32 out cannot alias it
    q8 = xsmem in ("coopq8", "coopq8r", "coopq8l", "coopq8n")
    if xsmem in ("coop", "coopxs") or q8:  # the warp-cooperative layout with the prologue
        xo = {"coop": True, "threads": 128, "rows_per_block": 8, "unroll": 2, "xsmem": xsmem == "coopxs"}
        xo["pipeline"] = xsmem != "coopxs"  # the prologue with and without the load pipeline
        if q8:
            xo["q8x"] = True
        if xsmem == "coopq8r":  # several rounds of x loads in flight while staging, a capped grid
            xo.update(stage_rounds=3, grid_cap=7)
        if xsmem == "coopq8l":  # 8 lanes per row, next-tile loads, a capped grid
            xo.update(threads=256, rows_per_block=32, lanes=8, tile_pf=True, grid_cap=7)
        if xsmem == "coopq8n":  # the norm weights loaded before pdl_wait (batch 1: one staging round)
            xo.update(threads=320, rows_per_block=40, lanes=8, early_nw=True)
    else:
        xo = {"xsmem": bool(xsmem), "xf32": xsmem == "f32"}
    c = gemv_choice(qt, n, k, bmax=bmax, residual=residual, od=od, **xo, **knobs)
    r = bf_round(rng.standard_normal((rows, n)))
    out = bf(r) if residual else nan_like((rows, n), torch.float32 if od == "f32" else torch.bfloat16)
    args = [out, raw_t, bf(x), out if residual else 0, rows]
    if pro == "norm":
        args.append(torch.from_numpy(nw).to(DEV))
    K.launch(c, args, rows)
    ref = xin @ deq.T + (r if residual else 0)
    got = host(out)
    tol, extra = TOL[od], {}
    if q8:  # q8x: the twin on the prologue's bf16 output (a flipped bf16
        # rounding costs ~1e-4); the f32-x reference misses an int8-x kernel by ~1e-2 (2026-12-03:
        # the q4_1r silu cases of coopq8r at 0.0124 / 0.0111 against it)
        extra = dict(q8x=True, f32x_rel_err=rel_err(np.nan_to_num(got), ref))
        ref = quant.q8x_round_trip(xin).astype(np.float64) @ deq.T + (r if residual else 0)
        tol = 1e-3 if od == "f32" else TOL[od]
    record(
        c.spec.entry,
        got,
        ref,
        tol,
        **extra,
        check=f"gemv_{pro}",
        quant=qt,
        rows=rows,
        bmax=bmax,
        residual=residual,
        out_dtype=od,
        stage=c.spec.params["stage"],
        xsmem=c.spec.params["xsmem"],
        prefetch=c.spec.params["prefetch"],
        xf32=c.spec.params["xf32"],
    )


PRO_CASES = ((1, 1, "bf16"), (1, 1, "f32"), (3, 8, "bf16"), (8, 8, "f32"), (13, 8, "bf16"))
PRO_XS = (PRO_CASES[0], PRO_CASES[1], PRO_CASES[3], PRO_CASES[4])  # the cases also run with xsmem
PRO_XS32 = (PRO_CASES[1], PRO_CASES[4])  # ... and with xsmem + xf32
PRO_PLAIN = (PRO_CASES[0], PRO_CASES[1], PRO_CASES[4])  # the cases without xsmem


def check_prologues(K, rng, quick):
    n, k = 1003, 2560
    for qt in TYPES:

        def one(qt=qt):
            raw, deq = random_weight(qt, n, k, rng)
            raw_t = torch.from_numpy(raw).to(DEV)
            for pro in ("norm", "silu"):
                coop = ("coop", "coopxs") if qt in kc.COOP_TYPES else ()
                q8 = ("coopq8", "coopq8r", "coopq8l", "coopq8n") if qt in kc.Q8X_TYPES else ()
                for xsmem in (False, True, "f32") + coop + q8:
                    if CHECKS and not re.search(CHECKS, str(xsmem)):
                        continue
                    for rows, bmax, od in PRO_CASES[:2] if quick else PRO_CASES:
                        if (rows, bmax, od) not in {False: PRO_PLAIN, True: PRO_XS, "f32": PRO_XS32}.get(xsmem, PRO_CASES):
                            continue
                        guarded(
                            f"gemv {qt} {pro} rows={rows} xsmem={xsmem}",
                            lambda a=(rows, bmax, od, pro, xsmem): prologue_case(
                                K, rng, qt, raw_t, deq, n, k, *a
                            ),
                        )

        guarded(f"gemv prologue {qt} setup", one)


def check_embed(K, rng):
    hidden, vocab, rows = 2560, 300, 7
    for qt in TYPES:

        def one(qt=qt):
            raw, deq = random_weight(qt, vocab, hidden, rng)
            c = kc.choice("embed", quant=qt, hidden=hidden, threads=TUNING["elementwise"]["threads"])
            ids = rng.integers(0, vocab, rows)
            out = nan_like((rows, hidden))
            K.launch(c, [out, torch.from_numpy(raw).to(DEV), i32(ids), rows], rows)
            record(c.spec.entry, host(out), bf_round(deq[ids]), 1e-2, check="embed", quant=qt)

        guarded(f"embed {qt}", one)


# ---- timing ----


_COPIES: dict = {}


def weight_copies(qt, n, k, min_bytes=256 << 20, max_copies=64):
    """Random weight bytes, enough copies that one pass over them does not fit in L2 (cached for the
    latest (type, n, k): the variants of one shape share them)."""
    key = (qt, n, k)
    if key not in _COPIES:
        _COPIES.clear()
        torch.cuda.empty_cache()
        elems, nbytes = kc.QUANTS[qt]
        size = n * quant.row_bytes(qt, k) if qt in quant.REPACKED_FROM else n * k // elems * nbytes
        copies = max(1, min(max_copies, -(-min_bytes // size)))
        ws = [torch.randint(0, 256, (size,), dtype=torch.uint8, device=DEV) for _ in range(copies)]
        if qt in F16_FIELDS:  # finite f16 scales (random bytes may be inf/NaN), as in real weights
            for w in ws:
                blk = w.view(-1, nbytes)
                for off in F16_FIELDS[qt]:
                    blk[:, off + 1] = 0x1C  # an f16 high byte: ~0.004..0.008
        _COPIES[key] = (ws, size)
    return _COPIES[key]


def bench_ms(fn, reps=20) -> float:
    """Median milliseconds of fn() (CUDA events) after warm-up."""
    return bench(fn, reps)


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


def separate_op(K, pro, k, rows, x):
    """The unfused decode: the rmsnorm / silu_mul kernel the prologue replaces, as a launch closure
    (its output is the plain gemv's x)."""
    if pro == "norm":
        c = kc.choice("rmsnorm", n=k, eps=1e-6, threads=TUNING["norm"]["threads"], residual=False)
        y, nw = torch.empty(rows, k, device=DEV, dtype=torch.bfloat16), torch.ones(k, device=DEV)
        K.fn(c)
        return y, lambda: K.launch(c, [y, x, 0, nw, rows], rows)
    c = kc.choice("silu_mul", inter=k, in_stride=2 * k, threads=TUNING["elementwise"]["threads"])
    y = torch.empty(rows, k, device=DEV, dtype=torch.bfloat16)
    K.fn(c)
    return y, lambda: K.launch(c, [y, x, x[:, k:], rows], rows)


def time_gemv(
    K, qt, n, k, rows, *, model="", od="bf16", torch_ref=False, variant="", separate=None, **knobs
) -> dict:
    """GB/s of weight bytes of one gemv spec (CUDA graph over the weight copies). separate="norm" /
    "silu": the plain gemv preceded by the rmsnorm / silu_mul kernel it would fuse (x = its input)."""
    bmax = 1 if rows == 1 else TUNING["gemv"]["max_batch"]
    c = gemv_choice(qt, n, k, bmax=bmax, od=od, **knobs)
    ws, size = weight_copies(qt, n, k)
    xs = c.spec.params["x_stride"] or k
    if separate == "silu":
        xs = 2 * k
    x = torch.randn(rows, xs, device=DEV).to(torch.bfloat16)
    out = torch.empty(rows, n, device=DEV, dtype=torch.float32 if od == "f32" else torch.bfloat16)
    extra = [torch.ones(k, device=DEV)] if c.spec.params["prologue"] == "norm" else []
    K.fn(c)  # compile/load outside the timing
    xin, pre = (x, None) if separate is None else separate_op(K, separate, k, rows, x)

    def run():
        for w in ws:
            if pre is not None:
                pre()
            K.launch(c, [out, w, xin, 0, rows, *extra], rows)

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
        "separate": separate or "",
        "variant": variant,
        **{
            x: c.spec.params[x]
            for x in ("threads", "rows_per_block", "unroll", "stage", "bmax", "xsmem", "prefetch", "xf32", "coop", "pipeline", "q8x", "ksplit", "grid_cap")
        },
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


HEADLINE_TYPES = ("q8_0", "q8_0r", "q4_k", "q6_k", "q6_kr", "q4_0", "q4_0r", "q4_1r")
# the types also timed on every SmolLM2-135M shape (its GGUF is q4_1; q4_0 is the sibling format)
SMOLLM2_TYPES = ("q4_0", "q4_1", "q4_0r", "q4_1r")
XSMEM_MAX = kc.GEMV_XSMEM_MAX


def xs_fits(qt, bmax, k, **knobs) -> bool:
    """Whether the spec is valid (its dynamic shared memory within kc.GEMV_XSMEM_MAX)."""
    try:
        gemv_choice(qt, 1024, k, bmax=bmax, **knobs)
        return True
    except ConfigError:
        return False


def timing_variants(qt, rows, k, full=True):
    """(name, knobs) of the gemv code paths timed per shape: the default spec first. xs: x rows in
    shared memory (bf16), xs32: as f32; pf: staged-path prefetch; u4/u8: raw-unit unroll."""
    bmax = 1 if rows == 1 else TUNING["gemv"]["max_batch"]
    planes = tuple(kc.COOP_LAYOUTS.values())
    st = {"stage": True} if qt not in ("bf16", "f16", "f32") + planes and qt not in RAW_TYPES else {}
    fits = xs_fits(qt, bmax, k, xsmem=True, **st)
    fits32 = xs_fits(qt, bmax, k, xsmem=True, xf32=True, **st)
    out = [("base", {})]
    if qt in ("f16", "f32"):
        return out  # the bf16 paths with another unpack: base only
    if qt == "bf16":
        extra = ({}, "")
    elif qt in RAW_TYPES or qt in planes:
        extra = ({"unroll": 4}, "+u4")
    else:
        extra = ({"stage": True, "prefetch": True}, "+pf")
    if full and extra[1]:
        out.append((extra[1][1:], extra[0]))
    if fits:
        out.append(("xs" + extra[1], {"xsmem": True, **extra[0]}))
    if fits32:
        out.append(("xs32" + extra[1], {"xsmem": True, "xf32": True, **extra[0]}))
    if full and qt in RAW_TYPES and fits32:
        out.append(("xs32+u8", {"xsmem": True, "xf32": True, "unroll": 8}))
    if qt in kc.COOP_TYPES:  # the warp-cooperative layout: threads, rows per warp, unroll
        for t, rpw, u in COOP_SWEEP if full else COOP_SWEEP[:2]:
            out.append((f"c{t}r{rpw}u{u}", {"coop": True, "threads": t, "rows_per_block": t // 32 * rpw, "unroll": u}))
        bmax = 1 if rows == 1 else TUNING["gemv"]["max_batch"]
        for t, rpw, u in COOP_SWEEP[1:3]:  # with the x rows in shared memory, where they fit
            if bmax * k * 2 <= kc.COOP_XSMEM_MAX:
                kn = {"coop": True, "threads": t, "rows_per_block": t // 32 * rpw, "unroll": u, "xsmem": True}
                out.append((f"c{t}r{rpw}u{u}xs", kn))
    if qt in kc.Q8X_TYPES:  # the f32 path with the load pipeline (the pre-q8x default), then q8x
        out.append(("c128r2u2p", {"coop": True, "threads": 128, "rows_per_block": 8, "unroll": 2, "pipeline": True}))
        for t, rpw, u in Q8X_SWEEP if full else Q8X_SWEEP[:2]:
            if bmax * k * 3 // 2 <= kc.COOP_Q8X_MAX:
                kn = {"coop": True, "threads": t, "rows_per_block": t // 32 * rpw, "unroll": u, "pipeline": True, "q8x": True}
                out.append((f"c{t}r{rpw}u{u}q8", kn))
        if bmax * k * 3 // 2 <= kc.COOP_Q8X_MAX:  # the profile's q8x shape with k split / capped grids
            for ks, bps in Q8X_SPLIT_SWEEP if full else Q8X_SPLIT_SWEEP[:3]:
                kn = {"coop": True, "threads": 256, "rows_per_block": 8 // ks * 2, "unroll": 2, "pipeline": True, "q8x": True,
                      "ksplit": ks, "grid_cap": bps * SMS}
                out.append((f"c256r2q8k{ks}g{bps}", kn))
    return out


# (ksplit, blocks per SM; 0 = uncapped) of the q8x shape c256r2u2
Q8X_SPLIT_SWEEP = ((1, 4), (2, 0), (1, 8), (2, 4), (4, 0), (4, 8), (1, 2), (2, 8))


Q8X_SWEEP = ((128, 2, 2), (128, 4, 2), (256, 2, 2), (128, 2, 4), (64, 4, 2))


COOP_SWEEP = ((128, 1, 4), (128, 2, 4), (128, 2, 2), (256, 1, 4), (64, 1, 8))


def bandwidth_jobs(quick):
    """(label, qt, n, k, rows, model, od, variant, knobs, torch_ref) of the bandwidth table."""
    jobs = []
    models = ["qwen3-4b"] if quick else list(SHAPES)
    for model in models:
        for i, (n, k) in enumerate(SHAPES[model]):
            od = "f32" if i == 4 else "bf16"
            for rows in (1, 8):
                for vname, kn in timing_variants("bf16", rows, k, full=model == "qwen3-4b"):
                    jobs.append(("bf16", n, k, rows, model, od, vname, kn, vname == "base"))
    for qt in TYPES:
        if qt == "bf16":
            continue
        head = qt in HEADLINE_TYPES
        shapes = [("qwen3-4b", sh) for sh in SHAPES["qwen3-4b"]]
        if head:
            shapes.append(("qwen3-0.6b", SHAPES["qwen3-0.6b"][4]))
        if qt in SMOLLM2_TYPES:
            shapes += [("smollm2-135m", sh) for sh in SHAPES["smollm2-135m"]]
        if quick:
            shapes = shapes[:1]
        for model, (n, k) in shapes:
            od = "f32" if n in (151936, 49152) else "bf16"
            for rows in (1, 8):
                for vname, kn in timing_variants(qt, rows, k, full=head):
                    jobs.append((qt, n, k, rows, model, od, vname, kn, False))
    return jobs


BANDWIDTH_FILTER: dict = {"variants": "", "rows": (1, 8)}  # --variants / --rows


def check_bandwidth(K, quick):
    pat = re.compile(BANDWIDTH_FILTER["variants"])
    for qt, n, k, rows, model, od, vname, kn, tref in bandwidth_jobs(quick):
        if not pat.search(vname) or rows not in BANDWIDTH_FILTER["rows"]:
            continue
        guarded(
            f"time {qt} {model} {n}x{k} rows={rows} {vname}",
            lambda a=(qt, n, k, rows, model, od, vname, kn, tref): time_gemv(
                K, a[0], a[1], a[2], a[3], model=a[4], od=a[5], variant=a[6], torch_ref=a[8], **a[7]
            ),
        )


FUSED_TIMES = (  # Qwen3-4B decode GEMVs with their prologue, next to rmsnorm/silu_mul + the plain gemv
    ("norm", 6144, 2560),
    ("norm", 19456, 2560),
    ("silu", 2560, 9728),
)


def fused_jobs(quick):
    jobs = []
    for qt in ("bf16",) if quick else ("bf16", "q8_0", "q4_k", "q6_k"):
        for pro, n, k in FUSED_TIMES:
            kn = {
                "prologue": pro,
                **({"eps": 1e-6, "x_stride": k} if pro == "norm" else {"x_stride": 2 * k, "u_off": k}),
            }
            for rows in (1, 8):
                bmax = 1 if rows == 1 else TUNING["gemv"]["max_batch"]
                # the separate kernels + each gemv variant, the fused prologue on each variant
                for vname, vk in dict.fromkeys(
                    [("base", ())]
                    + [(v, tuple(kv.items())) for v, kv in timing_variants(qt, rows, k, full=False)[-1:]]
                ):
                    vk = dict(vk)
                    jobs.append((qt, pro, n, k, rows, "sep " + vname, {**vk}, pro))
                    jobs.append((qt, pro, n, k, rows, "fused " + vname, {**vk, **kn}, None))
                    if not vk.get("xsmem"):
                        for xn, xo in (("xs", {"xsmem": True}), ("xs32", {"xsmem": True, "xf32": True})):
                            if xs_fits(qt, bmax, k, **{**vk, **xo}):
                                jobs.append(
                                    (qt, pro, n, k, rows, f"fused {xn}+{vname}", {**vk, **kn, **xo}, None)
                                )
    return jobs


def check_fused_times(K, quick):
    for qt, pro, n, k, rows, vname, kn, sep in fused_jobs(quick):
        guarded(
            f"time {qt} {pro} {n}x{k} rows={rows} {vname}",
            lambda a=(qt, n, k, rows, vname, kn, sep): time_gemv(
                K, a[0], a[1], a[2], a[3], model="fused", variant=a[4], separate=a[6], **a[5]
            ),
        )


QSWEEP_SHAPES = [(6144, 2560)]


def qsweep_jobs(quick):
    """Quantised batch-1 sweep: threads x rows_per_block x (xsmem, prefetch | unroll)."""
    jobs = []
    for qt in HEADLINE_TYPES[:1] if quick else HEADLINE_TYPES:
        for n, k in QSWEEP_SHAPES[:1] if quick else QSWEEP_SHAPES:
            for threads in (128, 256):
                for rpb in (1, 2, 4):
                    for xs in ({}, {"xsmem": True, "xf32": True}):
                        if qt in RAW_TYPES or qt in kc.COOP_LAYOUTS.values():  # (planes are never staged)
                            opts = [{"unroll": u} for u in (2, 4, 8)]
                        else:
                            opts = [{"stage": True, "prefetch": pf} for pf in (False, True)]
                        for o in opts:
                            jobs.append((qt, n, k, {"threads": threads, "rows_per_block": rpb, **xs, **o}))
    return jobs


def sweep_quant(K, quick):
    specs = [gemv_choice(qt, n, k, bmax=1, **kn).spec for qt, n, k, kn in qsweep_jobs(quick)]
    K.builder.build_all(list(dict.fromkeys(specs)), jobs=os.cpu_count() or 4, progress=None)
    for qt, n, k, kn in qsweep_jobs(quick):
        guarded(
            f"qsweep {qt} {n}x{k} {kn}",
            lambda a=(qt, n, k, kn): time_gemv(K, a[0], a[1], a[2], 1, model="qsweep", **a[3]),
        )


BSWEEP_SHAPES = [(1024, 2048), (576, 576)]  # the latency-bound small shapes (the big ones: run 1)


def bsweep_jobs(quick):
    jobs = []
    for n, k in BSWEEP_SHAPES[:1] if quick else BSWEEP_SHAPES:
        for threads in (128, 256, 512):
            for rpb in (1, 2, 4, 8):
                if rpb > threads // 32:
                    continue
                for unroll in (1, 2, 4):
                    jobs.append((n, k, {"threads": threads, "rows_per_block": rpb, "unroll": unroll}))
    return jobs


def sweep_bf16(K, quick):
    specs = [gemv_choice("bf16", n, k, bmax=1, **kn).spec for n, k, kn in bsweep_jobs(quick)]
    K.builder.build_all(list(dict.fromkeys(specs)), jobs=os.cpu_count() or 4, progress=None)
    for n, k, kn in bsweep_jobs(quick):
        guarded(
            f"sweep bf16 {n}x{k} {kn}",
            lambda a=(n, k, kn): time_gemv(K, "bf16", a[0], a[1], 1, model="sweep", **a[2]),
        )


def prebuild(K, quick):
    """Compile the checks' and tables' specs in parallel up front (the sweeps compile theirs when
    their section starts, so a spent time budget skips their compiles too)."""
    specs = []
    g = TUNING["gemv"]
    for qt in TYPES:  # the correctness cases (check_gemv, check_prologues, check_embed)
        specs.append(kc.choice("embed", quant=qt, hidden=2560, threads=TUNING["elementwise"]["threads"]).spec)
        for n, k in check_shapes(qt):
            for stage, knobs, cases in gemv_variants(qt, k):
                if CHECKS and not re.search(CHECKS, str(knobs)):
                    continue
                for _rows, bmax, residual, od in cases[:3] if quick else cases:
                    specs.append(
                        gemv_choice(qt, n, k, bmax=bmax, residual=residual, od=od, stage=stage, **knobs).spec
                    )
        for case in PRO_CASES[:2] if quick else PRO_CASES:
            _rows, bmax, od = case
            xvs = [x for x, cs in ((False, PRO_PLAIN), (True, PRO_XS), ("f32", PRO_XS32)) if case in cs]
            for xsmem in xvs:
                xo = {"xsmem": bool(xsmem), "xf32": xsmem == "f32"}
                specs.append(
                    gemv_choice(
                        qt, 1003, 2560, bmax=bmax, od=od, prologue="norm", x_stride=2560, eps=1e-6, **xo
                    ).spec
                )
                specs.append(
                    gemv_choice(
                        qt,
                        1003,
                        2560,
                        bmax=bmax,
                        residual=od == "bf16",
                        od=od,
                        prologue="silu",
                        x_stride=5120,
                        u_off=2560,
                        **xo,
                    ).spec
                )
    bm = lambda rows: 1 if rows == 1 else g["max_batch"]  # noqa: E731
    for qt, n, k, rows, _m, od, _v, kn, _t in bandwidth_jobs(quick) if "bandwidth" in SECTIONS else ():
        specs.append(gemv_choice(qt, n, k, bmax=bm(rows), od=od, **kn).spec)
    for qt, _pro, n, k, rows, _v, kn, _sep in fused_jobs(quick) if "fused" in SECTIONS else ():
        specs.append(gemv_choice(qt, n, k, bmax=bm(rows), **kn).spec)
    for k in (2560,):
        specs.append(
            kc.choice("rmsnorm", n=k, eps=1e-6, threads=TUNING["norm"]["threads"], residual=False).spec
        )
    specs.append(
        kc.choice("silu_mul", inter=9728, in_stride=2 * 9728, threads=TUNING["elementwise"]["threads"]).spec
    )
    specs = list(dict.fromkeys(specs))
    print(f"prebuild: {len(specs)} specs", flush=True)
    K.builder.build_all(specs, jobs=os.cpu_count() or 4, progress=None)


def _pct(r) -> str:
    return f"{100 * r['frac_peak']:.0f}%"


def _path(r) -> tuple:
    return (r.get("quant"), bool(r.get("xsmem")), bool(r.get("xf32")), bool(r.get("prefetch")))


def model_table(model: str, broken: set) -> list[str]:
    """Per type and batch: each decode shape of ``model`` (SHAPES) as base (default spec) -> best
    variant, % of 4100 GB/s, or for the small SmolLM2 shapes us per launch (BROKEN: a correctness
    check of that type with the same xsmem/xf32/prefetch failed)."""
    bw = [r for r in RESULTS if r.get("check") == "gemv_time" and r["model"] == model]
    us = model == "smollm2-135m"  # launch- and latency-bound: the time is the number to read
    names = ["qkv", "o", "gate|up", "down", "lm_head"]
    unit = "us per launch" if us else "% of 4100 GB/s of weight bytes"
    lines = [f"HEADLINE: {model} decode GEMVs, {unit}: base (default spec) -> best [variant]"]
    lines.append(
        f"{'type':<6} {'rows':>4}  "
        + "  ".join(f"{nm + ' ' + str(n) + 'x' + str(k):<32}" for nm, (n, k) in zip(names, SHAPES[model], strict=True))
    )
    for qt in ("bf16",) + HEADLINE_TYPES + tuple(q for q in kc.QUANTS if q not in HEADLINE_TYPES and q != "bf16"):
        for rows in (1, 8):
            cells = []
            for n, k in SHAPES[model]:
                rs = [r for r in bw if r["quant"] == qt and r["rows"] == rows and r["n"] == n and r["k"] == k]
                if not rs:
                    cells.append(f"{'-':<32}")
                    continue
                base = next((r for r in rs if r["variant"] == "base"), rs[0])
                best = max(rs, key=lambda r: r["gbs"])
                if us:
                    cell = f"{base['us']:.1f} -> {best['us']:.1f} [{best['variant']}]"
                else:
                    cell = f"{_pct(base)} -> {_pct(best)} [{best['variant']}]"
                if _path(best) in broken:
                    cell += " BROKEN"  # that code path failed a correctness check
                if qt == "bf16" and base.get("torch_gbs"):
                    cell += f" t{100 * base['torch_gbs'] / PEAK_GBS:.0f}%"
                cells.append(f"{cell:<32}")
            if any(c.strip() != "-" for c in cells):
                lines.append(f"{qt:<6} {rows:>4}  " + "  ".join(cells))
    return lines


def headline() -> list[str]:
    """The Qwen3-4B and SmolLM2-135M tables (model_table), then the fused-vs-separate verdicts."""
    broken = {_path(r) for r in RESULTS if r.get("ok") is False and "xsmem" in r}
    lines = model_table("qwen3-4b", broken) + [""] + model_table("smollm2-135m", broken)
    fz = [r for r in RESULTS if r.get("check") == "gemv_time" and r["model"] == "fused"]
    if fz:
        lines.append("")
        lines.append(
            "FUSED vs SEPARATE (us per decode step: separate = rmsnorm/silu_mul kernel + gemv; best of each)"
        )
        for key in dict.fromkeys(
            (
                r["quant"],
                r["prologue"] if r["prologue"] != "none" else r["separate"],
                r["n"],
                r["k"],
                r["rows"],
            )
            for r in fz
        ):
            qt, pro, n, k, rows = key
            rs = [
                r
                for r in fz
                if (r["quant"], r["n"], r["k"], r["rows"]) == (qt, n, k, rows)
                and pro in (r["prologue"], r["separate"])
            ]
            sep = [r for r in rs if r["separate"]]
            fus = [r for r in rs if r["prologue"] != "none"]
            if not sep or not fus:
                continue
            bs, bf_ = min(sep, key=lambda r: r["us"]), min(fus, key=lambda r: r["us"])
            verdict = "FUSE" if bf_["us"] < bs["us"] else "separate"
            lines.append(
                f"  {qt:<5} {pro:<4} {n}x{k} rows={rows}: separate {bs['us']:.2f}us [{bs['variant']}]  "
                f"fused {bf_['us']:.2f}us [{bf_['variant']}]  -> {verdict}"
            )
    return lines


def table() -> str:
    lines = headline() + [""]
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
        f"{'model':<13} {'type':<10} {'variant':<12} {'n x k':<13} {'rows':>4} {'us':>8} {'GB/s':>7} {'%4100':>6} {'torch GB/s':>10}"
    )
    for r in RESULTS:
        if r.get("check") == "gemv_time" and r["model"] not in ("sweep", "qsweep"):
            typ = r["quant"] + ("+" + r["prologue"] if r.get("prologue", "none") != "none" else "")
            if r.get("separate"):
                typ = r["separate"] + "+" + r["quant"]
            lines.append(
                f"{r['model']:<13} {typ:<10} {r.get('variant', ''):<12} "
                f"{str(r['n']) + 'x' + str(r['k']):<13} {r['rows']:>4} "
                f"{r['us']:>8.2f} {r['gbs']:>7.0f} {100 * r['frac_peak']:>5.1f}% {r.get('torch_gbs', ''):>10}"
            )
    for model, title in (("qsweep", "quantised sweep (batch 1)"), ("sweep", "bf16 sweep (batch 1)")):
        sw = [r for r in RESULTS if r.get("model") == model]
        if not sw:
            continue
        lines.append("")
        lines.append(f"{title}, best 4 per type and shape:")
        for key in dict.fromkeys((r["quant"], r["n"], r["k"]) for r in sw):
            best = sorted((r for r in sw if (r["quant"], r["n"], r["k"]) == key), key=lambda r: r["us"])[:4]
            lines.append(
                f"  {key[0]} {key[1]}x{key[2]}: "
                + "; ".join(
                    f"t={r['threads']} rpb={r['rows_per_block']} u={r['unroll']} st={int(r['stage'])} "
                    f"xs={int(r['xsmem'])}{'/f32' if r['xf32'] else ''} pf={int(r['prefetch'])} "
                    f"{r['us']:.2f}us {100 * r['frac_peak']:.0f}%"
                    for r in best
                )
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gemv_check_out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--budget", type=float, default=72.0, help="seconds after which timing sections are skipped"
    )
    ap.add_argument("--types", default="", help="comma-separated storage types (default: every kc.QUANTS type)")
    ap.add_argument("--sections", default="bandwidth,fused,qsweep,bsweep", help="timing sections to run, in order")
    ap.add_argument("--variants", default="", help="bandwidth: time only the variants whose name matches this regex")
    ap.add_argument("--rows", default="1,8", help="bandwidth: the batch rows timed (comma-separated)")
    ap.add_argument(
        "--checks", default="", help="only the gemv correctness variants whose knobs (prologue checks: "
        "whose layout label, e.g. coopq8n) match this regex; the embed check is then skipped"
    )
    args = ap.parse_args()
    global CHECKS
    CHECKS = args.checks
    BANDWIDTH_FILTER.update(variants=args.variants, rows=tuple(int(r) for r in args.rows.split(",")))
    if args.types:
        TYPES[:] = [t for t in args.types.split(",") if t in kc.QUANTS]
    SECTIONS[:] = args.sections.split(",")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    K = Kernels(os.path.join(args.out, "kcache"))
    rng = np.random.default_rng(1234)
    guarded("prebuild", lambda: prebuild(K, args.quick))
    print(f"prebuild {time.time() - t0:.1f}s", flush=True)
    check_gemv(K, rng, args.quick)
    check_prologues(K, rng, args.quick)
    if not CHECKS:
        check_embed(K, rng)
    print(f"correctness done {time.time() - t0:.1f}s", flush=True)
    # timing sections in priority order; a later one is skipped once the time budget is spent
    for name, fn in (
        ("bandwidth", check_bandwidth),
        ("fused", check_fused_times),
        ("qsweep", sweep_quant),
        ("bsweep", sweep_bf16),
    ):
        if name not in SECTIONS:
            continue
        if time.time() - t0 > args.budget:
            RESULTS.append({"kernel": f"section {name}", "skipped": f"time budget {args.budget}s spent"})
            print(f"skip {name}: budget spent", flush=True)
            continue
        fn(K, args.quick)
        print(f"{name} done {time.time() - t0:.1f}s", flush=True)
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
