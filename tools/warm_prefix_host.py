"""Where a warm-prefix request's host time goes, on a CPU: `memra serve`'s app (waitress, SSE) over a
runner whose step costs nothing, with the word-level tokenizer of tools/make_checkpoint.py (one token
a word) and its ChatML template; tools/loadgen.py's client sends each prompt once cold, then again.

    PYTHONPATH=. python tools/warm_prefix_host.py [--words 1000,16000] [--repeats 3] [--hybrid]
    PYTHONPATH=. python tools/warm_prefix_host.py --gguf --words 160,640,2540   (~1k / 4k / 16k tokens)

Prints, per prompt length, the client's TTFT of every send and each stage's milliseconds, the
least and the median over the warm sends (perf_counter around the function that does it; nested stages indented):
the body read and parsed, the chat template and tokenisation, the engine's submit (validation, the
sequence), scheduling (the prefix-cache lookup and block allocation), the step item, the runner, the
tokens' bookkeeping and detokenisation, the blocks' release; the last send's runner items' token
counts (a warm send runs only its tail), its token cache pieces hit and encoded, and the prefix keys
it hashed. ``--hybrid`` gives the runner state slots (the block manager's snapshot bookkeeping of
Gated DeltaNet hybrids). ``--gguf`` serves what a GPU warm send runs, less the GPU: the byte-level
tokenizer of make_checkpoint.py's GGUFs (~6.3 tokens a word, ids below 300) and the CUDA runner
(a tiny Qwen3 q4_k_m GGUF) on tests/test_plan_runner_fake.py's fake driver, whose launches and
copies cost nothing, with the runner's own stages timed. Must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import collections
import functools
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]

import loadgen  # noqa: E402
from fixtures.checkpoints import write_tokenizer_files  # noqa: E402

import engine.block_manager as bm  # noqa: E402
import engine.loop as loop  # noqa: E402
import engine.prefix_keys as pk  # noqa: E402
import engine.scheduler as sch  # noqa: E402
import engine.server.generation as gen  # noqa: E402
import engine.server.http_common as hc  # noqa: E402
from engine.server.model_info import ModelInfo  # noqa: E402
from engine.server.serve import run_server  # noqa: E402
from engine.server_config import ServerConfig  # noqa: E402
from engine.tokenizer import Tokenizer, _hf_tokenizer  # noqa: E402

STAGES: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str, owner, attr: str) -> None:
    """Wrap ``owner.attr`` so each call's time is added to STAGES[name]."""
    f = getattr(owner, attr)

    @functools.wraps(f)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            STAGES[name].append(time.perf_counter() - t0)

    setattr(owner, attr, wrapper)


class NullRunner:
    """A Runner whose step costs nothing: every sampled item gets token 5."""

    backend = "null"

    def __init__(self, max_len: int, hybrid: bool):
        self.block_size = 16
        self.max_model_len = max_len
        self.num_blocks = 4 * max_len // 16
        if hybrid:
            self.num_state_slots = 1024  # (engine.runner_state.MAX_STATE_SLOTS)
        self.items: list[list[tuple[int, int]]] = []  # per step: (tokens, start_pos) per item

    def step(self, items):
        self.items.append([(len(it.token_ids), it.start_pos) for it in items])
        return [5 if it.sample else None for it in items]


class _Source:  # what engine.tokenizer reads of an HF checkpoint directory
    def __init__(self, d: Path):
        self.path, self.metadata, self.format = d, {}, "safetensors"


def fake_cuda_runner(d: Path, max_len: int):
    """(runner, tokenizer): a CudaRunner over a tiny Qwen3 q4_k_m GGUF with the byte-level tokenizer
    of make_checkpoint's GGUFs, on the fake driver (kernels not compiled, launches recorded only)."""
    from fixtures.checkpoints import Dims, write_random_gguf
    from test_plan_runner_fake import FakeDriver, fake_builder

    import engine.runner_cuda as rc
    from engine.model import load_model
    from engine.tokenizer import load_tokenizer

    rc.cuda = FakeDriver().module()
    dims = Dims(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=768, vocab_size=512, max_position_embeddings=max_len)  # fmt: skip
    model = load_model(write_random_gguf(d / "m.gguf", "qwen3", dims, "q4_k_m", seed=3))
    runner = rc.CudaRunner(model, num_blocks=4 * max_len // 16, max_model_len=max_len, builder=fake_builder(d))
    items: list[list[tuple[int, int]]] = []
    step = runner.step

    def recorded(its):
        items.append([(len(it.token_ids), it.start_pos) for it in its])
        return step(its)

    runner.step, runner.items = recorded, items
    tok = load_tokenizer(model.weights)
    word = tok.encode("a")[0]  # (the fake driver's sampled ids are 0, a special token: no text)
    read = runner._read_ids
    runner._read_ids = lambda rows, copied=False: read(rows, copied) * 0 + word
    return runner, tok


def instrument(cuda: bool) -> None:
    runner_stages = ()
    if cuda:
        import engine.runner_cuda as rc
        import engine.runner_steps as rs

        runner_stages = (
            ("    check items", rs.StepLogic, "_check_item"),
            ("    run_tails", rs, "run_tails"),
            ("      fill decode rows", rs.StepLogic, "_fill_decode"),
            ("      sampling kind (penalties)", rs.StepLogic, "_sampling_kind"),
            ("      launch (graph replay)", rs.StepLogic, "_launch_decode_pass"),
            ("      read ids", rs.StepLogic, "_read_ids"),
            ("    prefill pass", rc.CudaRunner, "_run_prefill_pass"),
        )
    for name, owner, attr in (
        ("read and parse the JSON body", hc, "read_json"),
        ("chat_ids (escape, template, tokenise)", hc, "chat_ids"),
        ("  template", gen, "chat_prompt"),
        ("  tokenise (encode_chat)", Tokenizer, "encode_chat"),
        ("engine.submit", loop.Engine, "submit"),
        ("  validate", loop, "check_request"),
        ("schedule", sch.Scheduler, "schedule"),
        ("  blocks.allocate", bm.BlockManager, "allocate"),
        ("    prefix keys", pk.ChainMemory, "keys"),
        ("step item", loop.Engine, "_item"),
        ("runner.step", NullRunner, "step"),
        *runner_stages,
        ("advance (commit, detokenise)", loop.Engine, "_advance"),
        ("  blocks.commit", bm.BlockManager, "commit"),
        ("blocks.free", bm.BlockManager, "free"),
    ):
        timed(name, owner, attr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", default="1000,16000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hybrid", action="store_true")
    ap.add_argument("--gguf", action="store_true", help="byte-level GGUF tokenizer, CUDA runner on a fake driver")
    ap.add_argument("--port", type=int, default=8311)
    args = ap.parse_args(argv)
    lengths = [int(w) for w in args.words.split(",")]
    d = Path(tempfile.mkdtemp())
    max_len = 8 * max(lengths) + 1024 if args.gguf else max(lengths) + 1024
    if args.gguf:
        runner, tok = fake_cuda_runner(d, max_len)
        timed("runner.step", runner, "step")
    else:
        write_tokenizer_files(d, words_vocab=151936)
        tok = _hf_tokenizer(_Source(d))
        runner = NullRunner(max_len, args.hybrid)
    instrument(args.gguf)

    engine_ref = []

    def load():
        cfg = loop.EngineConfig(max_running=64, max_waiting=128, prefill_chunk_tokens=8192, max_step_tokens=8192 + 64)
        engine = loop.Engine(runner, tok, cfg)
        engine.start()
        engine_ref.append(engine)
        return engine, tok, ModelInfo("null", runner.max_model_len, "null")

    stop = threading.Event()
    cfg = ServerConfig(host="127.0.0.1", port=args.port)
    server = threading.Thread(target=run_server, args=(cfg, load), kwargs=dict(install_signals=False, stop_event=stop), daemon=True)
    server.start()
    for _ in range(400):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/ready")
            break
        except OSError:
            time.sleep(0.05)
    for words in lengths:
        ttfts, warm_stages = [], []
        for send in range(1 + args.repeats):
            STAGES.clear()
            runner.items.clear()
            seg = tok._segments
            seg.hits = seg.misses = 0
            hashed = engine_ref[0].blocks.keys.hashed_blocks
            res = loadgen.one_request("127.0.0.1", args.port, "", None, words, 1, None, 120, random.Random(words),
                                      temperature=0.0, ignore_eos=True)  # fmt: skip
            if not res.ok:
                raise SystemExit(f"warm_prefix_host: {words} words: {res.error}")
            ttfts.append(1e3 * res.ttft_s)
            time.sleep(0.05)  # (the request's release runs after its last event)
            if send:
                warm_stages.append({k: (1e3 * sum(v), len(v)) for k, v in STAGES.items()})
        print(f"{words} words ({res.prompt_tokens} tokens, {res.cached_tokens} cached on the last send): "
              f"TTFT cold {ttfts[0]:.2f} ms, warm {' '.join(f'{t:.2f}' for t in ttfts[1:])} ms "
              f"(min {min(ttfts[1:]):.2f}, median {statistics.median(ttfts[1:]):.2f}); "
              f"runner items of the last send (tokens, start): {runner.items}; its token cache pieces "
              f"{seg.hits} hit / {seg.misses} encoded, prefix keys hashed for "
              f"{engine_ref[0].blocks.keys.hashed_blocks - hashed} blocks")  # fmt: skip
        print(f"   {'stage (over the warm sends; calls in the last)':40s}      min   median")
        for name in STAGES:
            ms = [st[name][0] if name in st else 0.0 for st in warm_stages]
            print(f"   {name:40s} {min(ms):8.3f} {statistics.median(ms):8.3f} ms  x{len(STAGES[name])}")
    stop.set()
    server.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
