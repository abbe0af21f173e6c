"""Where a draft model's proposals part from its target's on the GPU: each rejected draft token with
the draft's and the target's top-2 logits at its position, and how many proposed positions got
logits bit-identical to the target's verify rows.

    PYTHONPATH=. python tools/spec_draft_logits.py [MODEL] [--draft PATH] [--k 4] [--max-tokens 96]
        [--solo] [--prompt TEXT ...] [--long N]

MODEL defaults to the embedded SmolLM2-135M-Instruct Q4_1 and the draft to MODEL itself (a self-draft,
which should be accepted whole: docs/speculative.md); the prompts default to those of
tests/gpu/test_spec_gpu.py's SmolLM2 test (a code edit and a short story, chat-templated), batched
unless --solo; ``--long N`` adds a code listing of about N tokens to summarise (a prompt the engine
prefills in several chunks, in passes past the 256-row GEMM switch of the h100 / h200 profiles). It runs plain greedy, then greedy with the draft (a fresh engine each, like the test),
records the logits of every verify row of the target and of every sampled row of the draft runner
(decode rows and prefill heads) by (sequence, position), and after each verify compares row j of a
draft (the target's logits at the position whose argmax decides draft token j + 1) with the draft's
logits at that position. Prints one line per rejected draft token, then a summary; exits 1 when the
speculative output differs from plain greedy. CUDA backend only. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n"
)
PROMPTS = (f"Add type hints to every function:\n{CODE}", "Write a short story about a lighthouse.")


class LogitTap:
    """Keeps the logits of a CudaRunner's sampled rows by (seq_id, position), the latest write winning:
    decode passes (only verify passes with ``verify_only``) and the head rows of prefill passes."""

    def __init__(self, runner: Any, verify_only: bool = False):
        self.rows: dict[tuple[int, int], np.ndarray] = {}
        decode, prefill = runner._decode, runner._run_prefill_pass

        def tapped_decode(items, *args, **kw):
            ids = decode(items, *args, **kw)
            if kw.get("verify") or not verify_only:
                logits = runner.read_logits(len(items))
                for r, it in enumerate(items):
                    self.rows[it.seq_id, it.start_pos] = logits[r].copy()
            return ids

        def tapped_prefill(segs):
            out = prefill(segs)
            heads = [it for _, it, _, hi in segs if hi == len(it.token_ids) and it.sample]
            if heads and not verify_only:
                logits = runner.read_logits(len(heads))
                for r, it in enumerate(heads):
                    self.rows[it.seq_id, it.start_pos + len(it.token_ids) - 1] = logits[r].copy()
            return out

        runner._decode = tapped_decode
        runner._run_prefill_pass = tapped_prefill


def top2(row: np.ndarray) -> str:
    a, b = (int(i) for i in np.argsort(-row, kind="stable")[:2])
    return f"{a}:{row[a]:.6f} {b}:{row[b]:.6f} (margin {row[a] - row[b]:.2e})"


class Report:
    """Compares each verified draft's rows with the draft's logits (``compare``) and sums them up."""

    def __init__(self, target_tap: LogitTap, draft_tap: LogitTap, out=sys.stdout):
        self.t, self.d, self.out = target_tap, draft_tap, out
        self.rounds = self.drafted = self.accepted = self.rows = self.same = self.missing = 0
        self.max_diff = 0.0

    def compare(self, item: Any, emitted: list[int]) -> None:
        k, a = len(item.draft), len(emitted) - 1
        self.rounds += 1
        self.drafted += k
        self.accepted += a
        same_before = 0
        for j in range(min(a + 1, k)):
            key = (item.seq_id, item.start_pos + j)
            lt, ld = self.t.rows.get(key), self.d.rows.get(key)
            if lt is None or ld is None:
                self.missing += 1
                continue
            self.rows += 1
            same = bool(np.array_equal(lt.view(np.uint32), ld.view(np.uint32)))
            self.same += same
            self.max_diff = max(self.max_diff, float(np.max(np.abs(lt - ld))))
            if j == a:  # the rejected draft token
                print(
                    f"seq {item.seq_id} pos {key[1] + 1}: draft {item.draft[j]} rejected for {emitted[-1]}"
                    f" | draft top2 {top2(ld)} | target top2 {top2(lt)} | bits equal here: {same},"
                    f" on the {j} accepted rows before it: {same_before}/{j}",
                    file=self.out,
                )
            same_before += same

    def summary(self) -> str:
        rate = self.accepted / self.drafted if self.drafted else float("nan")
        return (
            f"rounds {self.rounds}, drafted {self.drafted}, accepted {self.accepted} ({rate:.2%}); rows compared "
            f"{self.rows}, bit-identical {self.same}, max |draft - target| {self.max_diff:.3e}"
            + (f", rows without logits {self.missing}" if self.missing else "")
        )


def generate(runner: Any, prompts: list[list[int]], max_tokens: int, speculator: Any = None) -> tuple[list[list[int]], Any]:
    from engine.bench import NullTokenizer
    from engine.loop import Engine, EngineConfig
    from engine.types import GenerationRequest, SamplingParams

    e = Engine(runner, NullTokenizer(), EngineConfig(), speculator=speculator)
    hs = [
        e.submit(GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    e.start()
    try:
        return [[t for ev in h for t in ev.token_ids] for h in hs], e.stats()
    finally:
        e.shutdown(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="target GGUF / HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--draft", help="draft model (default: the target itself)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--solo", action="store_true", help="one prompt at a time (default: batched)")
    ap.add_argument("--prompt", action="append", help="a user message (repeatable; default: the GPU test's two)")
    ap.add_argument("--long", type=int, default=0, help="add a prompt of about this many tokens")
    args = ap.parse_args(argv)

    from engine.backend import create_runner
    from engine.default_model import default_model_path
    from engine.model import load_model
    from engine.spec.build import build_speculator
    from engine.spec.config import SpecConfig
    from engine.tokenizer import load_tokenizer

    path = args.model or str(default_model_path())
    model = load_model(path)
    tok = load_tokenizer(model.weights)
    texts = list(args.prompt or PROMPTS)
    if args.long:
        texts.append("Summarise what this code does:\n" + CODE * max(1, args.long // len(tok.encode(CODE))))
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
        for text in texts
    ]
    print(f"target {path}, draft {args.draft or 'the target'}, k={args.k}, prompts of {[len(p) for p in prompts]} tokens")
    runner = create_runner(model, "cuda")
    try:
        waves = [[p] for p in prompts] if args.solo else [prompts]
        plain = [t for w in waves for t in generate(runner, w, args.max_tokens)[0]]
        spec_cfg = SpecConfig("draft", args.draft or path, k=args.k)
        tt = LogitTap(runner, verify_only=True)
        report: Report | None = None
        outs = []
        for w in waves:  # (a fresh speculator, so a fresh draft runner, for each wave)
            speculator = build_speculator(spec_cfg, model, runner)
            dt = LogitTap(speculator.proposer.runner)
            if report is None:
                report = Report(tt, dt)
            report.d = dt
            verify = runner.verify

            def verify_and_compare(items, verify=verify, report=report):
                tt.rows.clear()
                out = verify(items)
                for it, emitted in zip(items, out, strict=True):
                    if it.draft:
                        report.compare(it, [int(t) for t in emitted])
                return out

            runner.verify = verify_and_compare
            try:
                outs += generate(runner, w, args.max_tokens, speculator)[0]
            finally:
                del runner.verify  # (the instance attribute: the class's method again)
                speculator.proposer.runner.close()
        assert report is not None
        print(report.summary())
        print(f"speculative output == plain greedy: {outs == plain}")
        return 0 if outs == plain else 1
    finally:
        runner.close()


if __name__ == "__main__":
    sys.exit(main())
