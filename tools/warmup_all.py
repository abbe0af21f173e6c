"""Warm the kernel cache for every family x quant combo x size x device profile (for building images).

Uses the same function as `memra warmup` (engine.cli.warmup). No GPU needed; NVRTC only.

    python tools/warmup_all.py [--family F ...] [--quant Q ...] [--profile P ...] [--jobs N] [--json out.json]

Set MEMRA_CACHE_DIR to choose the cache; a second run reports 100% hits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.cli import warmup
from engine.graph import all_families
from engine.model import dims_for_size
from engine.profile import all_profiles
from engine.types import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", help="limit to these families (repeatable)")
    ap.add_argument("--quant", action="append", help="limit to these combos (repeatable)")
    ap.add_argument("--profile", action="append", help="limit to these device profiles (repeatable)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    families = all_families()
    profiles = [p for n, p in all_profiles().items() if not args.profile or n in args.profile]
    targets = []
    for fname, graph in families.items():
        if args.family and fname not in args.family:
            continue
        if graph.sizes and profiles and not _plannable(graph, fname, profiles[0]):
            continue
        for qname, combo in graph.quants.items():
            if args.quant and qname not in args.quant:
                continue
            for size in graph.sizes:
                for style in sorted(set(graph.rope_style.values())):
                    targets.append(
                        (
                            f"{fname}/{size}/{qname}/{style}",
                            graph,
                            dims_for_size(fname, size),
                            combo,
                            style,
                            None,
                        )
                    )
    t0 = time.perf_counter()
    summary = warmup(targets, profiles, jobs=args.jobs)
    summary["targets"] = len(targets)
    summary["profiles"] = [p.name for p in profiles]
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _plannable(graph, fname: str, profile) -> bool:
    """Whether the CUDA plan lowers every op of the family (a family with an op that has no CUDA lowering
    yet is skipped with a note instead of failing the whole warmup)."""
    from engine.plan import build_plan

    combo = next(iter(graph.quants.values()))
    try:
        build_plan(graph, dims_for_size(fname, next(iter(graph.sizes))), combo, profile)
    except ConfigError as e:
        print(f"warmup_all: skipping family {fname}: {e}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
