"""One batch-1 decode step of a model under Nsight Compute, on the GPU machine.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python3 tools/gpu_ncu_decode.py --model q4b_q4_k_m.gguf [--variant 'MEMRA_TUNE spec']

Builds the CUDA runner, warms it up (prefill, decode steps, graph capture for batch 1), then
replays the batch-1 decode graph once inside engine.cuda.profiler_range, so ncu profiles only the
kernels of that one step (graph kernel nodes one by one, each on its own layer's weights; ncu
flushes the caches between its replays by default, so every weight comes from HBM as in the
step). Filter with ncu's own --kernel-name / --launch-count. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", default="", help="engine.profile.with_tuning spec")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("MEMRA_CACHE_DIR", tempfile.mkdtemp(prefix="memra-cache-"))

    from engine import cuda, runner_bench
    from engine.model import load_model
    from engine.profile import select, with_tuning
    from engine.runner_cuda import CudaRunner

    prof = select(cuda.detect_devices()[0])
    if args.variant.strip():
        prof = with_tuning(prof, args.variant)
    runner = CudaRunner(load_model(Path(args.model)), prof, num_blocks=1024, max_model_len=4096)
    try:
        runner_bench.bench_decode(runner, args.batch, 0, steps=2, repeats=1)
        bucket = next(b for b in runner.plan.graph_batch_sizes if b >= args.batch)
        graph, bound = runner._graphs[(bucket, "greedy", True, True)]
        runner.stream.synchronize()
        with cuda.profiler_range():
            graph.launch(runner.stream)
            runner.stream.synchronize()
        print(f"profiled one batch-{bucket} decode graph: {len(bound)} launches", flush=True)
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
