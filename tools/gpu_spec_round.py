"""Where a speculative round's time goes on the GPU (issue #38): the verify pass against a plain
batch-1 decode step, then the engine's round split by phase.

    PYTHONPATH=. python3 tools/make_checkpoint.py --shape smollm2-135m --gguf q4_1 --out /dev/shm/smol.gguf
    PYTHONPATH=. python3 tools/gpu_spec_round.py /dev/shm/smol.gguf [--k 4] [--depths 64,400] \
        [--breakdown] [--no-engine] [--json OUT]

The target: a round that verifies k drafted tokens and emits k + 1 costs at most (k + 1) / (0.8 (k + 1))
= 1.25 plain batch-1 steps (a draft model with 100 % acceptance reaches 0.8 (k + 1) x). Three parts:

* ``passes`` (GPU time only: CUDA events around back-to-back replays of one graph, inputs as the
  engine fills them, at each ``--depths`` context): ``plain b1`` (the batch-1 decode graph of a plain
  step), ``verify`` (the k + 1 rows of one sequence's draft as the engine runs them: a graph of
  exactly k + 1 rows through the plain decode launches and, below split_kv_tokens where the plan
  folds the rope into the short attention, its verify launches, engine.ir.VSHORT; with its logits
  against the plain launches', ``max_abs_diff`` 0 where the bits agree), ``verify unfolded`` (the
  same rows through the plain decode launches: the rope kernel and the split attention below
  split_kv_tokens too, the verify pass itself past it), ``verify before`` (those
  padded to the decode bucket: what verify ran before), ``short n`` (k + 1 rows through the plain
  short-context launches with the folded rope: timing only, the rows race on their KV), and
  ``rows n`` (plain decode graphs of n = 1 .. 8 rows, long launches: how a pass's cost grows with
  its rows), each with its launch count;
* ``kernels`` (``--breakdown``): the launches of the b1 pass and of the verify pass timed alone
  (tools/gpu_decode_profile.py's breakdown), so the two passes can be compared launch by launch;
* ``round``: the engine end to end on one greedy request (``--max-tokens``, EOS ignored), speculation
  off, then on with the off run's own continuation as the draft (100 % acceptance): per round the
  wall time split into schedule, attach (policy, proposer, blocks), verify on the host, the wait for
  the device (the stream synchronisations), apply (append, detokenise, stop checks, events, KV
  rollback) and the rest of the loop, and apart ``in pass`` (the previous round's text and events,
  streamed while the pass runs: engine.loop_stream), with graph replays, host<->device copies and synchronisations
  counted per round; against the plain step's wall time, the round in plain steps and the speedup
  (``overlap``: plain decode with EngineConfig.overlap, for reference).

Prints a table; ``--json`` writes every figure. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from engine.spec.proposer import Draft  # noqa: E402
from engine.types import GenerationRequest, SamplingParams, StepItem  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


class ReplayProposer:
    """Drafts the recorded greedy continuation of the prompt (100 % acceptance)."""

    name = "replay"

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len, self.cont = prompt_len, continuation

    def propose(self, requests):
        return [Draft(list(self.cont[len(r.tokens) - self.prompt_len :][: r.k])) for r in requests]

    def release(self, seq_id: int) -> None:
        pass


def rows_of(start: int, n: int, table: list[int]) -> list[StepItem]:
    """n decode rows of one sequence at positions start .. start + n - 1 (a verify pass's rows)."""
    return [StepItem(0, [(37 * (start + j)) % 500 + 3], start + j, table, True, GREEDY) for j in range(n)]


def pass_graph(runner, items: list[StepItem], short: bool, exact: bool, verify: bool = False):
    """The graph the runner replays for these decode rows (inputs filled), its launch count and rows."""
    bucket, _ = runner._fill_decode(items, None, (), len(items) if exact else 0)
    graph = runner._graph(bucket, "greedy", short, io=True, verify=verify)
    key = (bucket, "greedy", short, True, *(("verify",) if verify else ()))
    return graph, len(runner._graphs[key][1]), bucket


def verify_path(runner, short: bool) -> tuple[bool, bool]:
    """(short, verify) of the engine's verify pass at a context class (engine.spec.cuda_verify)."""
    from engine.spec.cuda_verify import has_verify_short, short_is_safe

    return short and (short_is_safe(runner.plan) or has_verify_short(runner.plan)), True


def prefill(runner, depths: list[int]) -> list[int]:
    """Sequence 0's KV for every depth (a fixed prompt); returns its block table."""
    table = list(range(-(-(max(depths) + 16) // runner.block_size)))
    prompt = [(7 * i) % 500 + 3 for i in range(max(depths))]
    runner.step([StepItem(0, prompt, 0, table, True, GREEDY)])
    return table


def passes(cuda, runner, k: int, depths: list[int], breakdown: bool) -> dict:
    from gpu_decode_profile import time_graph

    from engine.spec.cuda_verify import has_verify_short, short_is_safe

    table = prefill(runner, depths)
    out: dict = {
        "short_context": runner.plan.short_context,
        "verify_short_ok": short_is_safe(runner.plan),
        "verify_vshort": has_verify_short(runner.plan),
        "depths": {},
    }
    for depth in depths:
        short = depth + k < runner.plan.short_context
        res: dict = {}
        g, n_launch, _ = pass_graph(runner, rows_of(depth, 1, table), short, True)
        res["plain b1"] = {"us": time_graph(cuda, g, runner.stream, 50), "launches": n_launch}
        vs, vv = verify_path(runner, short)
        plain_short = short and short_is_safe(runner.plan)
        for label, exact, sh, ver in (
            ("verify", True, vs, vv),  # what the engine runs
            ("verify unfolded", True, plain_short, False),  # exact rows, the plain decode launches
            ("verify before", False, plain_short, False),  # the bucket's rows, the plain decode launches
            (f"short {k + 1}", True, short, False),  # the folded rope (timing only: the rows race)
        ):
            g, n_launch, bucket = pass_graph(runner, rows_of(depth, k + 1, table), sh, exact, ver)
            res[label] = {"us": time_graph(cuda, g, runner.stream, 50), "launches": n_launch, "rows": bucket}
        # the verify pass's logits against the plain decode launches' (bits: max |diff| 0)
        got, ref = verify_logits(runner, k, depth, table), verify_logits(runner, k, depth, table, plain=True)
        with np.errstate(invalid="ignore"):  # (a NaN in either shows as nan)
            res["verify"]["max_abs_diff"] = float(np.max(np.abs(got - ref)))
        res["verify"]["same_argmax"] = bool((got.argmax(1) == ref.argmax(1)).all())
        for n in range(1, 9):
            g, n_launch, _ = pass_graph(runner, rows_of(depth, n, table), False, True)
            res[f"rows {n}"] = {"us": time_graph(cuda, g, runner.stream, 50), "launches": n_launch}
        for row in res.values():
            row["us"] = round(row["us"], 1)
            row["plain_steps"] = round(row["us"] / res["plain b1"]["us"], 3)
        if breakdown and depth == depths[0]:
            res["kernels"] = kernel_breakdown(cuda, runner, k, depth, table, short)
        out["depths"][depth] = res
    return out


def kernel_breakdown(cuda, runner, k: int, depth: int, table: list[int], short: bool) -> dict:
    """Each distinct launch of the b1 pass and of the verify pass timed alone (per pass, sorted)."""
    from gpu_decode_profile import breakdown, pass_labels, pass_weight_bytes

    from engine.runner_cuda import _decode_mode

    out = {}
    vs, vv = verify_path(runner, short)
    for name, n, sh, ver in (("plain b1", 1, short, False), ("verify", k + 1, vs, vv)):
        pass_graph(runner, rows_of(depth, n, table), sh, True, ver)
        bound = runner._graphs[(n, "greedy", sh, True, *(("verify",) if ver else ()))][1]
        mode = _decode_mode(n, runner.plan.wide_rows)
        labels = pass_labels(runner, mode, sh, "greedy", ver, rows=n)
        nbytes = pass_weight_bytes(runner, mode, sh, "greedy", ver, rows=n)
        rows = breakdown(cuda, runner, bound, labels, nbytes, None)
        out[name] = {"kernel_sum_us": round(sum(r["total_us"] for r in rows), 1), "launches": rows}
    return out


def verify_logits(runner, k: int, depth: int, table: list[int], plain: bool = False):
    """The logits of the engine's verify pass over k + 1 rows at ``depth`` (after ``prefill``);
    ``plain``: through the plain decode launches (long-context ones where the short rope is folded)."""
    from engine.spec.cuda_verify import short_is_safe

    short = depth + k < runner.plan.short_context
    vs, vv = (short and short_is_safe(runner.plan), False) if plain else verify_path(runner, short)
    graph, _, _ = pass_graph(runner, rows_of(depth, k + 1, table), vs, True, vv)
    graph.launch(runner.stream)
    return runner.read_logits(k + 1).copy()


class Probe:
    """Wall time per phase of the engine's steps, and the driver calls made in them."""

    def __init__(self, cuda, engine, runner):
        self.cuda, self.engine, self.runner = cuda, engine, runner
        self.phase: Counter = Counter()
        self.calls: Counter = Counter()
        self.steps: list[float] = []
        self._undo: list = []

    def _wrap(self, owner, name: str, phase: str | None = None, count: str | None = None) -> None:
        fn = getattr(owner, name)
        had = name in vars(owner)

        def wrapped(*a, **kw):
            if count:
                self.calls[count] += 1
            if phase is None:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.phase[phase] += time.perf_counter() - t0

        setattr(owner, name, wrapped)
        self._undo.append((owner, name, fn if had else None))

    def __enter__(self):
        e, r, cuda = self.engine, self.runner, self.cuda
        self._wrap(e, "_schedule", "schedule")
        self._wrap(e, "_apply", "apply")
        if e.spec is not None:
            self._wrap(e.spec, "attach", "attach")
            self._wrap(e, "_stream_deferred", "in pass")
        self._wrap(e, "_run_step", "runner")
        self._wrap(r.stream, "synchronize", "wait", count="synchronize")
        self._wrap(cuda.Graph, "launch", count="graph launch")
        for name in ("htod", "dtoh", "dtod"):
            self._wrap(cuda, name, count=name)
        self._wrap(cuda.PreparedLaunch, "__call__", count="eager launch")
        step = e._step

        def timed_step():
            t0 = time.perf_counter()
            step()
            self.steps.append(time.perf_counter() - t0)

        e._step = timed_step
        self._undo.append((e, "_step", None))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._undo):
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)


def engine_round(cuda, runner, tok, prompt: list[int], k: int, max_tokens: int) -> dict:
    from engine.engine_config import EngineConfig
    from engine.loop import Engine
    from engine.spec.config import SpecConfig
    from engine.spec.speculator import Speculator

    out: dict = {}
    recorded: list[int] = []
    for mode in ("off", "replay", "overlap"):
        spec = None
        if mode == "replay":
            spec = Speculator(ReplayProposer(len(prompt), recorded), SpecConfig("ngram", k=k))
            runner.prepare_verify(k)  # (as engine.spec.build does)
        e = Engine(runner, tok, EngineConfig(overlap=mode == "overlap"), speculator=spec)
        warm = e.submit(GenerationRequest("warm", prompt, GREEDY, max_tokens=2 * k + 2, ignore_eos=True))
        # the warm-up request runs in-thread too: graphs captured before timing
        e._drain_inbox(False)
        while e.scheduler.running or e.scheduler.waiting:
            e._step()
        list(warm)
        h = e.submit(GenerationRequest("r", prompt, GREEDY, max_tokens=max_tokens, ignore_eos=True))
        e._drain_inbox(False)
        e._step()  # the prefill (not timed)
        before = spec.stats() if spec is not None else {}
        probe = Probe(cuda, e, runner)
        with probe:
            while e.scheduler.running:
                e._step()
            e._drop_pending()  # (an overlapped step still queued)
        toks = [t for ev in h for t in ev.token_ids]
        if mode == "off":
            recorded[:] = toks
        rounds = len(probe.steps)
        total = sum(probe.steps)
        ph = dict(probe.phase)
        wait = ph.pop("wait", 0.0)
        runner_s = ph.pop("runner", 0.0)
        inpass = ph.pop("in pass", 0.0)  # (the previous round's events, streamed while the pass runs)
        split = {
            "schedule": ph.get("schedule", 0.0),
            "attach": ph.get("attach", 0.0),
            "runner host": runner_s - wait - inpass,
            "device wait": wait,
            "apply": ph.get("apply", 0.0),
        }
        split["loop other"] = total - sum(split.values()) - inpass
        split["in pass"] = inpass
        row = {
            "tokens": len(toks) - 1,
            "rounds": rounds,
            "tokens_per_round": round((len(toks) - 1) / max(rounds, 1), 3),
            "round_us": round(1e6 * total / max(rounds, 1), 1),
            "median_round_us": round(1e6 * statistics.median(probe.steps), 1) if probe.steps else None,
            "split_us": {kk: round(1e6 * v / max(rounds, 1), 1) for kk, v in split.items()},
            "per_round": {kk: round(v / max(rounds, 1), 2) for kk, v in probe.calls.items()},
            "exact": mode == "off" or toks == recorded,
        }
        if spec is not None:
            row.update({kk: v - before[kk] for kk, v in spec.stats().items()})
        out[mode] = row
    off, on = out["off"], out["replay"]
    on["round_in_plain_steps"] = round(on["round_us"] / off["round_us"], 3)
    on["speedup"] = round(off["round_us"] * on["tokens_per_round"] / on["round_us"], 3)
    on["target_speedup"] = round(0.8 * (k + 1), 2)
    return out


def report(res: dict) -> str:
    lines = [f"device {res['device']}, model {res['model']}, k={res['k']}"]
    p = res["passes"]
    lines.append(
        f"passes (GPU us per replay; short_context {p['short_context']}; plain short launches safe for verify: "
        f"{p['verify_short_ok']}, VSHORT launches: {p['verify_vshort']}); `verify` is the engine's pass, "
        "`rows n` plain decode graphs of n rows (the long launches)"
    )
    for depth, rows in p["depths"].items():
        for name, r in rows.items():
            if name == "kernels":
                continue
            extra = f"  ({r['rows']} rows)" if "rows" in r else ""
            if "max_abs_diff" in r:
                extra += f"  logits vs unfolded: max |diff| {r['max_abs_diff']:.3g}, same argmax {r['same_argmax']}"
            lines.append(
                f"  depth {depth:>5}  {name:<16} {r['us']:8.1f} us  {r['plain_steps']:5.2f} plain steps  "
                f"{r['launches']:4d} launches{extra}"
            )
        for name, kb in rows.get("kernels", {}).items():
            lines.append(f"  depth {depth} kernels of {name}: sum {kb['kernel_sum_us']} us")
            for kr in kb["launches"]:
                lines.append(
                    f"    {kr['total_us']:8.1f} us  {kr['count']:4d} x {kr['us']:7.2f}  grid {kr['grid']} x {kr['block']}  "
                    f"{kr['label'][:100]}"
                )
    r = res.get("round")
    if r:
        lines.append("engine round (wall us per round; per-round driver calls)")
        for mode, row in r.items():
            split = "  ".join(f"{kk} {v:.1f}" for kk, v in row["split_us"].items())
            calls = "  ".join(f"{kk} {v}" for kk, v in sorted(row["per_round"].items()))
            lines.append(
                f"  {mode:<7} {row['round_us']:8.1f} us/round (median {row['median_round_us']})  "
                f"{row['tokens_per_round']:.2f} tok/round  exact {row['exact']}"
            )
            lines.append(f"          split: {split}")
            lines.append(f"          calls: {calls}")
        on = r["replay"]
        lines.append(
            f"  replay round = {on['round_in_plain_steps']:.2f} plain steps; speedup {on['speedup']:.2f}x "
            f"(target {on['target_speedup']}x: a round of <= 1.25 plain steps at k=4)"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--depths", default="64,400")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--breakdown", action="store_true", help="per-launch times of the b1 and verify passes")
    ap.add_argument("--no-engine", action="store_true", help="the pass times only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("MEMRA_CACHE_DIR", os.environ.get("MEMRA_CACHE_DIR") or tempfile.mkdtemp(prefix="memra-cache-"))

    from engine import cuda
    from engine.backend import resolve_model_path
    from engine.bench import NullTokenizer
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner
    from engine.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    model = load_model(path)
    try:
        tok = load_tokenizer(model.weights)
    except Exception:  # a checkpoint without a tokenizer: ids only
        tok = NullTokenizer()
    # one KV pool (window_kv_blocks=0): the passes' rows carry plain block tables, which a runner
    # with a sliding-window pool (Gemma 3's default) refuses (engine.runner_kv)
    runner_args = {"max_model_len": 4096, "num_blocks": 2048, "window_kv_blocks": 0}
    runner = CudaRunner(model, **runner_args)
    res: dict = {"device": runner.ctx.info.name, "model": str(path), "k": args.k}
    depths = [int(d) for d in args.depths.split(",")]
    try:
        res["passes"] = passes(cuda, runner, args.k, depths, args.breakdown)
        if not args.no_engine:
            prompt = [(11 * i) % 400 + 5 for i in range(args.prompt_tokens)]
            res["round"] = engine_round(cuda, runner, tok, prompt, args.k, args.max_tokens)
    finally:
        runner.close()

    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
