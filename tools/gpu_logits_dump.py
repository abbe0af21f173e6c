"""Dump a checkpoint's CUDA logits, to compare two checkouts bit for bit on the GPU machine.

    PYTHONPATH=/path/to/checkout python tools/gpu_logits_dump.py --model /dev/shm/q4b_q8_0.gguf \
        --out $OUT/before_q8_0.npz
    python tools/gpu_logits_dump.py --compare $OUT/before_q8_0.npz $OUT/after_q8_0.npz

The dump is the logits of a 40-token prefill (its last row), of 24 greedy decode steps at batch 1
(the batch-1 kernels, the short-context launches) and of a batch-8 decode step of 8 sequences at
positions 300-307 (the split attention, the batch-8 GEMVs), plus the greedy ids. It uses only
engine APIs that every checkout since the plan golden has (engine.model.load_model, CudaRunner,
StepItem), so one copy of this script serves both trees: PYTHONPATH picks the engine. --compare
exits 1 and names the first array whose bits differ. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def dump(model_path: str, out: str) -> None:
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner
    from engine.types import SamplingParams, StepItem

    greedy = SamplingParams(temperature=0.0)
    runner = CudaRunner(load_model(Path(model_path)), num_blocks=512, max_model_len=2048, window_kv_blocks=0)
    arrays: dict[str, np.ndarray] = {}
    table = list(range(8))
    ids = [(7 * i) % 500 + 3 for i in range(40)]
    tok = runner.step([StepItem(0, ids, 0, table, True, greedy)])[0]
    arrays["prefill"] = runner.read_logits(1)[0].copy()
    steps, toks = [], [tok]
    for pos in range(40, 64):
        tok = runner.step([StepItem(0, [toks[-1]], pos, table, True, greedy)])[0]
        steps.append(runner.read_logits(1)[0].copy())
        toks.append(tok)
    arrays["decode_b1"] = np.stack(steps)
    # eight sequences past the short context: prefill each to 300 tokens, then one batch-8 step
    items = []
    for s in range(8):
        bt = list(range(64 + 24 * s, 64 + 24 * (s + 1)))
        prompt = [(11 * i + s) % 500 + 3 for i in range(300 + s)]
        for start in range(0, len(prompt), 128):
            runner.step([StepItem(10 + s, prompt[start : start + 128], start, bt, start + 128 >= len(prompt), greedy)])
        items.append(StepItem(10 + s, [5 + s], len(prompt), bt, True, greedy))
    toks += runner.step(items)
    arrays["decode_b8"] = runner.read_logits(8).copy()
    arrays["ids"] = np.array([t if t is not None else -1 for t in toks], dtype=np.int64)
    np.savez(out, **arrays)
    print(f"{model_path}: {', '.join(f'{k} {v.shape}' for k, v in arrays.items())} -> {out}")


def compare(a: str, b: str) -> int:
    x, y = np.load(a), np.load(b)
    for key in x.files:
        if key not in y.files or x[key].shape != y[key].shape or x[key].tobytes() != y[key].tobytes():
            print(f"DIFFER {key}: {a} vs {b}")
            return 1
    print(f"bit-identical: {', '.join(x.files)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not (args.model and args.out):
        ap.error("--model and --out, or --compare BEFORE AFTER")
    dump(args.model, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
