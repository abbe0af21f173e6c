"""Warm-prefix TTFT of a local memra server: for each prompt length, one cold request, then the same
prompt sent again ``--repeats`` times; prints every send's time to first token, the prompt's tokens
and the fewest the warm sends found cached (issue #34's row "warm-prefix TTFT at 1k / 4k / 15k
tokens ... every time, not only the third").

Greedy, streaming, ``--max-tokens`` tokens (default 1). Prompts are loadgen's words (one token
each with the word-level tokenizer.json of tools/make_checkpoint.py; about 6.3 with its GGUFs'
byte-level vocabulary); each length gets its own words, so
lengths never share a prefix. Loopback only; uses tools/loadgen.py's client. Must not import the engine.

    python tools/warm_prefix.py --url http://127.0.0.1:8000 --words 1000,4000,15000 --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("loadgen", Path(__file__).with_name("loadgen.py"))
loadgen = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules.setdefault("loadgen", loadgen)
_spec.loader.exec_module(loadgen)  # type: ignore[union-attr]


def measure(host: str, port: int, args: argparse.Namespace, words: int) -> dict:
    """One cold send and ``args.repeats`` warm sends of the same ``words``-word prompt (seeded by
    ``words``, so each length is its own prompt)."""
    ttfts, cached = [], []
    for _ in range(1 + args.repeats):
        res = loadgen.one_request(
            host,
            port,
            args.model,
            args.api_key,
            words,
            args.max_tokens,
            None,
            args.timeout,
            random.Random(args.seed * 1_000_003 + words),  # the same prompt on every send
            temperature=0.0,
            ignore_eos=True,
        )
        if not res.ok or res.ttft_s is None:
            raise SystemExit(f"warm_prefix: {words} words: request failed ({res.error or 'no token'})")
        ttfts.append(res.ttft_s)
        cached.append(res.cached_tokens)
    warm = ttfts[1:]
    return {
        "words": words,
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": cached,
        "cold_ms": round(1e3 * ttfts[0], 1),
        "warm_ms": [round(1e3 * t, 1) for t in warm],
        "warm_max_ms": round(1e3 * max(warm), 1) if warm else None,
    }


def table(rows: list[dict]) -> str:
    out = [f"{'prompt words':>12} {'tokens':>7} {'cached':>7} {'cold TTFT':>10} {'warm max':>9}  warm sends (ms)"]
    for r in rows:
        warm = " ".join(f"{t:.1f}" for t in r["warm_ms"])
        hit = min((c for c in r["cached_tokens"][1:] if c is not None), default=None)
        out.append(
            f"{r['words']:>12} {r['prompt_tokens']:>7} {hit if hit is not None else '-':>7} {r['cold_ms']:>8.1f}ms "
            f"{r['warm_max_ms'] or 0:>7.1f}ms  {warm}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--words", default="1000,4000,15000", help="comma-separated prompt lengths in words")
    ap.add_argument("--repeats", type=int, default=5, help="warm sends per length (default 5)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if not 0 <= args.repeats <= 100:
        raise SystemExit("warm_prefix: --repeats must be 0..100")
    host, port = loadgen.check_loopback(args.url)
    rows = [measure(host, port, args, int(w)) for w in args.words.split(",") if w.strip()]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
