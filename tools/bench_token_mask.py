"""What the device token mask and logprobs cost a decode step (issue #39), on a GPU:

    PYTHONPATH=. python tools/bench_token_mask.py [--layers 2] [--batches 1,8,32] [--steps 30]

A random bf16 checkpoint with Qwen3-0.6B's hidden size and vocabulary (151936: the mask's words and
the logprobs' log-softmax at a real vocabulary's width; ``--layers`` of them) runs decode steps at
each batch through CudaRunner.step (CUDA graphs, the host packing included) with every row: plain
greedy; constrained (a random mask allowing 1% of the vocabulary, new each step, plus a 3-token
logit bias); constrained and asking for top_logprobs=20 on the device; and the same logprobs rows on
the host (engine.ir.LP_SLOTS patched to 0: logits read back, engine.sampling.sample_item). Prints
the median step time per case and its overhead over plain greedy. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))

from test_runner_cuda import write_checkpoint  # noqa: E402

import engine.runner_steps as rs  # noqa: E402
from engine.types import SamplingParams, StepItem  # noqa: E402

VOCAB = 151936


def _mask(rng: np.random.Generator) -> np.ndarray:
    bits = (rng.random(VOCAB + (-VOCAB % 32)) < 0.01).astype(np.uint8)
    return np.packbits(bits, bitorder="little").view(np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    dims = dict(hidden=1024, layers=args.layers, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=VOCAB)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), "qwen3", dims)
        runner = CudaRunner(load_model(Path(tmp)), num_blocks=1024, max_model_len=1024)
    rng = np.random.default_rng(0)
    bias = ((5, 3.0), (77, -2.0), (9000, 1.5))
    cases = {
        "greedy": lambda: (SamplingParams(temperature=0.0), None),
        "masked": lambda: (SamplingParams(temperature=0.0, logit_bias=bias), _mask(rng)),
        "masked+logprobs20 (device)": lambda: (SamplingParams(temperature=0.0, logit_bias=bias, logprobs=20), _mask(rng)),
        "masked+logprobs20 (host)": lambda: (SamplingParams(temperature=0.0, logit_bias=bias, logprobs=20), _mask(rng)),
    }
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(b)]
        runner.step([StepItem(i, [1 + i] * 16, 0, tables[i], False, SamplingParams(temperature=0.0)) for i in range(b)])
        base = None
        for name, make in cases.items():
            saved = rs.LP_SLOTS
            if name.endswith("(host)"):
                rs.LP_SLOTS = 0
            try:
                times = []
                for s in range(args.steps + 3):
                    items = []
                    for i in range(b):
                        sp, mask = make()
                        items.append(StepItem(i, [7], 16, tables[i], True, sp, [1] * 16, 16, s, allowed=mask))
                    t0 = time.perf_counter()
                    runner.step(items)
                    times.append(time.perf_counter() - t0)
            finally:
                rs.LP_SLOTS = saved
            med = float(np.median(times[3:])) * 1e6
            base = med if base is None else base
            rows.append((b, name, med, med - base))
    runner.close()
    print(f"{'batch':>5}  {'case':<28} {'step us':>9} {'over greedy us':>15}")
    for b, name, med, over in rows:
        print(f"{b:>5}  {name:<28} {med:>9.1f} {over:>15.1f}")


if __name__ == "__main__":
    main()
