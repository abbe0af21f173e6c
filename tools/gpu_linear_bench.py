"""Time the decode linear kernels per (storage type, shape, batch) against the copy bandwidth.

    PYTHONPATH=. python tools/gpu_linear_bench.py [--types bf16,q4_k,...] [--shapes 6144x2560,...]
        [--batches 1,2,4,8,...] [--iters 40] [--json FILE] [--mma] [--variants 'NAME=key:value,..;..']

For every storage type (uploaded in the layout the device profile picks: q8_0 -> q8_0r ...), every
weight shape NxK (out rows x in; default the Qwen3-4B linears: q|k|v, o, gate|up, down) and every
batch (default: the profile's CUDA-graph buckets) it times, with CUDA events over --iters launches
cycling through enough weight copies to defeat the 50 MB L2:

- ``gemv``: the GEMV the plan uses (kernel_catalog.decode_bmax rows per weight pass, a capped
  coop grid fitted to the resident blocks as the runner fits it) and, at batch 1, the tuned
  batch-1 GEMV (no rmsnorm prologue, no pair);
- ``gemm``: the mma.sync GEMM with the gemm_decode tiling (bf16 wide buckets before), from
  gemm_decode.min_rows rows, where it has a decoder for the type;
- ``gemv:NAME`` (--variants 'NAME=key:value,..;..', batch > 1): the plan's bucket GEMV with those
  spec params changed (``min_blocks:0``, ``unroll:4``, ``bmax:16``, ``rows_per_block:80``: the
  same per-row bits where kernel_catalog accepts them), so one device call measures alternatives
  before a knob or a path change is made of them;
- ``mma`` (--mma, batch > 1, the types kernel_catalog.mma_params takes: q4_k, q6_k, q8_0, q4_0,
  q4_1): the int8 tensor-core bucket GEMV (kernels/_gemv_mmq.cuh.j2) as the plan builds it
  (kernel_catalog.MMA_FIXED), at every batch (the profile's gemv_mmq.min_rows picks the buckets
  that run it in a plan).

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


class Bench:
    def __init__(self, cuda, builder, stream, iters: int, sm_count: int = 0, fit_coop: bool = False):
        self.cuda, self.builder, self.stream, self.iters = cuda, builder, stream, iters
        self.sm_count = sm_count
        self.fit_coop = fit_coop  # (gemv_coop.q8x_resident_grid: capped coop grids fitted too)
        self._fns: dict = {}
        self._mods: list = []

    def function(self, spec):
        if spec not in self._fns:
            mod = self.cuda.Module(self.builder.get(spec).cubin, spec.entry)
            self._mods.append(mod)
            self._fns[spec] = mod.function(spec.entry)
        return self._fns[spec]

    def time_us(self, choice, rows: int, copies: list, args: dict) -> float:
        """Median-free mean over --iters launches (after 3 warm ones), each on the next weight copy."""
        cuda = self.cuda
        fn = self.function(choice.spec)
        packed = []
        for w in copies:
            vals = [w.ptr if name == "w" else args[name] for name, _ in choice.args]
            packed.append(cuda.KernelArgs([kind for _, kind in choice.args], vals))
        grid = choice.grid(rows)
        p = choice.spec.params
        if p.get("grid_cap") and (p.get("mma") or (self.fit_coop and p.get("coop"))):
            # as the runner binds a capped grid (Launch.fit_grid: the mma GEMV's, the coop one's
            # with gemv_coop.q8x_resident_grid): at most the resident blocks in all
            per_sm = max(1, fn.resident_blocks(choice.block[0], choice.smem))
            grid = (min(grid[0], max(1, per_sm * self.sm_count // (grid[1] * grid[2]))), *grid[1:])
        run = cuda.PreparedLaunch(fn, grid, choice.block, choice.smem, self.stream)
        for i in range(3):
            run(packed[i % len(packed)])
        e0, e1 = cuda.Event(), cuda.Event()
        e0.record(self.stream)
        for i in range(self.iters):
            run(packed[i % len(packed)])
        e1.record(self.stream)
        e1.synchronize()
        return e1.elapsed_ms(e0) * 1e3 / self.iters


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'NAME=key:value,key:value;NAME2=..' -> [(NAME, {key: value})], values as int, bool or str."""
    out = []
    for part in filter(None, (t.strip() for t in text.split(";"))):
        name, _, body = part.partition("=")
        over: dict = {}
        for kv in filter(None, body.split(",")):
            key, _, v = kv.partition(":")
            over[key.strip()] = {"true": True, "false": False}.get(v.strip(), int(v) if v.strip().lstrip("-").isdigit() else v.strip())
        out.append((name.strip(), over))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--shapes", default=SHAPES, help="NxK weight shapes (out rows x in), comma-separated")
    ap.add_argument("--batches", default="", help="default: the profile's CUDA-graph buckets")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--mma", action="store_true", help="also time the int8 tensor-core bucket GEMV (batch > 1)")
    ap.add_argument("--variants", default="", help="bucket GEMV spec variants (batch > 1), 'NAME=key:value,..;..'")
    args = ap.parse_args(argv)

    from engine import cuda, storage
    from engine import kernel_catalog as kc
    from engine.compile import KernelBuilder
    from engine.kcache import KernelCache
    from engine.profile import select
    from engine.types import ConfigError

    info = cuda.detect_devices()[0]
    ctx = cuda.Context(0)
    prof = select(info)
    tuning = prof.tuning
    stream = cuda.Stream()
    copy_gbs = copy_bandwidth(cuda, stream)
    builder = KernelBuilder(prof.arch, cache=KernelCache(Path(tempfile.mkdtemp(prefix="memra-linbench-"))), no_compile=False)
    fit_coop = bool((tuning.get("gemv_coop") or {}).get("q8x_resident_grid"))
    bench = Bench(cuda, builder, stream, args.iters, info.sm_count, fit_coop)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(prof.cuda_graph_batch_sizes)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    max_rows = max(batches)
    kmax = max(k for _, k in shapes)
    nmax = max(n for n, _ in shapes)
    x = cuda.alloc(max_rows * kmax * 2)
    cuda.htod(x.ptr, (rng.standard_normal(max_rows * kmax).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    out = cuda.alloc(max_rows * nmax * 4)
    print(f"{info.name} ({prof.name}, {info.sm_count} SMs): device-to-device copy {copy_gbs:.0f} GB/s", flush=True)
    rows_out = []
    variants = parse_variants(args.variants)

    def candidates(ft: str, qt: str, n: int, k: int, b: int) -> list:
        cands = []
        # (a bucket GEMV takes the plan's bmax: fewer rows a grid row where its int8 x rows would
        # not fit at GEMV_MAX_BATCH, as the down projection's k = 9728)
        bmax = 1 if b == 1 else kc.decode_bmax(qt, k, tuning)
        p = kc.linear_params(qt, n, k, tuning, bmax=bmax, sm_count=info.sm_count)
        cands.append(("gemv" if b > 1 else "gemv b1", kc.choice("gemv", **p)))
        for name, over in variants if b > 1 else ():
            try:  # the plan's bucket GEMV with some spec params changed (a spec check may refuse it)
                cands.append((f"gemv:{name}", kc.choice("gemv", **{**p, **over})))
            except ConfigError as e:
                print(f"skip {ft} {n}x{k} b{b} gemv:{name}: {e}")
        if args.mma and b > 1:
            mt = {**dict(tuning), "gemv_mmq": {**dict(tuning["gemv_mmq"]), "types": [ft]}}
            bucket = kc.linear_params(qt, n, k, tuning, bmax=kc.decode_bmax(qt, k, tuning), sm_count=info.sm_count)
            m = kc.mma_params(bucket, mt, info.sm_count)
            if m is not None:
                cands.append(("mma", kc.choice("gemv", **m)))
        if "gemm_decode" in tuning and b >= int(tuning["gemm_decode"].get("min_rows", 16)):
            try:  # the wide-decode GEMM (bf16 buckets >= gemm_decode.min_rows)
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
            work.append((ft, qt, n, k, nbytes, [(b, candidates(ft, qt, n, k, b)) for b in batches]))
    specs = [c.spec for *_, per in work for _, cands in per for _, c in cands]
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
            for label, c in cands:
                a = {"out": out.ptr, "x": x.ptr, "a": x.ptr, "residual": 0, "rows": b}
                for name, _ in c.args:
                    if name.startswith("pf"):
                        a[name] = copies[0].ptr
                try:
                    us = bench.time_us(c, b, copies, a)
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
    width = {k: max(8, len(k)) for k in kinds}  # (each column as wide as its label)
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
