"""Registers, stack frame and shared memory of a plan's decode kernels, without a GPU.

    python tools/kernel_resources.py --shape qwen3-4b --quant q4_k_m [--tune 'decode_graph.pair_linears=true']
        [--mode decode1] [--profile h200]

Builds the plan of a named size (engine.model.dims_for_size; a q4_k_m / q5_k_m file as llama.cpp
and tests/fixtures/checkpoints.write_random_gguf mix it: q6_k v and down in even layers, q6_k
embedding and head), compiles each distinct kernel of one pass mode with NVRTC for the profile's
arch with ``--ptxas-options=-v``, and prints what ptxas chose: registers per thread, spill bytes
(stores + loads: local memory in the kernel's loops) and shared memory (dynamic from the plan plus
static). It then estimates how many blocks of each launch one SM holds (registers in 256-register
warp units, shared memory with 1 KB reserved per block, threads, 32 blocks), as the occupancy
calculator would: a number to reason with before a GPU run, not a measurement (the driver's
cuOccupancyMaxActiveBlocksPerMultiprocessor is the truth, and the device's NVRTC may allocate
differently). The ``next`` column says whether one block of the kernel launched after it (in the
pass's main stream) fits on an SM beside one of its blocks, or what runs out: under programmatic
dependent launch that decides whether the next kernel's blocks start early. Must not import CUDA
beyond NVRTC.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures.checkpoints import MIXES, mix_tensor_type  # noqa: E402

from engine import nvrtc  # noqa: E402
from engine.graph import load_family  # noqa: E402
from engine.ir import launch_key  # noqa: E402
from engine.model import dims_for_size  # noqa: E402
from engine.plan import build_plan  # noqa: E402
from engine.profile import get_profile, with_tuning  # noqa: E402
from engine.render import render  # noqa: E402
from engine.types import ConfigError  # noqa: E402

# per-SM limits by compute capability: (shared memory bytes, threads)
SM_LIMITS = {"8.0": (164 * 1024, 2048), "8.6": (100 * 1024, 1536), "8.9": (100 * 1024, 1536)}
SM_LIMITS.update({"9.0": (228 * 1024, 2048), "10.0": (228 * 1024, 2048), "12.0": (100 * 1024, 1536)})
_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def ptxas_resources(log: str) -> dict[str, int]:
    """What ptxas -v reported for the one kernel of an NVRTC log: registers, stack frame, spill
    stores / loads and static shared memory, in bytes (0 where it printed none)."""
    if not _PTXAS["registers"].search(log):
        raise ValueError("no 'Used N registers' line in the NVRTC log (compiled without --ptxas-options=-v?)")
    return {k: int(m.group(1)) if (m := rx.search(log)) else 0 for k, rx in _PTXAS.items()}


def blocks_per_sm(regs: int, threads: int, smem: int, cc: str) -> int:
    """The blocks of a kernel one SM holds: registers (per warp, in units of 256), shared memory
    (1 KB reserved per block), threads and the 32-block limit, whichever binds first."""
    smem_sm, threads_sm = SM_LIMITS.get(cc, SM_LIMITS["9.0"])
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (65536 // per_warp) // warps
    by_smem = smem_sm // (smem + 1024)
    return max(0, min(by_regs, by_smem, threads_sm // threads, 32))


def beside(a: tuple[int, int, int], b: tuple[int, int, int], cc: str) -> str:
    """Whether one block of kernel ``b`` fits on an SM that holds one block of kernel ``a`` (each
    (registers, threads, shared memory bytes)): "yes", else what runs out first. Under PDL the
    next kernel's blocks launch while the current one runs, but only where an SM has room."""
    smem_sm, threads_sm = SM_LIMITS.get(cc, SM_LIMITS["9.0"])
    regs = sum(-(-max(r, 1) * 32 // 256) * 256 * -(-t // 32) for r, t, _ in (a, b))
    if regs > 65536:
        return f"regs {regs}"
    if a[2] + b[2] + 2048 > smem_sm:
        return "smem"
    return "yes" if a[1] + b[1] <= threads_sm else "threads"


def mixed_dtypes(quant: str, layers: int) -> dict[str, str]:
    """A mix's tensor types as write_random_gguf makes them (fixtures.checkpoints.mix_tensor_type:
    q6_k v and down in even layers, q6_k embedding and head), in the plan's ``key@layer`` form; {}
    for a plain type (the plan's nominal types)."""
    if quant not in MIXES:
        return {}
    keys = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "exp_down")
    out = {k: mix_tensor_type(quant, k, 1) for k in keys}  # layer 1: the base type everywhere
    out.update({k: mix_tensor_type(quant, k, -1) for k in ("embed", "lm_head")})
    for layer in range(layers):
        out.update({f"{k}@{layer}": t for k in ("wv", "w_down", "exp_down") if (t := mix_tensor_type(quant, k, layer)) != out[k]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--shape", default="qwen3-4b", help="a size of the family YAML")
    ap.add_argument("--quant", default="q4_k_m", help="a quant combo of the family YAML")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--tune", default="", help="MEMRA_TUNE-style overrides: 'section.knob=value; ...'")
    ap.add_argument("--mode", default="decode1",
                    help="the pass: decode1 (batch 1), short1 (batch 1 below the short context), decode, short, prefill")
    args = ap.parse_args(argv)
    graph = load_family(args.family)
    dims = dims_for_size(args.family, args.shape)
    prof = get_profile(args.profile)
    if args.tune:
        prof = with_tuning(prof, args.tune)
    cc = prof.compute_capability
    try:
        plan = build_plan(graph, dims, graph.quant(args.quant), prof, tensor_dtypes=mixed_dtypes(args.quant, dims["layers"]))
    except ConfigError as exc:
        print(f"{args.shape} {args.quant}: no plan: {exc}", file=sys.stderr)
        return 2
    seen: dict = {}
    order = []  # the pass's main-stream launches in order (a concurrent one runs beside, not after)
    for step in plan.steps:
        mode = launch_key(step.launches, "decode1", True) if args.mode == "short1" else args.mode
        for la in step.launches.get(mode, ()):
            key = (la.spec, la.block, la.smem)
            if key not in seen:
                seen[key] = f"{step.op.op} {','.join(step.op.outputs)}"
            if not la.concurrent:
                order.append(key)
    following = {}  # a kernel -> the kernel after its first launch
    for key, nxt in zip(order, order[1:], strict=False):
        following.setdefault(key, nxt)
    res: dict = {}
    for spec, block, smem in seen:
        _, log = nvrtc.compile_to_cubin(render(spec), spec.entry, prof.arch, ["--ptxas-options=-v"])
        try:
            res[(spec, block, smem)] = ptxas_resources(log)
        except ValueError as exc:  # one odd log (seen once with the H200's NVRTC 13.0) must not hide the rest
            res[(spec, block, smem)] = f"{exc}; log {log[:300]!r}"

    def shape(key):  # (registers, threads, shared memory) of a compiled kernel, None if unknown
        r = res.get(key)
        return (r["registers"], key[1][0], key[2] + r["static_smem"]) if isinstance(r, dict) else None

    print(f"{args.shape} {args.quant} on {prof.name} ({prof.arch}, cc {cc}), mode {args.mode}: {len(seen)} kernels")
    print("(next: whether a block of the kernel launched after this one fits on an SM beside one of its blocks)")
    print(f"{'op':<18} {'regs':>4} {'spill':>5} {'threads':>7} {'smem KB':>8} {'blk/SM':>6} {'next':>11}  entry")
    for key, label in seen.items():
        spec, block, _ = key
        r = res[key]
        if not isinstance(r, dict):
            print(f"{label:<18} ?  {spec.entry[:90]}: {r}")
            continue
        regs, threads, total = shape(key)
        n = blocks_per_sm(regs, threads, total, cc)
        spill = r["spill_stores"] + r["spill_loads"]
        nxt = following.get(key)
        fit = beside(shape(key), shape(nxt), cc).replace(" ", "") if nxt and shape(nxt) else "-"
        print(f"{label:<18} {regs:>4} {spill:>5} {threads:>7} {total / 1024:>8.1f} {n:>6} {fit:>11}  {spec.entry[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
