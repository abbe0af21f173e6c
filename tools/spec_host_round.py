"""Where a speculative round's host time goes, on a CPU: the engine loop over a CudaRunner on the
fake driver of tests/test_plan_runner_fake.py (no GPU), real model plan and tokenizer (default:
the embedded SmolLM2-135M-Instruct Q4_1), batch 1, greedy, EOS ignored.

    PYTHONPATH=. python tools/spec_host_round.py [MODEL] [--k 4] [--max-tokens 600] [--repeats 5]
        [--plain-us 556] [--verify-us 705] [--profile]

The fake "model" continues a fixed text: every decode pass writes, as row r's sampled id, the
text's token at position ``positions[r] + 1`` (the prompt is the text's first ``--prompt-tokens``),
so speculation ``off`` and ``replay`` (the off run's own continuation as the draft: 100 %
acceptance, as tools/bench_spec.py's replay mode) emit the same text, which is checked. Each pass
costs GPU time: the stream's synchronisation spins until ``--plain-us`` (a b1 step) or
``--verify-us`` (a verify pass) after the graph launch (H100 2026-12-07, SmolLM2 Q4_1: 556 and
705 us); ``--plain-us 0 --verify-us 0`` gives the host time alone. Per mode, the request of
``--repeats`` with the least median round: wall us per round (median; with no pass time, also the median of each round's wall less its
``in pass`` work: the host time a device pass would not hide), tokens per round, and the round's mean split
into schedule,
attach (policy, proposer, blocks), runner host (the verify call less the wait and the in-pass work), the wait for the device, and
apply (accept bookkeeping, KV rollback, detokenisation, events), with the host work the engine
does while the pass runs (``in pass``: engine.loop_stream) counted apart; then the
replay speedup (off round wall x tokens per round / replay round wall) against 0.8 x (k + 1).
``--threaded N`` also runs N requests a mode through the engine's own thread with a client reading
the events (tools/bench_spec.py's run_one: decode tok/s between the first and the last event),
the modes interleaved, and prints the medians. ``--profile`` prints the cProfile top of one
replay request. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]

import numpy as np  # noqa: E402
from bench_spec import run_one  # noqa: E402

from engine.spec.proposer import Draft  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every night for "
    "forty years the keeper climbed its one hundred and twelve steps, trimmed the wick, wound the "
    "clockwork that turned the lens, and wrote the weather in a leather book. "
)


class ReplayProposer:
    """Drafts the recorded greedy continuation of the prompt (100 % acceptance)."""

    name = "replay"

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len, self.cont = prompt_len, continuation

    def propose(self, requests):
        return [Draft(self.cont[len(r.tokens) - self.prompt_len :][: r.k]) for r in requests]

    def release(self, seq_id: int) -> None:
        pass


class FakeDevice:
    """The runner's decode passes write the text's next tokens and take
    ``plain_us`` / ``verify_us``; the stream's synchronisation waits for its end (spinning, the GIL let go)."""

    def __init__(self, runner, script: np.ndarray, plain_us: float, verify_us: float):
        self.runner, self.script = runner, script
        self.plain_s, self.verify_s = plain_us * 1e-6, verify_us * 1e-6
        self.busy_until = 0.0
        cls = type(runner)
        launch = cls._launch_decode_pass

        def launch_pass(r, bucket, *a, **kw):
            v = r._views
            v["out_ids"][:bucket] = script[(v["positions"][:bucket] + 1) % len(script)]
            self.busy_until = time.perf_counter() + (self.plain_s if bucket == 1 else self.verify_s)
            return launch(r, bucket, *a, **kw)

        cls._launch_decode_pass = launch_pass
        sync = type(runner.stream).synchronize

        def synchronize(stream):
            # (the GIL is let go while waiting, as the driver's synchronisation does)
            while (left := self.busy_until - time.perf_counter()) > 0:
                time.sleep(left - 2e-4 if left > 4e-4 else 0)
            return sync(stream)

        type(runner.stream).synchronize = synchronize


class Split:
    """Wall time per phase of the engine's steps (perf_counter around the functions doing them)."""

    def __init__(self, engine, runner):
        self.t: Counter = Counter()
        self._undo: list = []
        self._wrap(engine, "_schedule", "schedule")
        self._wrap(engine, "_apply", "apply")
        self._wrap(engine, "_run_step", "runner")
        self._wrap(runner, "_launch_decode_pass", "launch")
        self._wrap(runner.stream, "synchronize", "wait")
        if engine.spec is not None:
            self._wrap(engine.spec, "attach", "attach")
        if callable(getattr(engine, "_stream_deferred", None)):
            self._wrap(engine, "_stream_deferred", "in pass")

    def _wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)
        t = self.t

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t[phase] += time.perf_counter() - t0

        setattr(owner, name, wrapped)
        self._undo.append((owner, name))

    def close(self) -> None:
        for owner, name in self._undo:
            delattr(owner, name)

    def split(self, total: float, rounds: int) -> dict[str, float]:
        t = dict(self.t)
        inpass = t.get("in pass", 0.0)
        wait = t.get("wait", 0.0)
        # (the deferred streaming runs inside the runner call, between the launch and the wait)
        runner_host = t.get("runner", 0.0) - wait - inpass
        out = {
            "schedule": t.get("schedule", 0.0),
            "attach": t.get("attach", 0.0),
            "runner host": runner_host,
            "wait": wait,
            "apply": t.get("apply", 0.0),
        }
        out["loop other"] = total - sum(out.values()) - inpass
        out["in pass"] = inpass
        return {k: round(1e6 * v / rounds, 1) for k, v in out.items()}


def run_mode(engine, runner, prompt: list[int], max_tokens: int, want: list[int] | None, prof=None):
    h = engine.submit(GenerationRequest(f"r{time.perf_counter_ns()}", prompt, GREEDY, max_tokens=max_tokens, ignore_eos=True))
    engine._drain_inbox(False)
    engine._step()  # the prefill (not timed)
    split = Split(engine, runner)
    walls, critical = [], []
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    try:
        while engine.scheduler.running:
            t1, hidden = time.perf_counter(), split.t["in pass"]
            engine._step()
            walls.append(time.perf_counter() - t1)
            critical.append(walls[-1] - (split.t["in pass"] - hidden))
    finally:
        total = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        split.close()
    toks = [t for ev in h for t in ev.token_ids]
    # (the prefill's token is whatever the fake left in the pinned ids: compare the decode rounds')
    if want is not None and toks[1:] != want[1:]:
        at = next((i for i, (a, b) in enumerate(zip(toks, want, strict=False)) if a != b), min(len(toks), len(want)))
        raise SystemExit(f"speculation changed the output at token {at} of {len(toks)} ({len(want)} wanted)")
    rounds = len(walls)
    return toks, (statistics.median(walls), statistics.median(critical)), rounds, split.split(total, rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plain-us", type=float, default=556.0)
    ap.add_argument("--verify-us", type=float, default=705.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threaded", type=int, default=0, metavar="N", help="also N requests per mode through the engine thread")
    args = ap.parse_args()

    from test_plan_runner_fake import FakeDriver, fake_builder

    import engine.runner_cuda as rc
    from engine.backend import resolve_model_path
    from engine.engine_config import EngineConfig
    from engine.loop import Engine
    from engine.model import load_model
    from engine.spec.config import SpecConfig
    from engine.spec.speculator import Speculator
    from engine.tokenizer import load_tokenizer

    mod = FakeDriver().module()
    rc.cuda = mod
    path = resolve_model_path(args.model)
    model = load_model(path)
    tok = load_tokenizer(model.weights)
    builder = fake_builder(Path(tempfile.mkdtemp(prefix="memra-fake-")))
    runner = rc.CudaRunner(model, num_blocks=512, max_model_len=4096, window_kv_blocks=0, builder=builder)
    copies = 1 + (args.prompt_tokens + args.max_tokens) // len(tok.encode(TEXT))
    script = np.array(tok.encode(TEXT * (copies + 1)), np.int64)
    FakeDevice(runner, script, args.plain_us, args.verify_us)
    prompt = [int(t) for t in script[: args.prompt_tokens]]
    cont = [int(t) for t in script[args.prompt_tokens : args.prompt_tokens + args.max_tokens]]
    runner.prepare_verify(args.k)
    runner.ctx.make_current = lambda: None  # (the fake context, for the engine thread)
    rows = {}
    threaded: dict[str, list[float]] = {"off": [], "replay": []}
    for mode in ("off", "replay"):
        spec = None
        if mode == "replay":
            spec = Speculator(ReplayProposer(len(prompt), cont), SpecConfig("ngram", k=args.k))
        engine = Engine(runner, tok, EngineConfig(overlap=False), speculator=spec)
        run_mode(engine, runner, prompt, 4 * args.k + 2, None)  # warm-up
        best = None
        for _ in range(args.repeats):
            toks, median, rounds, split = run_mode(engine, runner, prompt, args.max_tokens, cont)
            if best is None or median < best[0]:
                best = (median, rounds, split, len(toks))
        (median, critical), rounds, split, n = best  # (n - 1: the prefill, untimed, gave the first)
        rows[mode] = {"round_us": 1e6 * median, "critical_us": 1e6 * critical, "tokens_per_round": (n - 1) / rounds, "split": split}
        if args.profile and mode == "replay":
            prof = cProfile.Profile()
            run_mode(engine, runner, prompt, args.max_tokens, cont, prof)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    engines = {}
    for mode in ("off", "replay") if args.threaded else ():
        spec = Speculator(ReplayProposer(len(prompt), cont), SpecConfig("ngram", k=args.k)) if mode == "replay" else None
        engines[mode] = Engine(runner, tok, EngineConfig(overlap=False), speculator=spec)
        engines[mode].start()
    try:
        for _ in range(args.threaded):  # (the modes interleaved: the machine's load hits both)
            for mode, engine in engines.items():
                toks, secs = run_one(engine, prompt, args.max_tokens)
                threaded[mode].append((len(toks) - 1) / secs)
    finally:
        for engine in engines.values():
            engine.shutdown(5)
    off, on = rows["off"], rows["replay"]
    speedup = off["round_us"] * on["tokens_per_round"] / on["round_us"]
    print(f"model {path.name}, k={args.k}, GPU pass: plain {args.plain_us:.0f} us, verify {args.verify_us:.0f} us (emulated)")
    for mode, r in rows.items():
        split = "  ".join(f"{k} {v:.1f}" for k, v in r["split"].items())
        hidden = f" ({r['critical_us']:.1f} less in pass)" if not (args.plain_us or args.verify_us) else ""
        print(
            f"  {mode:<7} {r['round_us']:8.1f} us/round{hidden}  "
            f"{r['tokens_per_round']:.2f} tok/round  | {split}"
        )
    print(f"  replay speedup {speedup:.2f}x (target {0.8 * (args.k + 1):.1f}x)")
    if args.threaded:
        off_s, on_s = (statistics.median(threaded[m]) for m in ("off", "replay"))
        print(
            f"  engine thread + client (tools/bench_spec.py's measure, median of {args.threaded}): off {off_s:.1f} tok/s, "
            f"replay {on_s:.1f} tok/s, {on_s / off_s:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
