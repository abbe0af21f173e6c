"""Where a decode row's bits part ways (issue #38 item 3, a GPU diagnostic): runs a batched decode
step (or a speculative verify pass) and the same rows one at a time (plain batch-1 decode steps)
eagerly, reads back every plan step's output values after the step's launches, and prints, per
row, the first steps whose outputs differ between the two, with the launches each side ran.

    PYTHONPATH=$PWD python tools/gpu_bits_trace.py --model gemma3-270m batched --depths 5,60,200,250
    PYTHONPATH=$PWD python tools/gpu_bits_trace.py --model smollm2 verify --depth 253

(--model: a checkpoint path, or smollm2 / gemma3-270m for the real files the GPU tests use.)

``batched``: one sequence per depth prefilled, the batch of their next tokens, then each row again
alone (tests/gpu/test_batch_invariance_gpu.py's batched-vs-solo check). ``verify``: sequences A and
B share a prompt of ``depth`` tokens; A decodes 4 plain steps, B verifies A's tokens in one pass
(that test's verify-vs-plain check). One KV pool (``window_kv_blocks=0``: the items carry block
tables only, as in that test).

A step folded away in one of the passes (a norm fused into the next GEMV's prologue, the rope into
the short attention) has no outputs of its own there and is not compared; a step's outputs that
no launch of it wrote in that pass are stale and the first difference is then one step late, never
early. Eager launches (no CUDA graphs), each synchronised: the bits are the graphs' (the same
kernels and arguments). Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


class Tracer:
    """Wraps a CudaRunner's _bind / _run: while ``on``, every step's output values are read back
    after its last launch, rows 0 .. ``rows`` - 1, into ``trace`` as (step index, value, array)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.on = False
        self.rows = 0
        self.trace: list[tuple[int, str, np.ndarray]] = []
        self.ran: dict[int, list[str]] = {}
        plan = runner.plan
        self.step_of = {id(la): i for i, st in enumerate(plan.steps) for las in st.launches.values() for la in las}
        self.bound_step: dict[int, tuple[int, object]] = {}
        bind, run = runner._bind, runner._run

        def traced_bind(launch, shape):
            b = bind(launch, shape)
            self.bound_step[id(b)] = (self.step_of.get(id(launch), -1), launch)
            return b

        def traced_run(bound):
            if not self.on:
                return run(bound)
            for j, b in enumerate(bound):
                run([b])
                runner.stream.synchronize()
                runner._side.synchronize()
                i, launch = self.bound_step.get(id(b), (-1, None))
                self.ran.setdefault(i, []).append(f"{launch.spec.template}:{launch.spec.entry}" if launch else "?")
                nxt = self.bound_step.get(id(bound[j + 1]), (-2, None))[0] if j + 1 < len(bound) else -2
                if i >= 0 and nxt != i:
                    for name in plan.steps[i].op.outputs:
                        if name in plan.values:
                            self.trace.append((i, name, runner.read_value(name, self.rows).copy()))
            return None

        runner._bind = traced_bind
        runner._run = traced_run
        runner._eager.clear()  # (passes bound before: bound again through traced_bind)
        runner._prefill_bound.clear()

    def capture(self, rows: int, fn):
        self.on, self.rows, self.trace, self.ran = True, rows, [], {}
        try:
            out = fn()
        finally:
            self.on = False
        return out, self.trace, self.ran


def compare(plan, a, ran_a, row_a: int, b, ran_b, row_b: int, what: str, limit: int = 6) -> bool:
    """Print the first ``limit`` (step, value) pairs whose row differs; True when all agree."""
    bs = {}
    for i, name, arr in b:
        bs[(i, name)] = arr  # (the last write of the value in that step)
    shown = 0
    seen = set()
    for i, name, arr in a:
        if (i, name) in seen or (i, name) not in bs:
            continue
        seen.add((i, name))
        x, y = arr[row_a], bs[(i, name)][row_b]
        if np.array_equal(x, y, equal_nan=True):
            continue
        st = plan.steps[i]
        bad = np.flatnonzero(x != y)
        print(f"  {what}: step {i} ({st.op.op}, layer {st.layer}) value {name}: {bad.size} of {x.size} differ, "
              f"max |d| {float(np.nanmax(np.abs(x - y))):.3g}; first at {bad[:4].tolist()}\n"
              f"      launches A {ran_a.get(i)}\n      launches B {ran_b.get(i)}")  # fmt: skip
        shown += 1
        if shown >= limit:
            break
    if not shown:
        print(f"  {what}: every compared step output equal ({len(seen)} compared)")
    return not shown


def compare_kv(runner, table_a, table_b, positions) -> bool:
    """The K and V rows each layer holds for ``positions`` of the sequences at ``table_a`` (written
    by plain steps) and ``table_b`` (by the verify pass): print the layers where they differ."""
    from engine import cuda

    d = runner.plan.dims
    row = int(d["kv_heads"]) * int(d["head_dim"])
    bs = runner.block_size
    runner.stream.synchronize()
    bad = []
    for layer in sorted(runner._kv_index):
        for ref in ("k", "v"):
            base = runner._kv_ptr(layer, ref)
            for p in positions:
                got = []
                for table in (table_a, table_b):
                    host = np.empty(row, np.uint16)
                    cuda.dtoh(host, base + (table[p // bs] * bs + p % bs) * row * 2)
                    got.append(host)
                if not np.array_equal(got[0], got[1]):
                    bad.append(f"layer {layer} {ref} pos {p}: {int((got[0] != got[1]).sum())} of {row}")
    print("  KV rows written by the plain steps vs the verify pass:", "; ".join(bad[:12]) if bad else "equal")
    return not bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint path, or smollm2 / gemma3-270m (the cached real files)")
    sub = ap.add_subparsers(dest="case", required=True)
    b = sub.add_parser("batched")
    b.add_argument("--depths", default="5,60,200,250")
    v = sub.add_parser("verify")
    v.add_argument("--depth", type=int, default=253)
    args = ap.parse_args(argv)

    from engine.model import load_model
    from engine.runner_cuda import CudaRunner
    from engine.types import SamplingParams, StepItem

    greedy = SamplingParams(temperature=0.0)
    if args.model == "smollm2":
        from engine.default_model import default_model_path

        path = default_model_path()
    elif args.model == "gemma3-270m":
        from engine.default_model import known_model_path

        path = known_model_path("gemma3-270m")
    else:
        path = Path(args.model)
    model = load_model(path)
    runner = CudaRunner(model, num_blocks=512, max_model_len=1024, use_graphs=False,
                        window_kv_blocks=0)  # fmt: skip
    plan = runner.plan
    print(f"{args.model}: profile {plan.profile}, short_context {plan.short_context}")
    tr = Tracer(runner)
    vocab = int(model.dims["vocab"])
    ok = True
    if args.case == "batched":
        depths = [int(x) for x in args.depths.split(",")]
        rng = np.random.default_rng(0)
        tables, firsts = [], []
        for i, d in enumerate(depths):
            table = list(range(i * 40, i * 40 + 40))
            prompt = [int(t) for t in rng.integers(3, min(vocab, 30000), d)]
            firsts.append(runner.step([StepItem(i, prompt, 0, table, True, greedy)])[0])
            tables.append(table)
        items = [StepItem(i, [t], d, tables[i], True, greedy) for i, (d, t) in enumerate(zip(depths, firsts, strict=True))]
        _, tb, rb = tr.capture(len(items), lambda: runner.step(items))
        for r, it in enumerate(items):
            _, t1, r1 = tr.capture(1, lambda it=it: runner.step([it]))
            ok &= compare(plan, t1, r1, 0, tb, rb, r, f"depth {depths[r]} solo (A) vs row {r} of the batch (B)")
    else:
        depth = args.depth
        rng = np.random.default_rng(1)
        prompt = [int(t) for t in rng.integers(3, min(vocab, 30000), depth)]
        ta, tb_ = list(range(0, 40)), list(range(40, 80))
        tok = runner.step([StepItem(0, prompt, 0, ta, True, greedy)])[0]
        runner.step([StepItem(1, prompt, 0, tb_, True, greedy)])
        toks, plain = [tok], []
        for j in range(4):
            ids, t1, r1 = tr.capture(1, lambda j=j: runner.step([StepItem(0, [toks[-1]], depth + j, ta, True, greedy)]))
            toks.append(ids[0])
            plain.append((t1, r1))
        item = StepItem(1, toks[:4], depth, tb_, True, greedy, history=prompt + toks[:1], draft=toks[1:4])
        out, tv, rv = tr.capture(4, lambda: runner.verify([item]))
        for j in range(4):
            ok &= compare(plan, plain[j][0], plain[j][1], 0, tv, rv, j, f"pos {depth + j} plain (A) vs verify row {j} (B)")
        print("verify accepted", out, "plain", toks[1:5])
        ok &= compare_kv(runner, ta, tb_, range(depth, depth + 4))
    runner.close()
    print("ALL EQUAL" if ok else "DIFFERENCES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
