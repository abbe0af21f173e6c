"""Speculative-decoding speedups (issue #38): batch-1 decode tok/s with speculation off and on.

    PYTHONPATH=. python tools/bench_spec.py [MODEL] [--backend cuda] [--k 4] [--max-tokens 192]
        [--draft PATH] [--mtp] [--json OUT]

MODEL defaults to the embedded SmolLM2-135M-Instruct Q4_1. Two fixed workloads, one request at a
time through the engine loop, greedy, chat template applied:

* ``suited``: rewrite / edit / summarise a given text and code edits (the answer repeats the
  prompt, so prompt lookup finds it);
* ``unsuited``: free-form chat (little to look up).

Modes: ``off``; ``ngram`` (prompt lookup, k); ``draft`` (--draft PATH, k); ``mtp`` (--mtp: the
model's MTP head, k); ``replay`` (the target's own
recorded greedy continuation fed as the draft: 100 % acceptance, so its speedup over ``off`` bounds
the verification overhead, target >= 0.8 x (k+1)). Decode tok/s = (tokens - 1) / (last token time -
first token time), summed over the workload's prompts; every mode's tokens are checked equal to
``off``'s (greedy exactness). ``--rounds N`` (default 3) runs every mode N times, interleaved (off,
ngram, replay, off, ...), so drift on the machine touches every mode alike; a mode's tok/s is its
fastest round's (noise only adds time) and the table shows the slowest round's beside it. Prints a
table last; ``--json`` writes every figure (each round's tok/s too).
Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.spec.proposer import Draft  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402

TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every night for "
    "forty years the keeper climbed its one hundred and twelve steps, trimmed the wick, wound the "
    "clockwork that turned the lens, and wrote the weather in a leather book. Ships that had never "
    "seen him knew his light, and when the harbour board replaced the lamp with an electric one "
    "that needed no keeper, the town held a dinner in his honour and gave him the old brass lens."
)
CODE = (
    "def load(path):\n    with open(path) as f:\n        data = f.read()\n    rows = []\n"
    "    for line in data.splitlines():\n        if not line.strip():\n            continue\n"
    "        name, value = line.split('=')\n        rows.append((name.strip(), value.strip()))\n"
    "    return rows\n\n\ndef save(path, rows):\n    with open(path, 'w') as f:\n"
    "        for name, value in rows:\n            f.write(name + ' = ' + value + '\\n')\n"
)
WORKLOADS = {
    "suited": [
        f"Rewrite this text with every sentence in the present tense:\n\n{TEXT}",
        f"Fix the spelling and repeat the text exactly otherwise:\n\n{TEXT.replace('the ', 'teh ', 3)}",
        f"Summarise this text, quoting its key sentences:\n\n{TEXT}",
        f"Add type hints to both functions and return the whole file:\n\n{CODE}",
        f"Rename `rows` to `entries` everywhere in this code and return the whole file:\n\n{CODE}",
    ],
    "unsuited": [
        "Write a short poem about the sea at night.",
        "What are three good habits for learning a new language? Explain each.",
        "Tell me a story about a fox who wants to fly.",
        "Why is the sky blue? Answer for a ten-year-old.",
        "Plan a three-day trip to the mountains.",
    ],
}


class ReplayProposer:
    """Proposes the recorded greedy continuation of each prompt (100 % acceptance)."""

    name = "replay"

    def __init__(self, recorded: dict[tuple[int, ...], list[int]]):
        self.recorded = recorded
        self._by_seq: dict[int, list[int]] = {}  # (the prompt looked up once a request, not a round)

    def propose(self, requests):
        out = []
        for r in requests:
            cont = self._by_seq.get(r.seq_id)
            if cont is None:
                cont = self._by_seq[r.seq_id] = self.recorded.get(tuple(r.tokens[: r.prompt_len]), [])
            done = len(r.tokens) - r.prompt_len
            out.append(Draft(cont[done : done + r.k]))
        return out

    def release(self, seq_id: int) -> None:
        self._by_seq.pop(seq_id, None)


def run_one(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """(tokens, decode seconds after the first token) for one greedy request."""
    h = engine.submit(
        GenerationRequest(f"b{time.perf_counter_ns()}", prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens)
    )
    toks: list[int] = []
    first = last = None
    for ev in h:
        if ev.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            toks += ev.token_ids
        if ev.finish_reason == "error":
            raise RuntimeError(ev.error)
    return toks, (last - first) if first is not None and last is not None else 0.0


def run_mode(mode, cfg, k, max_tokens, model, runner, tok, prompts, recorded) -> list[dict]:
    """One round of one mode: an engine with its speculator, a warm-up request, then each workload's
    prompts; ``off`` records each prompt's tokens (the first round's), the others are checked
    against them. A row per workload: tokens, tok/s, exact and the speculation counters."""
    from engine.loop import Engine
    from engine.spec.build import build_speculator
    from engine.spec.config import SpecConfig
    from engine.spec.speculator import Speculator, summary

    if mode == "replay":
        spec = Speculator(ReplayProposer(recorded), SpecConfig("ngram", k=k))
    else:
        spec = build_speculator(cfg, model, runner) if cfg is not None else None
    engine = Engine(runner, tok, speculator=spec)
    engine.start()
    rows = []
    try:
        run_one(engine, prompts["unsuited"][0], 8)  # warm-up: graph capture, caches
        base = engine.stats()
        for w, ps in prompts.items():
            n_tok, secs, exact = 0, 0.0, True
            for p in ps:
                toks, dt = run_one(engine, p, max_tokens)
                if mode == "off" and tuple(p) not in recorded:
                    recorded[tuple(p)] = toks
                else:
                    exact &= toks == recorded[tuple(p)]
                n_tok += max(0, len(toks) - 1)
                secs += dt
            after = engine.stats()
            delta = argparse.Namespace(
                **{k: getattr(after, k) - getattr(base, k) for k in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_rows")}
            )
            base = after
            row = {"mode": mode, "workload": w, "tokens": n_tok, "tok_s": n_tok / secs if secs else 0.0, "exact": exact}
            row.update(summary(delta))
            rows.append(row)
    finally:
        engine.shutdown(10)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--draft", default=None, help="a draft model path (adds the draft mode)")
    ap.add_argument("--mtp", action="store_true", help="add the mtp mode (a model with an MTP head)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode (the fastest is reported)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    from engine.backend import create_runner, resolve_model_path
    from engine.model import load_model
    from engine.spec.config import SpecConfig
    from engine.tokenizer import load_tokenizer

    path = resolve_model_path(args.model)
    model = load_model(path)
    tok = load_tokenizer(model.weights)
    runner = create_runner(model, args.backend)
    prompts = {
        w: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)) for p in ps]
        for w, ps in WORKLOADS.items()
    }
    recorded: dict[tuple[int, ...], list[int]] = {}
    modes: list[tuple[str, object]] = [("off", None), ("ngram", SpecConfig("ngram", k=args.k)), ("replay", None)]
    if args.draft:
        modes.append(("draft", SpecConfig("draft", args.draft, k=args.k)))
    if args.mtp:
        modes.append(("mtp", SpecConfig("mtp", k=args.k)))
    results: dict = {"model": str(path), "backend": runner.backend, "k": args.k, "workloads": {}}
    device = getattr(getattr(runner, "ctx", None), "info", None)
    results["device"] = getattr(device, "name", runner.backend)
    best: dict[tuple[str, str], dict] = {}  # each (mode, workload)'s fastest round
    for _ in range(args.rounds):
        for mode, cfg in modes:
            for row in run_mode(mode, cfg, args.k, args.max_tokens, model, runner, tok, prompts, recorded):
                kept = best.setdefault((row["mode"], row["workload"]), {**row, "rounds_tok_s": []})
                kept["rounds_tok_s"].append(row["tok_s"])
                kept["exact"] &= row["exact"]
                if row["tok_s"] >= max(kept["rounds_tok_s"]):
                    kept.update({k: v for k, v in row.items() if k != "exact"})
    rows = list(best.values())
    off = {r["workload"]: r["tok_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["speedup"] = r["tok_s"] / off[r["workload"]] if off.get(r["workload"]) else None
    results["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"device {results['device']} ({runner.backend}), model {path.name}, k={args.k}, best of {args.rounds} rounds")
    print(f"{'mode':<7} {'workload':<9} {'tok/s':>9} {'slowest':>9} {'speedup':>8} {'accept':>7} {'mean len':>8} exact")
    for r in rows:
        rate, mean = r["spec_acceptance_rate"], r["spec_mean_accepted_length"]
        print(
            f"{r['mode']:<7} {r['workload']:<9} {r['tok_s']:>9.1f} {min(r['rounds_tok_s']):>9.1f} {r['speedup']:>7.2f}x "
            f"{'-' if rate is None else f'{100 * rate:.0f}%':>7} {'-' if mean is None else f'{mean:.2f}':>8} "
            f"{'yes' if r['exact'] else 'NO'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
