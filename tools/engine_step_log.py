"""Where a concurrent run's time goes, step by step: the engine loop at concurrency c (closed batch,
distinct prompts, no prefix hits: engine.bench.bench_engine) with every runner call timed on the
host — ``step`` / ``launch`` / ``collect`` and, on the CUDA runner, inside a step the prefill
passes, the prompt-tail passes (engine.runner_tail.run_tails) and the decode passes.

Usage: PYTHONPATH=. python tools/engine_step_log.py MODEL [--backend cuda] [--concurrency 32]
           [--prompt-tokens 600] [--gen-tokens 128] [--json OUT]
Prints the run's throughput and TTFT / ITL, then per call kind: calls, rows, total and mean ms, and
how much of the time before the median request's first token each kind took. The kinds nest: a
``step`` holds its prefill passes, its ``tails`` (their ``tail pass`` calls) and its decode passes. ``--json`` keeps every
call (kind, start ms, duration ms, rows). Host times: a call that waits for the GPU includes the
wait. Reaches the runner only through its methods; must not import CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine.runner_steps as runner_steps  # noqa: E402
from engine.backend import create_runner  # noqa: E402
from engine.bench import ENGINE_CHUNK, NullTokenizer, bench_engine  # noqa: E402
from engine.loop import Engine, EngineConfig  # noqa: E402
from engine.model import load_model  # noqa: E402


class CallLog:
    """Timed calls: (kind, start ms from ``reset``, duration ms, rows)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float, int]] = []
        self.t0 = time.perf_counter()

    def reset(self) -> None:
        self.calls.clear()
        self.t0 = time.perf_counter()

    def wrap(
        self, kind: str | Callable[[dict], str], fn: Callable[..., Any], rows: Callable[[tuple], int]
    ) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            end = time.perf_counter()
            name = kind(kwargs) if callable(kind) else kind
            self.calls.append((name, (start - self.t0) * 1e3, (end - start) * 1e3, rows(args)))
            return out

        return timed


def _tokens(args: tuple) -> int:
    return sum(len(it.token_ids) for it in args[0]) if args and isinstance(args[0], (list, tuple)) else 0


def instrument(runner: Any, log: CallLog) -> None:
    """Wrap the runner's calls (those it has) and the tail passes of engine.runner_steps."""
    for name in ("step", "launch"):
        if callable(getattr(runner, name, None)):
            setattr(runner, name, log.wrap(name, getattr(runner, name), _tokens))
    if callable(getattr(runner, "collect", None)):
        runner.collect = log.wrap("collect", runner.collect, lambda a: 0)
    if callable(getattr(runner, "_run_prefill_pass", None)):
        runner._run_prefill_pass = log.wrap("prefill pass", runner._run_prefill_pass, lambda a: len(a[0]))
    if callable(getattr(runner, "_decode", None)):
        kind = lambda kw: "tail pass" if kw.get("tail") or kw.get("exact") else "decode pass"  # noqa: E731
        runner._decode = log.wrap(kind, runner._decode, lambda a: len(a[0]))
    runner_steps.run_tails = log.wrap("tails", runner_steps.run_tails, lambda a: sum(t for _, t in a[1]))


def summary(calls: list[tuple[str, float, float, int]], ttft_p50_ms: float) -> list[dict]:
    """Per kind: calls, rows, total ms, mean ms, and ms spent before ``ttft_p50_ms``."""
    kinds: dict[str, dict] = {}
    for kind, start, dur, rows in calls:
        k = kinds.setdefault(
            kind, {"kind": kind, "calls": 0, "rows": 0, "total_ms": 0.0, "before_ttft_ms": 0.0}
        )
        k["calls"] += 1
        k["rows"] += rows
        k["total_ms"] += dur
        k["before_ttft_ms"] += max(0.0, min(start + dur, ttft_p50_ms) - start)
    for k in kinds.values():
        k["mean_ms"] = k["total_ms"] / k["calls"]
    return list(kinds.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    runner = create_runner(model, args.backend, prefill_chunk_tokens=ENGINE_CHUNK)
    log = CallLog()
    instrument(runner, log)
    engine = Engine(
        runner, NullTokenizer(), EngineConfig(max_running=args.concurrency, prefill_chunk_tokens=ENGINE_CHUNK)
    )
    engine.start()
    vocab = int(model.dims["vocab"])
    try:
        bench_engine(engine, 1, args.prompt_tokens, 4, vocab=vocab)  # warm-up (graph captures)
        log.reset()
        run = bench_engine(engine, args.concurrency, args.prompt_tokens, args.gen_tokens, vocab=vocab)
    finally:
        engine.shutdown(10)
    rows = summary(log.calls, float(run["ttft_p50_ms"]))
    print(
        f"c={args.concurrency}, {args.prompt_tokens}-token prompts, {args.gen_tokens} tokens: "
        f"{run['aggregate_tok_s']:.1f} tok/s, TTFT p50 {run['ttft_p50_ms']:.1f} ms, ITL p50 {run['itl_p50_ms']:.2f} ms"
    )
    print(f"{'call':<14}{'calls':>7}{'rows':>8}{'total ms':>11}{'mean ms':>10}{'before TTFT p50':>17}")
    for r in rows:
        print(
            f"{r['kind']:<14}{r['calls']:>7}{r['rows']:>8}{r['total_ms']:>11.1f}{r['mean_ms']:>10.3f}{r['before_ttft_ms']:>14.1f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run, "kinds": rows, "calls": log.calls}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
