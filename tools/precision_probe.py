"""How much do bf16 activations move a model's logits? The numpy reference, with chosen op outputs
rounded to bf16 (what the CUDA kernels store between ops), against the plain f32 reference.

Usage: PYTHONPATH=. python tools/precision_probe.py MODEL_DIR [--tokens 40]
Prints the relative error ||l - l_f32|| / ||l_f32|| of the last position's logits with every op
rounded, with every op but one rounded, and with the residual stream kept in f32. Used to choose
the GPU test tolerances (docs/PERFORMANCE.md). CPU only; must not import CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import ops_ref  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.reference import ReferenceRunner  # noqa: E402

OPS = ("embed", "rmsnorm", "head_rmsnorm", "linear", "rope_apply", "attention", "silu_mul")


def bf16_round(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def logits_with_rounding(runner: ReferenceRunner, prompt: list[int], rounded: set[str]) -> np.ndarray:
    """``rounded``: op names of OPS, plus "linear+res" for a linear with a residual add."""
    orig = {n: getattr(ops_ref, n) for n in OPS}

    def wrap(name):
        fn = orig[name]

        def run(*a, **k):
            out = fn(*a, **k)
            key = name + ("+res" if name == "linear" and len(a) > 2 and a[2] is not None else "")
            return bf16_round(out) if key in rounded else out

        return run

    for n in OPS:
        setattr(ops_ref, n, wrap(n))
    try:
        return runner.forward_logits(prompt)[-1]
    finally:
        for n, fn in orig.items():
            setattr(ops_ref, n, fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args(argv)
    model = load_model(args.model)
    runner = ReferenceRunner(model, num_blocks=-(-args.tokens // 16) + 1, max_model_len=args.tokens + 16)
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(1, int(model.dims["vocab"]), args.tokens)]
    want = runner.forward_logits(prompt)[-1]

    def rel(rounded: set[str]) -> float:
        got = logits_with_rounding(runner, prompt, rounded)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    every = set(OPS) | {"linear+res"}
    print(f"every op output bf16:            {rel(every):.4f}")
    print(f"residual stream f32, rest bf16:  {rel(every - {'linear+res', 'embed'}):.4f}")
    for name in sorted(every):
        print(f"all but {name:<24} {rel(every - {name}):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
