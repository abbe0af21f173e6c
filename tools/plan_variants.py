"""Check a GPU A/B's variants without a GPU: each MEMRA_TUNE spec must give a plan.

    python tools/plan_variants.py --quant q4_k_m [--shape qwen3-4b] [--profile h200] \
        --variant p3='decode_graph.pair_min_blocks=3' --variant u1='...'

It takes tools/gpu_decode_profile.py's arguments too (``--model /dev/shm/q4b_q4_k_m.gguf`` names the
shape and the quant the way tools/gpu_session.sh's checkpoints do, ``--shapes a,b`` the bf16 random
checkpoints tools/make_checkpoint.py writes for those sizes, in its SHAPES' families; ``--out``, ``--batches`` and
``--breakdown`` are ignored), so ``DRYRUN=1 bash tools/gpu_session.sh`` can run a session's stages
here and catch a misspelt knob or a plan rule before device time is spent on it. For each variant
it builds the plan of the named size (random-checkpoint tensor types, as
tools/kernel_resources.py) with the profile and the spec, and prints how many of the batch-1
decode kernels (decode1 and short launches) differ from the profile's, or the error. Exit status
1 if any variant fails. Must not import CUDA.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_resources  # noqa: E402
from make_checkpoint import SHAPES  # noqa: E402  (size -> its family, as --shapes checkpoints are written)

from engine.graph import load_family  # noqa: E402
from engine.model import dims_for_size  # noqa: E402
from engine.plan import build_plan  # noqa: E402
from engine.profile import get_profile, with_tuning  # noqa: E402
from engine.types import ConfigError  # noqa: E402

CHECKPOINT = re.compile(r"q4b_(?P<quant>\w+?)\.gguf$")  # tools/gpu_session.sh's ckpt names


def b1_kernels(plan) -> set:
    """The distinct (spec, block, shared memory) of the plan's batch-1 decode launches."""
    return {
        (la.spec, la.block, la.smem)
        for step in plan.steps
        for mode in ("decode1", "short", "short1")
        for la in step.launches.get(mode, ())
    }


def check(family: str, shape: str, quant: str, profile: str, variants: list[tuple[str, str]]) -> list[str]:
    """One line per variant: OK with the kernels it changes, or FAIL with the error."""
    graph = load_family(family)
    dims = dims_for_size(family, shape)
    dtypes = kernel_resources.mixed_dtypes(quant, dims["layers"])
    base = get_profile(profile)

    def plan_for(spec: str):
        prof = with_tuning(base, spec) if spec.strip() else base
        return build_plan(graph, dims, graph.quant(quant), prof, tensor_dtypes=dtypes)

    ref = b1_kernels(plan_for(""))
    lines = []
    for name, spec in variants:
        try:
            mine = b1_kernels(plan_for(spec))
        except (ConfigError, ValueError, KeyError) as exc:
            lines.append(f"FAIL {name}: {type(exc).__name__}: {exc}")
            continue
        lines.append(f"OK   {name}: {len(mine - ref)} of {len(mine)} batch-1 kernels differ from the profile's")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--model", default=None, help="a tools/gpu_session.sh checkpoint path (q4b_<quant>.gguf)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC")
    ap.add_argument("--shapes", default=None, help="comma-separated sizes, bf16 (tools/gpu_decode_profile.py's)")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--batches", help=argparse.SUPPRESS)
    ap.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    variants = [tuple(v.split("=", 1)) for v in args.variant]
    if any(len(v) != 2 for v in variants):
        ap.error("--variant takes NAME=SPEC")
    shapes = [s for s in (args.shapes or "").split(",") if s and s != "none"]
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {unknown}; tools/make_checkpoint.py writes {sorted(SHAPES)}")
    cases = [(SHAPES[s][0], s, "bf16") for s in shapes]
    quant = args.quant
    if quant is None and args.model and (m := CHECKPOINT.search(args.model)):
        quant = m.group("quant")
    if quant is not None:
        cases.append((args.family, args.shape, quant))
    if not cases:
        ap.error("--quant, --shapes or a --model named q4b_<quant>.gguf is required")
    failed = False
    for family, shape, q in cases:
        lines = check(family, shape, q, args.profile, variants)
        print(f"{shape} {q} on {args.profile}: {len(variants)} variants")
        print("\n".join(lines))
        failed |= any(line.startswith("FAIL") for line in lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
