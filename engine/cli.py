"""The `memra` command line: serve, run, chat, bench, warmup, profiles, keys, cache.

Each subcommand parses its flags here and calls into the engine; user errors (MemraError,
ConfigError) print one clear line and exit 2, never a traceback. Must not import cuda.bindings
(device access goes through engine.backend / engine.cuda, lazily).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine import __version__, env
from engine.backend import StackFlags, load_stack
from engine.types import GenerationRequest, MemraError, SamplingParams

log = logging.getLogger("memra")


def _err(msg: str) -> None:
    print(f"memra: error: {msg}", file=sys.stderr)


def _sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    from engine.sampling import validate_sampling

    flags = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")  # _add_sampling_flags' flags
    params = SamplingParams(**{f: getattr(args, f) for f in flags})
    validate_sampling(params)
    return params


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model path or known alias (gemma3-270m; default: embedded SmolLM2-135M-Instruct Q4_1)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto")
    p.add_argument("--device-profile", default=None, help="device profile name, overriding auto-detection")
    p.add_argument("--quant", default=None, help="require this quant combo of the family")
    p.add_argument(
        "--window-kv-blocks",
        default=None,
        metavar="N",
        help="KV blocks of the sliding-window layers' own pool (0: none, one pool; default: sized automatically)",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="queue each decode step before reading the last one's tokens (CUDA backend; default on)",
    )


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", default=None, metavar="0,1", help="CUDA device ids to split the model over")
    p.add_argument(
        "--split", choices=("pp", "tp"), default=None, help="pp: layer ranges per device; tp: heads/columns per device"
    )


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        default=None,
        metavar="ngram|draft:PATH|mtp",
        help="speculative decoding: prompt lookup, a draft model with the same tokenizer, or MTP heads",
    )
    p.add_argument("--spec-tokens", type=int, default=None, metavar="K", help="tokens drafted per step (default 4)")


def _generate(engine: Any, prompt_ids: list[int], args: argparse.Namespace, out: Any = None):
    """Stream one request through the engine to ``out`` (default: the current ``sys.stdout``, looked
    up per call, not bound at import); returns (text, stats dict)."""
    out = out if out is not None else sys.stdout
    req = GenerationRequest(
        request_id=f"cli-{uuid.uuid4().hex[:8]}",
        prompt_ids=prompt_ids,
        sampling=_sampling_from_args(args),
        max_tokens=args.max_tokens,
    )
    t0 = time.perf_counter()
    handle = engine.submit(req)
    pieces: list[str] = []
    first = None  # when the engine produced the first token (event.created_s, not when read here)
    end = None  # ... and the last one
    last = None
    for event in handle:
        if event.text:
            out.write(event.text)
            out.flush()
            pieces.append(event.text)
        if event.token_ids:
            if first is None:
                first = event.created_s
            end = event.created_s
        last = event
    end = end if end is not None else time.perf_counter()
    if last is not None and last.finish_reason == "error" and last.error is not None:
        raise last.error
    usage = last.usage if last is not None else None
    gen = usage.completion_tokens if usage else 0
    ttft = (first or end) - t0
    decode_s = end - (first or end)
    stats = {
        "prompt_tokens": len(prompt_ids),
        "cached_tokens": usage.cached_tokens if usage else 0,
        "generated_tokens": gen,
        "ttft_s": round(ttft, 4),
        "prefill_tok_s": round(len(prompt_ids) / ttft, 1) if ttft > 0 else None,
        "decode_tok_s": round((gen - 1) / decode_s, 2) if gen > 1 and decode_s > 0 else None,
        "finish_reason": last.finish_reason if last else None,
    }
    return "".join(pieces), stats


# --------------------------------------------------------------------------------------------
# subcommands


def _check_args(args: argparse.Namespace) -> StackFlags:
    """Reject bad generation flags before anything loads (one line naming the flag); the
    model-loading flags."""
    from engine.spec.config import parse_speculative

    _sampling_from_args(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise MemraError(f"--max-tokens must be at least 1, got {args.max_tokens}", param="max_tokens")
    parse_speculative(getattr(args, "speculative", None), getattr(args, "spec_tokens", None))
    return StackFlags.of(args)


@contextmanager
def _one_request_engine(args: argparse.Namespace) -> Iterator[tuple[Any, Any, Any, Any]]:
    """(engine, tokenizer, runner, speculator or None) for `memra run` / `memra chat`, the flags
    checked first. The engine runs one request at a time (an automatic window pool is sized for one
    sequence and the engine's default prefill chunk) and is shut down on exit."""
    from engine.loop import Engine, EngineConfig
    from engine.spec.build import speculator_from_args

    flags = _check_args(args)
    model, tokenizer, runner = load_stack(
        args.model, flags, max_running=1, prefill_chunk_tokens=EngineConfig.prefill_chunk_tokens
    )
    speculator = speculator_from_args(args, model, runner)
    engine = Engine(runner, tokenizer, EngineConfig(overlap=flags.overlap), speculator=speculator)
    engine.start()
    try:
        yield engine, tokenizer, runner, speculator
    finally:
        engine.shutdown(5.0)


def cmd_run(args: argparse.Namespace) -> int:
    with _one_request_engine(args) as (engine, tokenizer, runner, speculator):
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text)
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
        _, stats = _generate(engine, prompt_ids, args)
    print()
    if args.stats:
        stats["backend"] = runner.backend
        if speculator is not None:
            from engine.spec.speculator import summary

            stats["speculative"] = speculator.method
            stats.update(summary(engine.stats()))
        print("memra: " + json.dumps(stats), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    with _one_request_engine(args) as (engine, tokenizer, _, _):
        print(
            "memra chat: type a message, /reset to clear the conversation, /exit or Ctrl-D to quit.",
            file=sys.stderr,
        )
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                messages = messages[:1] if args.system else []
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            reply, stats = _generate(engine, tokenizer.encode(text), args)
            print()
            if args.stats:
                print("memra: " + json.dumps(stats), file=sys.stderr)
            messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from engine.backend import choose_profile, detect
    from engine.profile import all_profiles

    found = detect()
    profiles = all_profiles()
    if found.devices:
        for i, dev in enumerate(found.devices):
            chosen = choose_profile(dev, args.device_profile)
            print(
                f"GPU {i}: {dev.name}, compute capability {dev.cc}, {dev.sm_count} SMs, "
                f"{dev.total_memory / 2**30:.1f} GiB -> profile {chosen.name} ({chosen.arch})"
            )
    else:
        print(f"no CUDA device found ({found.error or 'the driver lists none'})")
    print("profiles:")
    for p in profiles.values():
        kind = "generic" if p.generic else "named"
        names = ", ".join(p.name_patterns) or "-"
        tuned = f"  (tuning from {p.base})" if p.base else ""
        print(f"  {p.name:15s} {p.arch:8s} cc {p.compute_capability:5s} {kind:8s} matches: {names}{tuned}")
    return 0


def _warmup_targets(args: argparse.Namespace) -> list[tuple[str, Any, dict, Any, str, dict | None]]:
    """(label, graph, dims, quant combo, rope_style, tensor_dtypes) for each model to warm."""
    from engine.graph import load_family
    from engine.model import dims_for_size, load_model

    if args.model:
        m = load_model(Path(args.model), quant=args.quant)
        return [(m.name, m.graph, m.dims, m.quant, m.rope_style, m.tensor_dtypes)]
    if not args.family:
        raise MemraError("warmup needs --model PATH, or --family F (with --quant Q: one combo)", param="model")
    graph = load_family(args.family)
    # without --quant every combo: a mix's alternate types (q4_k_m's q6_k layers) are other combos' defaults
    combos = [graph.quant(args.quant)] if args.quant else list(graph.quants.values())
    sizes = [args.size] if args.size else list(graph.sizes)
    if not sizes:
        raise MemraError(f"family {args.family} lists no sizes: pass --model PATH", param="size")
    # which format's RoPE pairing: warm both when they differ (a GGUF and a safetensors of the family)
    styles = sorted(set(graph.rope_style.values()))
    return [
        (
            f"{args.family}/{size}/{combo.name}/{style}",
            graph,
            dims_for_size(args.family, size),
            combo,
            style,
            None,
        )
        for combo in combos
        for size in sizes
        for style in styles
    ]


def warmup(targets, profiles, jobs: int | None = None, progress=sys.stderr, list_only: bool = False) -> dict:
    """Compile every kernel the plans of ``targets`` need for each profile's arch; returns a summary."""
    from engine.compile import KernelBuilder
    from engine.ir import kernel_specs
    from engine.plan import build_plan

    by_arch: dict[str, list] = {}
    for _label, graph, dims, combo, style, dtypes in targets:
        for prof in profiles:
            plan = build_plan(graph, dims, combo, prof, tensor_dtypes=dtypes, rope_style=style)
            by_arch.setdefault(prof.arch, []).extend(kernel_specs(plan))
    summary: dict[str, Any] = {"archs": {}}
    for arch, specs in by_arch.items():
        specs = list(dict.fromkeys(specs))
        if list_only:
            for s in specs:
                print(f"{arch} {s.describe()}")
            continue
        stats = KernelBuilder(arch).build_all(specs, jobs=jobs, progress=progress)
        summary["archs"][arch] = {
            "kernels": len(specs),
            "hits": stats.hits,
            "compiled": stats.compiled,
            "seconds": round(stats.seconds, 2),
        }
        print(f"memra warmup {arch}: {stats.summary()}", file=progress)
    return summary


def cmd_warmup(args: argparse.Namespace) -> int:
    from engine.profile import all_profiles, get_profile

    if args.all_profiles:
        profiles = list(all_profiles().values())
    elif args.device_profile:
        profiles = [get_profile(args.device_profile)]
    else:
        raise MemraError("warmup needs --device-profile NAME or --all-profiles", param="device_profile")
    t0 = time.perf_counter()
    summary = warmup(_warmup_targets(args), profiles, jobs=args.jobs, list_only=args.list)
    if not args.list:
        total = sum(a["kernels"] for a in summary["archs"].values())
        hits = sum(a["hits"] for a in summary["archs"].values())
        compiled = sum(a["compiled"] for a in summary["archs"].values())
        print(
            f"memra warmup: {total} kernels over {len(summary['archs'])} arch(es): {hits} hits, "
            f"{compiled} compiled, {time.perf_counter() - t0:.1f} s"
        )
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from engine.kcache import KernelCache

    cache = KernelCache()
    entries = cache.entries()
    size = sum(p.stat().st_size for p in entries)
    print(f"kernel cache {cache.root}: {len(entries)} cubins, {size / 2**20:.1f} MiB")
    if args.clear:
        import shutil

        shutil.rmtree(cache.root, ignore_errors=True)
        print("cleared")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.launch import serve_from_cli

    return serve_from_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench import bench_from_cli

    return bench_from_cli(args)


def cmd_keys(args: argparse.Namespace) -> int:
    from engine.server.launch import keys_from_cli

    return keys_from_cli(args)


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memra", description="memra: LLM inference on NVIDIA GPUs via cuda-python"
    )
    parser.add_argument("--version", action="version", version=f"memra {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server")
    _add_model(p)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--config", default=None, help="memra.toml (host, port, models, limits, API keys)")
    p.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto (default): a request that omits temperature/top_p/top_k/min_p/repetition_penalty gets "
        "the model's own value (generation_config.json, GGUF general.sampling.*); none: memra's neutral "
        "defaults (temperature 1, no top-p/top-k) instead",
    )
    _add_backend_flags(p)
    _add_device_flags(p)
    _add_spec_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run", help="generate text for one prompt")
    _add_model(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stats", action="store_true", help="print tokens/s and TTFT")
    _add_sampling_flags(p)
    _add_backend_flags(p)
    _add_device_flags(p)
    _add_spec_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model(p)
    p.add_argument("--system", default=None)
    p.add_argument("--stats", action="store_true")
    _add_sampling_flags(p)
    _add_backend_flags(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="benchmark compile, load, prefill, decode and the engine loop")
    _add_model(p)
    p.add_argument("--concurrency", default=None, help="comma list: also measure through the engine loop")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    p.add_argument("--prompt-tokens", type=int, default=None, help="engine-loop prompt length (default 440)")
    p.add_argument("--gen-tokens", type=int, default=None, help="engine-loop tokens per request (default 128)")
    p.add_argument("--skip-runner", action="store_true", help="only the engine-loop rows (with --concurrency)")
    p.add_argument(
        "--batches", default=None, help="comma list of decode batch sizes (default: every CUDA-graph bucket)"
    )
    _add_backend_flags(p)
    _add_spec_flags(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("warmup", help="fill the kernel cache ahead of time (no GPU needed)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="a model file or directory")
    g.add_argument("--family", default=None, help="a family of models/*.yaml")
    p.add_argument("--quant", default=None, help="one quant combo of --family (default: all)")
    p.add_argument("--size", default=None, help="one size of the family's `sizes:` (default: all)")
    g2 = p.add_mutually_exclusive_group()
    g2.add_argument("--device-profile", default=None)
    g2.add_argument("--all-profiles", action="store_true")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPUs)")
    p.add_argument("--list", action="store_true", help="list the kernels instead of compiling")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("profiles", help="show the detected GPU and the device profile chosen")
    p.add_argument("--device-profile", default=None)
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("keys", help="manage API keys in the server's TOML config")
    p.add_argument("action", choices=("add", "list", "revoke"))
    p.add_argument("--config", default="memra.toml")
    p.add_argument("--tenant", default=None)
    p.add_argument("--name", default=None, help="key name (add/revoke)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight per tenant (add; 0: unlimited)")
    p.add_argument("--requests-per-minute", type=int, default=None, help="request rate limit of the key (add; 0: unlimited)")
    p.add_argument(
        "--tokens-per-minute", type=int, default=None, help="prompt + generated tokens per minute (add; 0: unlimited)"
    )
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("cache", help="show (or --clear) the kernel cache")
    p.add_argument("--clear", action="store_true")
    p.set_defaults(func=cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.types import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or env.MEMRA_LOG_LEVEL.get()).upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="memra: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (MemraError, ConfigError) as exc:
        _err(str(exc))
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as exc:
        from engine.compile import KernelCacheMiss
        from engine.nvrtc import NvrtcError, NvrtcUnavailable

        if isinstance(exc, (KernelCacheMiss, NvrtcError, NvrtcUnavailable, FileNotFoundError)):
            _err(str(exc))
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
