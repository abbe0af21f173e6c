"""A very tall decode GEMV's own bandwidth (a 262,144-row lm_head), per kernel configuration, on the
GPU machine.

    PYTHONPATH=. python tools/gemv_tall_bench.py [--n 262144] [--k 640] [--quant q8_0] [--rows 1,8] [--out DIR]

The matrix is ``--n`` x ``--k`` random blocks of ``--quant`` (a file type). Where the device profile
uploads it in another layout (Gemma 3 270M's tied head, q8_0 rows of 640 values: q8_0r by
gemv_coop.q8_0r_min_rows, its d plane padded to 16 bytes) both are timed: ``classic q8_0`` (the
classic GEMV on the file layout, the default before q8_0r took k % 256 != 0; ``--classic-sweep``
adds its threads x rows_per_block x stage x prefetch variants), then the profile's own coop spec
(``default``) and coop block shapes around it (coop_variants: ``coop tT rpwR lL uU`` is T threads,
R rows per lane group, lane groups of L lanes, U segments in flight per lane and row, ``cap4`` the
grid capped at 4 blocks per SM, ``f32x`` the f32-x path; as gemv_coop knobs q8x_threads,
q8x_rows_per_warp / q8x_b1_rows_per_warp, q8x_lanes_per_row, gemv_coop.unroll / q8x_b1_unroll, set for a
tall weight in q8x_tall_tuning); else the profile's spec (``default``) and the classic variants.
A capped grid is fitted to the resident blocks as the runner does (gemv_coop.q8x_resident_grid).
Each bucket ends with its fastest run. x is ``--rows`` random bf16 rows, the output f32 (logits).
Each kernel alone is timed back to back between CUDA events (median of --reps, each the mean of 20
launches; the matrix is several times the L2), and reported as the bytes of its layout / time
(GB/s) and that as a fraction of a device-to-device copy measured the same way (bytes read +
written). Every run's output is compared with the first's (``rel``: one that computes something
else shows; the q8x runs quantise x to int8, about 1e-2). The lead's acceptance line for the
lm_head is ``default``'s fraction >= 0.70. Writes gemv_tall.txt under --out (and prints it). Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import cuda, quant, storage  # noqa: E402
from engine import kernel_catalog as kc  # noqa: E402
from engine.compile import KernelBuilder  # noqa: E402
from engine.kcache import KernelCache  # noqa: E402
from engine.profile import select  # noqa: E402
from engine.types import ConfigError  # noqa: E402

LAUNCHES = 20


def random_blocks(file_type: str, n: int, k: int, rng) -> np.ndarray:
    """n rows of random ``file_type`` blocks (the f16 scale ``d`` of a legacy block, its first
    field, in a sane range; other types' fields random: this is a timing, not a check)."""
    elems, nbytes = storage.BLOCK_SIZES[file_type]
    nb = n * k // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    if file_type in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        scale = (rng.uniform(0.2, 1.0, nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
        raw[:, 0:2] = scale  # d is the first field of every legacy block (q8_0, q4_0, q5_0 ...)
    return raw.reshape(-1)


def coop_variants(base: dict, sm_count: int) -> list[tuple[str, dict]]:
    """Block shapes of the coop GEMV on a row-planar weight (q8_0r ...) around the profile's
    ``base``: threads x rows per warp x (lanes per row, segments in flight per lane), the grid capped
    at 4 blocks per SM or not, and the f32-x path (q8x off); only the ones the catalog accepts."""
    out, seen = [], {tuple(sorted(base.items()))}
    k, seg = int(base["k"]), 16 if base["quant"] == "q8_0r" else 32
    per_lane8 = max(1, k // seg // 8)  # a lane group of 8 covers the row in one step of this many
    shapes = [(32, 2, True), (32, 4, True), (8, per_lane8, True), (8, 2, True), (8, 1, True), (4, per_lane8, True),
              (8, per_lane8, False), (32, 2, None)]  # (lanes, unroll, capped; None: q8x off)  # fmt: skip
    for threads in (256, 512):
        for rpw in (1, 2, 4):
            for lanes, unroll, capped in shapes:
                if (capped is False or capped is None) and rpw == 4:
                    continue
                p = {key: v for key, v in base.items() if key not in ("lanes", "grid_cap", "early_nw", "ksplit")}
                p.update(threads=threads, rows_per_block=threads // 32 * (32 // lanes) * rpw, unroll=unroll,
                         q8x=capped is not None)  # fmt: skip
                if lanes != 32:
                    p["lanes"] = lanes
                if capped:
                    p["grid_cap"] = 4 * sm_count
                key = tuple(sorted(p.items()))
                if key in seen:
                    continue
                try:
                    kc.spec("gemv", **p)
                except ConfigError:
                    continue
                seen.add(key)
                tail = " cap4" if capped else "" if capped is False else " f32x"
                out.append((f"coop t{threads} rpw{rpw} l{lanes} u{unroll}{tail}", p))
    return out


def variants(base: dict) -> list[tuple[str, dict]]:
    out = [("default", base)]
    seen = {tuple(sorted(base.items()))}
    for threads in (128, 256, 512):
        for rpb in (1, 2, 4, 8, 16):
            for stage in (True, False):
                for prefetch in (True, False):
                    p = dict(base, threads=threads, rows_per_block=rpb, stage=stage, prefetch=prefetch and stage)
                    key = tuple(sorted(p.items()))
                    if key in seen:
                        continue
                    try:
                        kc.spec("gemv", **p)
                    except ConfigError:
                        continue
                    seen.add(key)
                    out.append((f"t{threads} rpb{rpb}{' staged' if stage else ''}{' pf' if p['prefetch'] else ''}", p))
    return out


def time_us(fn, grid, block, args, smem, stream, reps: int) -> float:
    start, end = cuda.Event(), cuda.Event()
    run = cuda.PreparedLaunch(fn, grid, block, smem, stream)
    try:
        run(args)
        times = []
        for _ in range(reps):
            start.record(stream)
            for _ in range(LAUNCHES):
                run(args)
            end.record(stream)
            end.synchronize()
            times.append(end.elapsed_ms(start) * 1e3 / LAUNCHES)
        return statistics.median(times)
    finally:
        start.destroy()
        end.destroy()


def copy_gbs(nbytes: int, stream, reps: int) -> float:
    src, dst = cuda.alloc(nbytes), cuda.alloc(nbytes)
    start, end = cuda.Event(), cuda.Event()
    try:
        cuda.dtod(dst.ptr, src.ptr, nbytes, stream)
        times = []
        for _ in range(reps):
            start.record(stream)
            cuda.dtod(dst.ptr, src.ptr, nbytes, stream)
            end.record(stream)
            end.synchronize()
            times.append(end.elapsed_ms(start) / 1e3)
        return 2 * nbytes / statistics.median(times) / 1e9
    finally:
        stream.synchronize()
        start.destroy()
        end.destroy()
        src.free()
        dst.free()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--k", type=int, default=640)
    ap.add_argument("--quant", default="q8_0", help="the file storage type (uploaded as the profile does)")
    ap.add_argument("--rows", default="1,8", help="activation rows (decode batch sizes)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--classic-sweep", action="store_true", help="also every classic variant on the file layout")
    ap.add_argument("--out", default=os.environ.get("OUT", "gemv_tall_out"))
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    dev = cuda.detect_devices()[0]
    ctx = cuda.Context(0)
    profile = select(dev)
    stream = cuda.Stream()
    builder = KernelBuilder(profile.arch, cache=KernelCache(Path(tempfile.mkdtemp(prefix="memra-gemv-"))))
    ft = storage.REPACKED_FROM.get(args.quant, args.quant)
    qt = kc.upload_type(ft, args.k, profile.tuning, args.n)
    rng = np.random.default_rng(0)
    file_host = random_blocks(ft, args.n, args.k, rng)
    layouts = {ft: file_host}
    if qt != ft:  # the layout the profile uploads (q8_0r), from the same blocks
        layouts[qt] = quant.repack(file_host, qt, args.n, args.k)
    bufs = {}
    for lay, host in layouts.items():
        bufs[lay] = cuda.alloc(host.nbytes)
        cuda.htod(bufs[lay].ptr, host)
    copy = copy_gbs(max(file_host.nbytes, 256 << 20), stream, args.reps)
    lines = [
        f"{dev.name} (profile {profile.name}): {ft} uploaded as {qt}, {args.n} x {args.k}, "
        f"{file_host.nbytes / 1e6:.1f} MB of weights in the file layout; d2d copy {copy:.0f} GB/s"
    ]
    mods = []
    for rows in (int(r) for r in args.rows.split(",")):
        bmax = 1 if rows == 1 else None
        x_host = rng.standard_normal((rows, args.k)).astype(np.float32)
        x_bits = ((x_host.view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
        x = cuda.alloc(x_bits.nbytes)
        cuda.htod(x.ptr, x_bits)
        y = cuda.alloc(rows * args.n * 4)
        runs = []  # (name, layout, params): the classic GEMV on the file layout, then the profile's
        classic = kc.linear_params(ft, args.n, args.k, profile.tuning, out_dtype="f32", bmax=bmax, sm_count=dev.sm_count)
        if qt == ft:
            runs += [(name, ft, p) for name, p in variants(classic)]
        else:
            runs.append((f"classic {ft}", ft, classic))
            if args.classic_sweep:
                runs += [(f"classic {name}", ft, p) for name, p in variants(classic)[1:]]
            base = kc.linear_params(qt, args.n, args.k, profile.tuning, out_dtype="f32", bmax=bmax, sm_count=dev.sm_count)
            runs.append(("default", qt, base))
            runs += [(name, qt, p) for name, p in coop_variants(base, dev.sm_count)]
        first, timed = None, []
        for name, lay, p in runs:
            c = kc.choice("gemv", **p)
            mod = cuda.Module(builder.get(c.spec).cubin, c.spec.entry)
            mods.append(mod)
            vals = {"out": y.ptr, "w": bufs[lay].ptr, "x": x.ptr, "residual": 0, "rows": rows}
            packed = cuda.KernelArgs([t for _, t in c.args], [vals[a] for a, _ in c.args])
            fn = mod.function(c.spec.entry)
            grid = c.grid(rows)
            if p.get("grid_cap") and profile.tune("gemv_coop").get("q8x_resident_grid"):  # as the runner fits it
                grid = (min(grid[0], max(1, fn.resident_blocks(c.block[0], c.smem)) * dev.sm_count), *grid[1:])
            try:
                us = time_us(fn, grid, c.block, packed, c.smem, stream, args.reps)
            except cuda.CudaError as e:  # (one shape's launch failing names it and goes on)
                lines.append(f"b{rows:<3} {name:<30} failed: {e}")
                print(lines[-1], flush=True)
                continue
            got = cuda.dtoh(np.empty((rows, args.n), np.float32), y.ptr)
            first = got if first is None else first
            rel = float(np.linalg.norm(got - first) / max(np.linalg.norm(first), 1e-30))
            gbs = layouts[lay].nbytes / (us * 1e-6) / 1e9
            lines.append(
                f"b{rows:<3} {name:<30} {us:9.2f} us {gbs:8.1f} GB/s {100 * gbs / copy:6.1f} % of copy  "
                f"grid {grid} x {c.block[0]}  rel {rel:.1e}  {c.spec.entry}"
            )
            print(lines[-1], flush=True)
            timed.append((us, name))
        best, ref = min(timed), dict((n, u) for u, n in timed)
        lines.append(f"b{rows:<3} best: {best[1]} {best[0]:.2f} us; default {ref['default']:.2f} us; "
                     f"classic {ref.get(f'classic {ft}', ref['default']):.2f} us")  # fmt: skip
        print(lines[-1], flush=True)
        x.free()
        y.free()
    for buf in bufs.values():
        buf.free()
    for mod in mods:
        mod.unload()
    text = "\n".join(lines)
    (out_dir / "gemv_tall.txt").write_text(text + "\n")
    print(text)
    ctx.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
