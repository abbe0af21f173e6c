"""Benchmark a CudaRunner alone (no engine loop): decode at batch x depth and prefill, with roofline fractions.

    PYTHONPATH=. python tools/bench_runner.py MODEL_DIR_OR_GGUF [--json out.json] [--steps 64]
        [--devices 0,1 --split tp|pp]

The measurements are engine.runner_bench's (the same ones `memra bench` reports).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import runner_bench  # noqa: E402
from engine.bench import table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="HF model directory or .gguf file")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--devices", default=None, help="split over these CUDA devices (with --split)")
    ap.add_argument("--split", choices=("pp", "tp"), default=None)
    args = ap.parse_args(argv)
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    model = load_model(args.model)
    if args.devices or args.split:
        from engine.backend import create_runner

        runner = create_runner(model, "cuda", None, devices=args.devices, split=args.split, max_model_len=args.max_model_len)
    else:
        runner = CudaRunner(model, max_model_len=args.max_model_len)
    rows = runner_bench.run_all(runner, steps=args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "profile": runner.profile.name, "rows": rows}, f, indent=1)
    print(f"{args.model} on {runner.profile.name}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
