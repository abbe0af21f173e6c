"""What does the HTTP layer cost? The same closed batch through the engine loop and through
`memra serve`'s app (waitress, SSE, detokenisation), on tests/fixtures/fake_runner.py with a fixed step time.

Usage: PYTHONPATH=. python tools/bench_http_overhead.py [--step-ms 25] [--concurrency 32]
The fake runner sleeps ``--step-ms`` per step (releasing the GIL, like a GPU sync), so both paths
have the same ceiling; the difference is the serving stack's overhead. The load generator runs in
this process too, so the HTTP figure is a lower bound. Prints both rows and the loss in percent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tests")]

import loadgen  # noqa: E402
from fixtures.fake_runner import FakeRunner, FakeTokenizer  # noqa: E402
from server_fakes import FakeTokenizer as CharTokenizer  # noqa: E402

from engine.bench import bench_engine  # noqa: E402
from engine.loop import Engine, EngineConfig  # noqa: E402
from engine.server.model_info import ModelInfo  # noqa: E402
from engine.server.serve import run_server  # noqa: E402
from engine.server_config import ServerConfig  # noqa: E402


def make_engine(step_s: float, concurrency: int) -> Engine:
    runner = FakeRunner(
        num_blocks=40000, block_size=16, max_model_len=4096, vocab_size=128, step_delay_s=step_s
    )
    cfg = EngineConfig(max_running=2 * concurrency, prefill_chunk_tokens=2048, max_step_tokens=4096)
    engine = Engine(runner, FakeTokenizer(), cfg)  # ASCII prompts: ids < 128
    engine.start()
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8199)
    args = ap.parse_args(argv)
    step_s, c = args.step_ms / 1e3, args.concurrency
    engine = make_engine(step_s, c)
    direct = bench_engine(engine, c, 440, args.gen_tokens, vocab=128)
    engine.shutdown(5)
    cfg = ServerConfig(host="127.0.0.1", port=args.port, max_running=2 * c)
    stop = threading.Event()
    server = threading.Thread(
        target=run_server,
        args=(cfg, lambda: (make_engine(step_s, c), CharTokenizer(), ModelInfo("fake", 4096, "fake"))),
        kwargs=dict(install_signals=False, stop_event=stop),
        daemon=True,
    )
    server.start()
    time.sleep(1.0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lg.json"
        loadgen.main(
            [
                "--url", f"http://127.0.0.1:{args.port}", "--model", "fake", "--requests", str(c),
                "--concurrency", str(c), "--prompt-words", "73", "--max-tokens", str(args.gen_tokens),
                "--temperature", "0", "--ignore-eos", "--json", str(out),
            ]
        )  # fmt: skip
        http = json.loads(out.read_text())
    stop.set()
    server.join(5)
    loss = 100 * (1 - http["tokens_per_s"] / direct["aggregate_tok_s"])
    print(
        f"step {args.step_ms:g} ms, concurrency {c}: engine loop {direct['aggregate_tok_s']:.0f} tok/s "
        f"(TTFT p50 {direct['ttft_p50_ms']:.0f} ms), HTTP {http['tokens_per_s']:.0f} tok/s "
        f"(TTFT p50 {1e3 * (http['ttft_p50_s'] or 0):.0f} ms, ITL p50 {1e3 * (http['itl_p50_s'] or 0):.1f} ms): "
        f"{loss:.1f}% lost"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
