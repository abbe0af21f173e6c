"""What one kernel-to-kernel handoff costs inside a replayed CUDA graph, on the GPU machine.

    PYTHONPATH=. python tools/gpu_handoff_bench.py [--kernels 300] [--replays 20] [--out DIR]

A chain of --kernels launches of one small kernel (each block reads the previous launch's
per-block outputs, optionally busy-waits --work-ns, then writes its own) is captured once per
handoff mode and replayed; the time per launch is the replay's time over the launches. Modes:

- ``plain``: ordinary stream order (a launch starts once the one before has ended);
- ``pdl``: programmatic dependent launch, each block calling griddepcontrol.launch_dependents at
  its start and griddepcontrol.wait before its reads (what the batch-1 decode GEMVs do);
- ``pdlw``: the PDL attribute and griddepcontrol.wait, no early trigger;
- ``flag``: the same early launch, but instead of griddepcontrol.wait, thread 0 of each block
  spins (ld.acquire.gpu) on a counter the previous launch's blocks raise (__threadfence, then
  atomicAdd) once they have written; the launch's last block to pass resets the counter. A spin
  gives up after 2^22 polls (counted in the last column of "flags left"): a handoff that would
  deadlock shows up there instead of hanging the GPU.

The difference between ``pdl`` and ``flag`` is what a software handoff would save per kernel
boundary of the decode step (about 180 boundaries per Qwen3-4B step). Writes handoff.txt (and
prints it). Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(1024) chain(float* buf, unsigned* flags, int idx, int mode,
                                                          int work_ns, int prev_blocks, int last) {
    // mode 0: trigger at the start, griddepcontrol.wait; 1: trigger, spin on flags; 2: plain (no
    // trigger, no wait); 3: griddepcontrol.wait only (the next launch is scheduled as blocks exit)
    if (mode < 2) asm volatile("griddepcontrol.launch_dependents;" :::);
    __shared__ float red[32];
    if (mode == 1) {
        if (threadIdx.x == 0 && idx > 0) {
            unsigned* f = flags + 2 * ((idx - 1) % 3);
            unsigned v;
            long long spins = 0;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
            } while (v < (unsigned)prev_blocks && ++spins < (1ll << 22));
            if (v < (unsigned)prev_blocks) atomicAdd(flags + 6, 1u);  // gave up: counted, no hang
            if (atomicAdd(f + 1, 1u) == gridDim.x - 1) {  // every block has passed: reset for the next use
                f[1] = 0u;
                f[0] = 0u;
            }
        }
        __syncthreads();
    } else if (mode == 0 || mode == 3) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    float v = 0.0f;
    for (int i = threadIdx.x; i < prev_blocks; i += blockDim.x) v += __ldcg(buf + (size_t)idx * 1024 + i);
    if (work_ns > 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)work_ns);
    }
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += red[w];
        buf[(size_t)(idx + 1) * 1024 + blockIdx.x] = s * 0.5f + 1.0f;
        if (mode == 1 && !last) {
            __threadfence();
            atomicAdd(flags + 2 * (idx % 3), 1u);
        }
    }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=300)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--shapes", default="128x640,264x320", help="blocks x threads per launch, comma-separated")
    ap.add_argument("--work-ns", default="0,2000", help="busy-wait per block, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from gpu_inline import inline_module

    from engine import cuda

    info, ctx, mod = inline_module(SOURCE, "chain")
    fn = mod.function("chain")
    n = args.kernels
    buf = cuda.alloc((n + 2) * 1024 * 4)
    flags = cuda.alloc(8 * 4)  # three (count, passed) pairs, then the spins that gave up
    cuda.memset(buf.ptr, 0, (n + 2) * 1024 * 4)
    cuda.memset(flags.ptr, 0, 8 * 4)
    stream = cuda.Stream()
    lines = [f"{info.name}: {n} launches per graph, {args.replays} replays; us per launch"]
    kinds = ["ptr", "ptr", "i32", "i32", "i32", "i32", "i32"]
    results: dict[tuple, float] = {}
    for shape in args.shapes.split(","):
        blocks, threads = (int(v) for v in shape.split("x"))
        for work in (int(w) for w in args.work_ns.split(",")):
            row = [f"{blocks:4d} blocks x {threads:4d} threads, work {work:5d} ns:"]
            for mode_name, mode in (("plain", 2), ("pdl", 0), ("pdlw", 3), ("flag", 1)):
                cuda.memset(flags.ptr, 0, 8 * 4)
                launches = [cuda.PreparedLaunch(fn, (blocks,), (threads,), 0, stream, pdl=mode != 2) for _ in range(2)]
                packed = []
                for i in range(n):
                    packed.append(
                        cuda.KernelArgs(kinds, [buf.ptr, flags.ptr, i, mode, work, blocks if i else 0, int(i == n - 1)])
                    )
                with cuda.capture(stream) as graph:
                    for i in range(n):
                        launches[i > 0](packed[i])
                graph.launch(stream)  # warm
                stream.synchronize()
                t0, t1 = cuda.Event(), cuda.Event()
                t0.record(stream)
                for _ in range(args.replays):
                    graph.launch(stream)
                t1.record(stream)
                t1.synchronize()
                us = t1.elapsed_ms(t0) * 1000.0 / args.replays / n
                flag_left = cuda.dtoh(np.empty(8, dtype=np.uint32), flags.ptr)
                results[(shape, work, mode_name)] = us
                row.append(f"{mode_name} {us:6.3f}" + ("" if not flag_left.any() else f" (flags left {flag_left.tolist()})"))
                graph.destroy()
                print(shape, work, mode_name, f"{us:.3f}", flag_left.tolist(), flush=True)
            pdl, flag = results[(shape, work, "pdl")], results[(shape, work, "flag")]
            row.append(f"| flag - pdl {flag - pdl:+.3f}")
            lines.append("  ".join(row))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "handoff.txt").write_text(text + "\n")
    ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
