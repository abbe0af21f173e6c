"""Whether an L2 prefetch makes a later weight stream faster, on the GPU machine.

    PYTHONPATH=. python tools/gpu_l2_bench.py [--sizes 6,16,32] [--delays 3,10] [--reps 7] [--out DIR]

The decode GEMVs stream their weights once per step, so a weight is in L2 only if something
prefetched it. The attention's ``l2_pf`` (attention_decode.l2_prefetch_*: docs/kernels.md)
prefetches the o projection in a window where DRAM is idle. This tool measures the premise on a
plain buffer of each --sizes MB, the median of --reps runs, time of the stream kernel alone
(264 blocks x 320 threads, 16-byte loads, 4 in flight per thread, as the GEMVs read):

- ``cold``: after a 256 MB flush (nothing of the buffer in L2);
- ``warm``: right after a first stream of the same buffer (as much of it in L2 as stays);
- ``pf MODE dD``: after a flush, a prefetch kernel (32 blocks x 256 threads: the attention's
  grid; MODE bulk = 8 KB cp.async.bulk.prefetch.L2 pieces, lines = prefetch.global.L2 per 128
  bytes, keep = bulk with an L2 evict_last policy) and a D us busy kernel (the attention's time);
- ``tile``: 128 blocks each bulk-copying its 1/128 of the buffer into shared memory (the o
  projection's row tiles: 46 KB each for the Qwen3-4B q4_k o weight, 6 MB), cold and after a bulk
  prefetch and a 3 us idle window (sizes up to 28 MB: 224 KB of shared memory a block);
- ``beside``: after a flush, one kernel that prefetches the buffer (bulk, its blocks' share)
  while it streams another 28 MB buffer (the shape of "prefetch the next GEMV's
  weights"), then the stream: the time of both kernels against the two streams cold.

A stream at the ``warm`` rate after ``pf`` says the prefetch lands in time and is hit; near
``cold`` says it does not. Writes l2.txt (and prints it). Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SOURCE = r"""
typedef unsigned long long u64;
// sum (as xor) of n16 16-byte words, 4 loads in flight per thread; one word out per thread
extern "C" __global__ void __launch_bounds__(320) stream(const uint4* __restrict__ p, u64 n16, unsigned* out) {
    unsigned acc = 0u;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    out[(u64)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// the n bytes at src into L2, pieces dealt block-major over the grid's threads (the attention's
// l2_pf): mode 0 bulk, 1 lines, 2 bulk evict_last
__device__ __forceinline__ void prefetch_range(const unsigned char* src, u64 n, int mode) {
    const unsigned blocks = gridDim.x, t = threadIdx.x * blocks + blockIdx.x, nt = blocks * blockDim.x;
    if (mode == 1) {
        for (u64 o = (u64)t * 128; o < n; o += (u64)nt * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(src + o));
        return;
    }
    u64 pol = 0;
    if (mode == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    for (u64 o = (u64)t * 8192; o < n; o += (u64)nt * 8192) {
        const unsigned sz = (unsigned)min((u64)8192, n - o);
        if (mode == 2)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(src + o), "r"(sz), "l"(pol) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + o), "r"(sz) : "memory");
    }
}
extern "C" __global__ void prefetch(const unsigned char* src, u64 n, int mode) { prefetch_range(src, n, mode); }

extern "C" __global__ void busy(int ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (u64)ns);
}

// block i copies bytes [i * per, (i + 1) * per) of src into its shared memory with one bulk copy
// (the wsm GEMVs' row tile: the o projection's 128 blocks), waits for it, and reads one word
extern "C" __global__ void tile_copy(const unsigned char* src, unsigned per, unsigned* out) {
    extern __shared__ __align__(128) unsigned char tile[];
    __shared__ __align__(8) u64 bar;
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar), d = (unsigned)__cvta_generic_to_shared(tile);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(per) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(d), "l"(src + (u64)blockIdx.x * per), "r"(per), "r"(b) : "memory");
    }
    __syncthreads();
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(b) : "memory");
    if (threadIdx.x == 0) out[blockIdx.x] = *reinterpret_cast<const unsigned*>(tile + per - 16);
}

// stream a while prefetching b (bulk, this grid's share) first
extern "C" __global__ void __launch_bounds__(320) stream_pf(const uint4* __restrict__ a, u64 n16, unsigned* out,
                                                             const unsigned char* b, u64 nb) {
    prefetch_range(b, nb, 0);
    unsigned acc = 0u;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
        const uint4 v = __ldg(a + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    out[(u64)blockIdx.x * blockDim.x + threadIdx.x] ^= acc;
}
"""

MB = 1 << 20
BLOCKS, THREADS = 264, 320


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="6,16,32", help="buffer MB, comma-separated")
    ap.add_argument("--delays", default="3,10", help="us between the prefetch and the stream")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from gpu_inline import inline_module

    from engine import cuda

    info, ctx, mod = inline_module(SOURCE, "l2bench")
    f_stream, f_pf, f_busy, f_spf, f_tile = (
        mod.function(n) for n in ("stream", "prefetch", "busy", "stream_pf", "tile_copy")
    )
    sizes = [int(s) for s in args.sizes.split(",")]
    big = max(sizes) * MB
    buf, other, flush = cuda.alloc(big), cuda.alloc(28 * MB), cuda.alloc(256 * MB)
    out = cuda.alloc(BLOCKS * THREADS * 4)
    for b, n in ((buf, big), (other, 28 * MB), (flush, 256 * MB)):
        cuda.memset(b.ptr, 7, n)
    stream = cuda.Stream()
    e0, e1, e2 = cuda.Event(), cuda.Event(), cuda.Event()

    stream_launch = cuda.PreparedLaunch(f_stream, (BLOCKS,), (THREADS,), 0, stream)

    def run_stream(ptr: int, nbytes: int) -> None:
        stream_launch(cuda.KernelArgs(["ptr", "u64", "ptr"], [ptr, nbytes // 16, out.ptr]))

    def do_flush() -> None:
        cuda.memset(flush.ptr, 1, 256 * MB, stream)
        run_stream(flush.ptr, 256 * MB)

    def timed(pre, body) -> float:
        times = []
        for _ in range(args.reps):
            pre()
            e0.record(stream)
            body()
            e1.record(stream)
            e1.synchronize()
            times.append(e1.elapsed_ms(e0) * 1000.0)
        return statistics.median(times)

    pf_launch = cuda.PreparedLaunch(f_pf, (32,), (256,), 0, stream)
    busy_launch = cuda.PreparedLaunch(f_busy, (1,), (32,), 0, stream)
    spf_launch = cuda.PreparedLaunch(f_spf, (BLOCKS,), (THREADS,), 0, stream)

    def prefetch(nbytes: int, mode: int) -> None:
        pf_launch(cuda.KernelArgs(["ptr", "u64", "i32"], [buf.ptr, nbytes, mode]))

    def busy(us: float) -> None:
        busy_launch(cuda.KernelArgs(["i32"], [int(us * 1000)]))

    lines = [f"{info.name}: stream kernel {BLOCKS} x {THREADS}, median of {args.reps}; us (GB/s)"]
    for mb in sizes:
        n = mb * MB

        def rate(us: float, nbytes: int = n) -> str:
            return f"{us:7.2f} us ({nbytes / us / 1e3:6.0f} GB/s)"

        cold = timed(do_flush, lambda n=n: run_stream(buf.ptr, n))
        warm = timed(lambda n=n: run_stream(buf.ptr, n), lambda n=n: run_stream(buf.ptr, n))
        row = [f"{mb:3d} MB: cold {rate(cold)}, warm {rate(warm)}"]
        for delay in (float(d) for d in args.delays.split(",")):
            for name, mode in (("bulk", 0), ("lines", 1), ("keep", 2)):

                def pre(n=n, mode=mode, delay=delay) -> None:
                    do_flush()
                    prefetch(n, mode)
                    busy(delay)

                row.append(f"pf {name} d{delay:g} {rate(timed(pre, lambda n=n: run_stream(buf.ptr, n)))}")
        per = n // 128 // 16 * 16
        if per <= 224 * 1024:
            tile_launch = cuda.PreparedLaunch(f_tile, (128,), (128,), per, stream)

            def tile(per=per, tile_launch=tile_launch) -> None:
                tile_launch(cuda.KernelArgs(["ptr", "u32", "ptr"], [buf.ptr, per, out.ptr]))

            def pre_pf(n=n) -> None:
                do_flush()
                prefetch(n, 0)
                busy(3.0)

            row.append(f"tile copies ({per // 1024} KB x 128): cold {rate(timed(do_flush, tile))}, after pf bulk d3 {rate(timed(pre_pf, tile))}")
        both_cold = timed(do_flush, lambda n=n: (run_stream(other.ptr, 28 * MB), run_stream(buf.ptr, n)))

        def beside(n=n) -> None:
            args_ = cuda.KernelArgs(["ptr", "u64", "ptr", "ptr", "u64"], [other.ptr, 28 * MB // 16, out.ptr, buf.ptr, n])
            spf_launch(args_)
            e2.record(stream)
            run_stream(buf.ptr, n)

        t_beside = timed(do_flush, beside)
        row.append(f"28 MB stream then this one: cold {both_cold:7.2f} us, with the prefetch beside the first {t_beside:7.2f} us")
        lines.append("\n    ".join(row))
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "l2.txt").write_text(text + "\n")
    print(text)
    ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
