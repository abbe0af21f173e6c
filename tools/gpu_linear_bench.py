"""Time the decode linear kernels per (storage type, shape, batch) against the copy bandwidth.

    PYTHONPATH=. python tools/gpu_linear_bench.py [--types bf16,q4_k,...] [--shapes 6144x2560,...]
        [--batches 1,2,4,8,...] [--iters 40] [--mma-variants 'depth=8;wk=2'] [--mmq-variants 'depth=4']
        [--mmq1-variants 'lanes=1;warps=16,depth=2'] [--json FILE]

For every storage type (uploaded in the layout the device profile picks: q8_0 -> q8_0r ...), every
weight shape NxK (out rows x in; default the Qwen3-4B linears: q|k|v, o, gate|up, down) and every
batch (default: the profile's CUDA-graph buckets) it times, with CUDA events over --iters launches
cycling through enough weight copies to defeat the 50 MB L2:

- ``mma``: the tensor-core decode linear (kernels/gemv_mma.cu.j2) with the params the plan gives
  that batch (engine.kernel_catalog.gemv_mma_params at the MMA_BUCKETS bmax; batch 1 runs the bmax-8
  kernel, as the plan does where gemv_mma serves a type: tuning gemv_mma.types);
- ``mmq``: the int8 tensor-core decode linear (kernels/gemv_mmq.cu.j2, q4_k / q6_k / q8_0 / q4_0 /
  q4_1) with the
  params engine.kernel_catalog.gemv_mmq_params gives that batch (bmax as gemv_mma's; the bmax-8
  kernel quantises its own x, xstage), the larger buckets each after their x quantiser (gemv_mmq_x:
  both timed, as a decode pass runs them; ``mmq-k``: the kernel alone); ``--mmq-variants`` may
  turn xstage off (``xstage=0``) to time the bmax-8 kernel on gemv_mmq_x's x; at 1-4 rows ``mmq`` is
  gemv_mmq1 (dp4a dots, the bmax-8 kernel's bits), as the plan runs it, and ``mmq8`` the bmax-8 kernel;
  ``--mmq1-variants`` times gemv_mmq1 geometries beside it (lanes, warps, depth, min_blocks,
  grid_cap: never a row's bits; wk, kparts: another k split, timing only);
- ``gemv``: the GEMV the plan uses without gemv_mma (gemv.max_batch rows per weight pass) and, at
  batch 1, the tuned batch-1 GEMV (no rmsnorm prologue, no pair);
- ``gemm``: the mma.sync GEMM with the gemm_decode tiling (bf16 wide buckets before), from
  gemm_decode.min_rows rows, where it has a decoder for the type.

Each row prints the time, the weight bytes / time in GB/s and that as a fraction of the measured
device-to-device copy bandwidth (bytes read + written per second, the profile's
memory_bandwidth_gbs convention) -- the roofline of a weight-streaming kernel. Activations (a few
hundred KB) are not counted. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1 << 20
L2_DEFEAT = 160 * MB  # weight copies cycled per kernel: at least this many bytes in all
SHAPES = "6144x2560,2560x4096,19456x2560,2560x9728,9728x2560"
TYPES = "bf16,q8_0,q4_0,q4_1,q5_0,q5_1,q4_k,q5_k,q6_k"


def copy_bandwidth(cuda, stream) -> float:
    """Device-to-device copy GB/s ((read + written) bytes / s), the best of 5 copies of 512 MB."""
    n = 512 * MB
    a, b = cuda.alloc(n), cuda.alloc(n)
    e0, e1 = cuda.Event(), cuda.Event()
    best = 0.0
    for _ in range(6):
        e0.record(stream)
        cuda.dtod(b.ptr, a.ptr, n, stream)
        e1.record(stream)
        e1.synchronize()
        best = max(best, 2 * n / (e1.elapsed_ms(e0) * 1e-3) / 1e9)
    a.free()
    b.free()
    return best


def mma_variant(qt: str, n: int, k: int, rows: int, var: str, sm_count: int) -> dict:
    """The gemv_mma params of --mma-variants entry ``var`` for a [n, k] ``qt`` weight at ``rows``
    rows (see --mma-variants)."""
    from engine import kernel_catalog as kc
    from engine.kernel_catalog.gemv_mma import mma_bmax

    over = dict(kv.split("=", 1) for kv in var.replace(" ", "").split(","))
    base = over.pop("plan", "") == "base"
    p = kc.gemv_mma_params(qt, n, k, mma_bmax(rows), sm_count=sm_count, stage_x=not base, fit_tile=not base)
    ints = {key: int(v) for key, v in over.items() if key != "xsm" or v != "auto"}
    bad = set(over) - {"mt", "wm", "wk", "kparts", "depth", "min_blocks", "xsm"}
    if bad:
        raise ValueError(f"unknown variant keys {sorted(bad)}")
    split = ints.get("wk", p["wk"]) != p["wk"] or ints.get("kparts", p["kparts"]) != p["kparts"]
    q = {**p, **ints}
    if over.get("xsm") == "auto" or ("xsm" not in over and split and p["xsm"]):
        q["xsm"] = kc.mma_xchunk(qt, k, q["bmax"], q["wk"], q["kparts"])
    if "min_blocks" not in over:  # (the warps of a block changed: the register bound follows)
        q["min_blocks"] = kc.mma_min_blocks(q["bmax"], q["wm"], q["wk"])
    return q


def mmq1_variant(p1: dict, var: str, sm_count: int) -> dict:
    """The gemv_mmq1 params of --mmq1-variants entry ``var`` (``key=value,...`` over lanes, warps,
    depth, min_blocks, grid_cap (0: a block a row tile), interleave (1: from MMQ1_INTERLEAVE's warps
    and depth), and wk / kparts: another k split, so not
    gemv_mmq's bits, a timing experiment for the split gemv_mmq and gemv_mmq1 would share) on the
    plan's ``p1``: a lanes override starts from that lanes' default warps and depth
    (kernel_catalog.MMQ1_WARPS / MMQ1_DEPTH); min_blocks and grid_cap, where not named, follow the
    warps (mmq1_min_blocks, mmq1_grid_cap on ``sm_count`` SMs)."""
    from engine.kernel_catalog.gemv_mmq import (
        MMQ1_DEPTH,
        MMQ1_INTERLEAVE,
        MMQ1_WARPS,
        mmq1_grid_cap,
        mmq1_min_blocks,
    )

    over = {kv.split("=")[0].strip(): int(kv.split("=")[1]) for kv in var.split(",")}
    bad = set(over) - {"lanes", "warps", "depth", "min_blocks", "wk", "kparts", "grid_cap", "interleave"}
    if bad:
        raise ValueError(f"unknown gemv_mmq1 variant keys {sorted(bad)}")
    lanes = over.get("lanes", p1["lanes"])
    base = dict(p1)
    if lanes != p1["lanes"]:
        base.update(lanes=lanes, warps=MMQ1_WARPS[lanes][p1["bmax"]], depth=MMQ1_DEPTH[lanes][p1["quant"]])
    if over.get("interleave"):  # (from its own defaults: a lanes=1 ring)
        over["interleave"] = True
        base.update(warps=MMQ1_INTERLEAVE["warps"], depth=MMQ1_INTERLEAVE["depth"])
    q = {**base, **over}
    if "min_blocks" not in over:
        q["min_blocks"] = mmq1_min_blocks(q["lanes"], q["warps"], q["bmax"], q.get("interleave", False))
    if "grid_cap" not in over:  # (the blocks the SMs hold follow the warps and min_blocks)
        q["grid_cap"] = mmq1_grid_cap(q, sm_count)
    return q


class Bench:
    def __init__(self, cuda, builder, stream, iters: int):
        self.cuda, self.builder, self.stream, self.iters = cuda, builder, stream, iters
        self._fns: dict = {}
        self._mods: list = []

    def function(self, spec):
        if spec not in self._fns:
            mod = self.cuda.Module(self.builder.get(spec).cubin, spec.entry)
            self._mods.append(mod)
            self._fns[spec] = mod.function(spec.entry)
        return self._fns[spec]

    def time_us(self, choice, rows: int, copies: list, args: dict, pre=None) -> float:
        """Median-free mean over --iters launches (after 3 warm ones), each on the next weight copy;
        ``pre``: a (choice, args) launched before each (gemv_mmq's x quantiser)."""
        cuda = self.cuda
        fn = self.function(choice.spec)
        if pre is not None:
            pc, pa = pre
            pre_run = cuda.PreparedLaunch(self.function(pc.spec), pc.grid(rows), pc.block, pc.smem, self.stream)
            pre_args = cuda.KernelArgs([kind for _, kind in pc.args], [pa[name] for name, _ in pc.args])
        packed = []
        for w in copies:
            vals = [w.ptr if name == "w" else args[name] for name, _ in choice.args]
            packed.append(cuda.KernelArgs([kind for _, kind in choice.args], vals))
        main = cuda.PreparedLaunch(fn, choice.grid(rows), choice.block, choice.smem, self.stream)

        def run(a) -> None:
            if pre is not None:
                pre_run(pre_args)
            main(a)

        for i in range(3):
            run(packed[i % len(packed)])
        e0, e1 = cuda.Event(), cuda.Event()
        e0.record(self.stream)
        for i in range(self.iters):
            run(packed[i % len(packed)])
        e1.record(self.stream)
        e1.synchronize()
        return e1.elapsed_ms(e0) * 1e3 / self.iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--shapes", default=SHAPES, help="NxK weight shapes (out rows x in), comma-separated")
    ap.add_argument("--batches", default="", help="default: the profile's CUDA-graph buckets")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--no-gemv", action="store_true", help="time only the batched tensor-core kernel")
    ap.add_argument(
        "--mma-variants", default="",
        help="gemv_mma launches timed beside the plan's, ';'-separated, each 'key=value,...': param "
        "overrides of mt, wm, wk, kparts, depth, min_blocks (else the one the warps give), xsm (unit rounds per x chunk; 0: x from "
        "global memory; auto: mma_xchunk's for the variant's k split, as where wk or kparts change and "
        "xsm is not named), on the plan's "
        "params or, with plan=base, on those of MMA_SHAPES' tile with x from global memory (the "
        "launches before x staging and mma_row_tile); e.g. 'plan=base;xsm=0;depth=2': "
        "rows labelled mma:<variant>",
    )  # fmt: skip
    ap.add_argument(
        "--mmq-variants", default="",
        help="gemv_mmq param overrides timed beside the plan's, as --mma-variants (mt, wm, wk, kparts, "
        "depth, min_blocks): rows labelled mmq:<variant>",
    )  # fmt: skip
    ap.add_argument(
        "--mmq1-variants", default="",
        help="gemv_mmq1 (1-4 rows) geometries timed beside the plan's, ';'-separated, each 'key=value,...' "
        "over lanes (1 or 4), warps, depth, min_blocks, grid_cap, interleave (a lanes override starts from that lanes' "
        "default warps and depth; min_blocks and grid_cap follow the warps where not named), wk, kparts "
        "(another k split: timing only, not gemv_mmq's bits): rows labelled mmq1:<variant>",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from engine import cuda, storage
    from engine import kernel_catalog as kc
    from engine.compile import KernelBuilder
    from engine.kcache import KernelCache
    from engine.kernel_catalog.gemv_mma import mma_bmax
    from engine.profile import select
    from engine.types import ConfigError

    info = cuda.detect_devices()[0]
    ctx = cuda.Context(0)
    prof = select(info)
    tuning = prof.tuning
    stream = cuda.Stream()
    copy_gbs = copy_bandwidth(cuda, stream)
    builder = KernelBuilder(prof.arch, cache=KernelCache(Path(tempfile.mkdtemp(prefix="memra-linbench-"))), no_compile=False)
    bench = Bench(cuda, builder, stream, args.iters)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(prof.cuda_graph_batch_sizes)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    max_rows = max(batches)
    kmax = max(k for _, k in shapes)
    nmax = max(n for n, _ in shapes)
    x = cuda.alloc(max_rows * kmax * 2)
    cuda.htod(x.ptr, (rng.standard_normal(max_rows * kmax).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    out = cuda.alloc(max_rows * nmax * 4)
    part = cuda.alloc(16 * max_rows * nmax * 4)  # gemv_mma's partial sums (kparts <= 16 on these shapes)
    count = cuda.alloc(1 << 20)
    rows8 = -(-max_rows // 8) * 8  # gemv_mmq's int8 x rows and their block scales (whole n tiles)
    xq = cuda.alloc(rows8 * kmax)
    xs = cuda.alloc(rows8 * kmax // 32 * 8)
    cuda.memset(count.ptr, 0, 1 << 20)
    print(f"{info.name} ({prof.name}, {info.sm_count} SMs): device-to-device copy {copy_gbs:.0f} GB/s", flush=True)
    rows_out = []

    def candidates(qt: str, n: int, k: int, b: int) -> list:
        cands = []
        p = kc.gemv_mma_params(qt, n, k, mma_bmax(b), sm_count=info.sm_count)
        if p is not None:
            cands.append(("mma", kc.choice("gemv_mma", **p)))
            for var in filter(None, args.mma_variants.split(";")):
                try:
                    cands.append((f"mma:{var}", kc.choice("gemv_mma", **mma_variant(qt, n, k, b, var, info.sm_count))))
                except (ConfigError, ValueError) as e:
                    print(f"skip mma:{var} {qt} {n}x{k} b{b}: {e}")
        file_type = storage.REPACKED_FROM.get(qt, qt)
        p = kc.gemv_mmq_params(qt, n, k, mma_bmax(b), sm_count=info.sm_count)
        if p is not None and file_type in kc.MMQ_FILE_TYPES:
            quantiser = (kc.choice("gemv_mmq_x", **kc.gemv_mmq_x_params(k)), {"xq": xq.ptr, "xs": xs.ptr, "x": x.ptr, "rows": b})

            def mmq_row(label: str, params: dict) -> tuple:
                c = kc.choice("gemv_mmq", **params)  # (xstage quantises x itself: no quantiser launch)
                return (label, c) if params["xstage"] else (label, c, quantiser)

            bm1 = next((bm for bm, lo, hi in kc.MMQ1_BUCKETS if lo <= b <= hi), 0)
            p1 = kc.gemv_mmq1_params(qt, n, k, sm_count=info.sm_count, bmax=bm1) if bm1 else None
            if p1 is not None:  # 1-4 rows: gemv_mmq1, as the plan runs it (the bmax-8 kernel: mmq8)
                cands.append(("mmq", kc.choice("gemv_mmq1", **p1)))
                for var in filter(None, args.mmq1_variants.split(";")):
                    try:
                        cands.append((f"mmq1:{var}", kc.choice("gemv_mmq1", **mmq1_variant(p1, var, info.sm_count))))
                    except (ConfigError, ValueError) as e:
                        print(f"skip mmq1:{var} {qt} {n}x{k} b{b}: {e}")
            cands.append(mmq_row("mmq8" if p1 is not None else "mmq", p))
            if not p["xstage"]:
                cands.append(("mmq-k", kc.choice("gemv_mmq", **p)))
            for var in filter(None, args.mmq_variants.split(";")):
                over = {kv.split("=")[0].strip(): int(kv.split("=")[1]) for kv in var.split(",")}
                try:
                    cands.append(mmq_row(f"mmq:{var}", {**p, **over}))
                except ConfigError as e:
                    print(f"skip mmq:{var} {qt} {n}x{k} b{b}: {e}")
        if not args.no_gemv:
            p = kc.linear_params(qt, n, k, tuning, bmax=1 if b == 1 else None, sm_count=info.sm_count)
            cands.append(("gemv" if b > 1 else "gemv b1", kc.choice("gemv", **p)))
            if "gemm_decode" in tuning and b >= int(tuning["gemm_decode"].get("min_rows", 16)):
                try:  # the wide-decode GEMM (bf16 buckets >= gemm_decode.min_rows before gemv_mma)
                    p = kc.gemm_params(n, k, tuning, quant=qt, section="gemm_decode")
                    cands.append(("gemm", kc.choice("gemm", **p)))
                except ConfigError:
                    pass
        return cands

    work = []
    for ft in args.types.split(","):
        for n, k in shapes:
            qt = kc.upload_type(ft, k, tuning, n)
            try:
                nbytes = n * storage.row_bytes(qt, k)
            except Exception as e:  # noqa: BLE001 (a k the type's blocks do not divide)
                print(f"skip {ft} {n}x{k}: {e}")
                continue
            work.append((ft, qt, n, k, nbytes, [(b, candidates(qt, n, k, b)) for b in batches]))
    specs = [c[1].spec for *_, per in work for _, cands in per for c in cands]
    specs += [c[2][0].spec for *_, per in work for _, cands in per for c in cands if len(c) > 2]
    print(builder.build_all(specs, progress=None).summary(), flush=True)
    for ft, qt, n, k, nbytes, per in work:
        ncopy = max(2, -(-L2_DEFEAT // nbytes))
        host = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        if qt == "bf16":  # finite bf16 weights (random bytes would hold NaNs)
            host = (rng.standard_normal(n * k).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        copies = []
        for _ in range(ncopy):
            buf = cuda.alloc(nbytes)
            cuda.htod(buf.ptr, host)
            copies.append(buf)
        for b, cands in per:
            for label, c, *pre in cands:
                a = {"out": out.ptr, "x": x.ptr, "a": x.ptr, "residual": 0, "rows": b, "part_sum": part.ptr,
                     "part_count": count.ptr, "xq": xq.ptr, "xs": xs.ptr}
                for name, _ in c.args:
                    if name.startswith("pf"):
                        a[name] = copies[0].ptr
                try:
                    us = bench.time_us(c, b, copies, a, pre[0] if pre else None)
                except Exception as e:  # noqa: BLE001 (report and go on: one bad spec must not hide the rest)
                    print(f"FAIL {ft} {n}x{k} b{b} {label}: {e}", flush=True)
                    continue
                gbs = nbytes / (us * 1e-6) / 1e9
                row = dict(type=ft, layout=qt, n=n, k=k, batch=b, kernel=label, us=round(us, 2),
                           gbs=round(gbs, 1), frac=round(gbs / copy_gbs, 3), entry=c.spec.entry)
                rows_out.append(row)
                print(f"{ft:>5} {n:>6}x{k:<6} b{b:<4} {label:<8} {us:9.2f} us {gbs:7.0f} GB/s "
                      f"{100 * gbs / copy_gbs:5.1f}% of copy", flush=True)
        for buf in copies:
            buf.free()
    # the summary: per type and batch, the weight-byte-weighted fraction over the shapes
    print("\nsummary: the shapes' weight bytes / their summed time, as % of copy bandwidth")
    kinds = sorted({r["kernel"] for r in rows_out})
    width = {k: max(8, len(k)) for k in kinds}  # (variant labels are long: each column as wide as its label)
    print(f"{'type':>5} {'batch':>5} " + " ".join(f"{k:>{width[k]}}" for k in kinds))
    for ft in args.types.split(","):
        for b in batches:
            cells = []
            for kind in kinds:
                rs = [r for r in rows_out if r["type"] == ft and r["batch"] == b and r["kernel"] == kind]
                if not rs:
                    cells.append(f"{'-':>{width[kind]}}")
                    continue
                by = sum(r["gbs"] * r["us"] for r in rs) / sum(r["us"] for r in rs)  # bytes / time
                cells.append(f"{100 * by / copy_gbs:{width[kind] - 1}.1f}%")
            print(f"{ft:>5} {b:>5} " + " ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"device": info.name, "copy_gbs": copy_gbs, "rows": rows_out}, indent=1))
    del ctx
    return 0


if __name__ == "__main__":
    sys.exit(main())
