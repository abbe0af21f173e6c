"""`memra bench`: compile (cold/warm), load, runner prefill/decode with roofline fractions, and the
engine loop under concurrency (aggregate tok/s, TTFT p50/p99). JSON plus a short table.

The raw-runner measurements live in engine/runner_bench.py; this module adds what sits around them.
Must not import CUDA (runners do).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from engine.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
ENGINE_CHUNK = 2048  # the engine rows' prefill chunk (tokens a step)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1, linear interpolation), NaN for no values."""
    return float(np.percentile(values, 100 * q)) if values else float("nan")


def bench_engine(
    engine: Any,
    concurrency: int,
    prompt_len: int = 440,
    gen_tokens: int = 128,
    vocab: int = 1000,
) -> dict:
    """``concurrency`` requests submitted at once through the engine loop (closed batch); each has a
    distinct random prompt (no prefix hits) and generates exactly ``gen_tokens`` (ignore_eos)."""
    import random

    rng = random.Random(0)
    reqs = [
        GenerationRequest(
            request_id=f"bench-{uuid.uuid4().hex[:8]}",
            prompt_ids=[rng.randrange(100, vocab) for _ in range(prompt_len)],
            sampling=GREEDY,
            max_tokens=gen_tokens,
            ignore_eos=True,
            cache_salt=uuid.uuid4().hex,
        )
        for _ in range(concurrency)
    ]
    ttfts: list[float] = []
    itls: list[float] = []
    generated = [0] * concurrency
    lock = threading.Lock()

    def consume(i: int, handle: Any, t0: float) -> None:
        last = None
        for ev in handle:
            now = time.perf_counter()
            if ev.token_ids:
                with lock:
                    if last is None:
                        ttfts.append(now - t0)
                    else:
                        itls.append(now - last)
                last = now
            if ev.usage is not None:
                generated[i] = ev.usage.completion_tokens

    t0 = time.perf_counter()
    threads = []
    for i, r in enumerate(reqs):
        h = engine.submit(r)
        th = threading.Thread(target=consume, args=(i, h, t0), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    total = sum(generated)
    return {
        "kind": "engine",
        "concurrency": concurrency,
        "prompt_tokens": prompt_len,
        "gen_tokens": gen_tokens,
        "wall_s": round(wall, 3),
        "generated": total,
        "aggregate_tok_s": round(total / wall, 1),
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 0.5), 1),
        "ttft_p99_ms": round(1e3 * percentile(ttfts, 0.99), 1),
        "itl_p50_ms": round(1e3 * percentile(itls, 0.5), 2),
        "itl_p99_ms": round(1e3 * percentile(itls, 0.99), 2),
    }


def bench_compile(model: Any, profile: Any) -> dict:
    """Cold (empty cache) and warm (all hits) build of every kernel the model's plan needs."""
    from engine.compile import KernelBuilder
    from engine.ir import kernel_specs
    from engine.kcache import KernelCache
    from engine.plan import build_plan

    plan = build_plan(model.graph, model.dims, model.quant, profile, model.tensor_dtypes, model.rope_style)
    specs = kernel_specs(plan)
    with tempfile.TemporaryDirectory() as tmp:
        builder = KernelBuilder(profile.arch, KernelCache(Path(tmp)), no_compile=False)
        cold = builder.build_all(specs, progress=None)
        warm = builder.build_all(specs, progress=None)
    return {
        "kind": "compile",
        "kernels": len(specs),
        "cold_s": round(cold.seconds, 2),
        "warm_s": round(warm.seconds, 3),
    }


def device_of(runner: Any) -> dict:
    """What ran the benchmark: the GPU's name and the device profile for a CUDA runner, the CPU
    otherwise (a figure is only comparable with others from the same card)."""
    info = getattr(getattr(runner, "ctx", None), "info", None)
    profile = getattr(runner, "profile", None)
    if info is not None:
        name = info.name
    else:
        import platform

        name = f"CPU {platform.machine() or 'unknown'}"
    return {"backend": runner.backend, "name": name, "profile": getattr(profile, "name", None)}


def memory_row(when: str) -> dict:
    """The process's resident set now (idle: after a collection) and its peak so far, in bytes."""
    import gc

    from engine import memstat

    gc.collect()
    return {"kind": "memory", "when": when, **memstat.footprint()}


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        k = r["kind"]
        if k == "compile":
            out.append(
                f"compile   {r['kernels']} kernels: cold {r['cold_s']:.2f} s, warm {r['warm_s']:.3f} s"
            )
        elif k == "load":
            out.append(f"load      {r['seconds']:.2f} s ({r['backend']})")
        elif k == "memory":
            out.append(
                f"memory    {r['when']}: RSS {r['rss_bytes'] / 1e6:.0f} MB, peak {r['peak_rss_bytes'] / 1e6:.0f} MB"
            )
        elif k == "kv":
            out.append(f"kv        {_kv_text(r)}")
        elif k == "copy":
            out.append(
                f"copy      device-to-device: {r['gbs']:.0f} GB/s read + written "
                f"(the profile's roofline: {r['profile_gbs']:.0f} GB/s)"
            )
        elif k == "decode":
            measured = (
                f" ({100 * r['copy_roofline_fraction']:.1f}% of the measured copy)"
                if "copy_roofline_fraction" in r
                else ""
            )
            out.append(
                f"decode    batch {r['batch']:>3} depth {r['depth']:>5}: {r['tok_s']:>9.1f} tok/s  "
                f"{r['achieved_gbs']:>7.0f} GB/s  {100 * r['roofline_fraction']:5.1f}% of memory roofline{measured}"
                + (
                    f" (bytes read: {r['bytes_per_step'] / 2**30:.2f} GiB, {100 * r['active_expert_fraction']:.0f}% of the experts)"
                    if "active_expert_fraction" in r
                    else ""
                )
            )
        elif k == "prefill":
            out.append(
                f"prefill   {r['tokens']:>5} tokens: {r['tok_s']:>9.1f} tok/s  {r['tflops']:>6.1f} TFLOP/s  "
                f"{100 * r['roofline_fraction']:5.1f}% of tensor-core peak"
            )
        elif k == "engine":
            out.append(
                f"engine    concurrency {r['concurrency']:>3}: {r['aggregate_tok_s']:>9.1f} tok/s aggregate, "
                f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, ITL p50 {r['itl_p50_ms']:.1f} ms"
                + (", overlapped steps" if r.get("overlap") else "")
                + _spec_cell(r)
            )
    return "\n".join(out)


def _kv_text(r: dict) -> str:
    """One line for a ``kv`` row."""
    text = (
        f"{r['full_layers']} full layers {r['full_bytes_per_token'] / 1024:.1f} KiB a token "
        f"({r['full_blocks']} blocks of {r['block_size']})"
    )
    if "window" in r:
        text += (
            f"; {r['window_layers']} window-{r['window']} layers {r['window_bytes_per_token'] / 1024:.1f} KiB a token, "
            f"at most {r['window_seq_blocks_max']} blocks = {r['window_bytes_per_seq_max'] / 2**20:.2f} MiB "
            f"a decoding sequence (window pool {r['window_blocks']} blocks)"
        )
    return text


def _spec_cell(r: dict) -> str:
    if "speculative" not in r:
        return ""
    rate, mean = r["spec_acceptance_rate"], r["spec_mean_accepted_length"]
    return (
        f", {r['speculative']}: acceptance {'-' if rate is None else f'{100 * rate:.0f}%'}, "
        f"mean accepted length {'-' if mean is None else f'{mean:.2f}'}"
    )


def bench_from_cli(args: argparse.Namespace) -> int:
    from engine.backend import StackFlags, create_runner, resolve_model_path
    from engine.loop import Engine, EngineConfig
    from engine.model import load_model

    flags = StackFlags.of(args)
    path = resolve_model_path(args.model)
    rows: list[dict] = []
    t0 = time.perf_counter()
    model = load_model(path, quant=flags.quant)
    # an automatic window pool: for the profile's max_running (its largest decode batch) and the
    # engine rows' prefill chunk
    runner = create_runner(
        model, flags.backend, flags.device_profile, window_kv_blocks=flags.window_kv_blocks, prefill_chunk_tokens=ENGINE_CHUNK
    )
    rows.append({"kind": "load", "seconds": round(time.perf_counter() - t0, 2), "backend": runner.backend})
    rows.append(memory_row("after load"))
    from engine import runner_bench

    if kv := runner_bench.kv_row(runner):
        rows.append(kv)
    if runner.backend == "cuda" and not args.skip_runner:
        rows.insert(0, bench_compile(model, runner.profile))
        quick = args.quick
        if args.batches:
            batches = tuple(int(x) for x in args.batches.split(",") if x.strip())
        else:
            batches = (1, 8) if quick else runner_bench.graph_buckets(runner)
        rows += runner_bench.run_all(
            runner,
            batches=batches,
            depths=(0,) if quick else (0, 4096),
            prefills=(512,) if quick else (512, 4096),
            steps=16 if quick else 64,
            kv=False,  # (the row above)
        )
    if args.concurrency:
        from engine.spec.build import speculator_from_args

        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
        speculator = speculator_from_args(args, model, runner)
        engine = Engine(
            runner,
            NullTokenizer(),
            EngineConfig(max_running=max(levels), prefill_chunk_tokens=ENGINE_CHUNK, overlap=flags.overlap),
            speculator=speculator,
        )
        engine.start()
        try:
            gen = args.gen_tokens or (16 if runner.backend == "reference" or args.quick else 128)
            plen = args.prompt_tokens or (64 if runner.backend == "reference" else 440)
            bench_engine(engine, 1, plen, 4, vocab=int(model.dims["vocab"]))  # warm-up (graph capture)
            for c in levels:
                before = engine.stats()
                rows.append(bench_engine(engine, c, plen, gen, vocab=int(model.dims["vocab"])))
                rows[-1]["overlap"] = engine.overlaps
                if speculator is not None:
                    rows[-1].update(_spec_delta(speculator.method, before, engine.stats()))
        finally:
            engine.shutdown(10)
    rows.append(memory_row("at the end"))
    device = device_of(runner)
    result = {"model": str(path), "date": time.strftime("%Y-%m-%d"), "device": device, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"device    {device['name']} ({device['backend']}, profile {device['profile'] or '-'})")
    print(table(rows))
    print(json.dumps(result), file=sys.stderr)
    return 0


def _spec_delta(method: str, before: Any, after: Any) -> dict:
    """Speculation figures of one engine-loop row (counter differences over the row)."""
    from engine.spec.speculator import summary

    keys = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_rows")
    diff = argparse.Namespace(**{k: getattr(after, k) - getattr(before, k) for k in keys})
    return {"speculative": method, **summary(diff)}


class NullTokenizer:
    """Benchmarks need token ids only: no detokenisation cost in the measured loop (the engine tests
    that check token ids alone use it too)."""

    eos_token_ids: frozenset[int] = frozenset()

    def incremental_decoder(self, skip_special_tokens: bool = True) -> Any:
        class _D:
            def push(self, ids: list[int]) -> str:
                return ""

            def flush(self) -> str:
                return ""

        return _D()
