"""`memra serve` and `memra keys`: turn CLI flags + memra.toml into a running server.

Builds the model -> tokenizer -> runner -> Engine stack in a loader thread started before the HTTP
server is imported and built (they overlap; run_server's loader thread waits for it, so /health
says "loading" meanwhile), with the runner's graph captures held until /ready answers, and maps
API-key tenants to engine concurrency limits. Must not import CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from engine.backend import StackFlags, load_stack
from engine.server.model_info import ModelInfo
from engine.server_config import ServerConfig, add_key, load_server_config, read_keys, revoke_key
from engine.types import ConfigError, MemraError

DEFAULT_ALIAS = "default"


def _model_and_aliases(args: argparse.Namespace, cfg: ServerConfig) -> tuple[str | None, tuple[str, ...]]:
    """(model path or None for the embedded default, names the model answers to)."""
    if args.model:
        from engine.default_model import KNOWN_MODELS

        if args.model in KNOWN_MODELS and not Path(args.model).expanduser().exists():
            # a known model alias (`memra serve gemma3-270m`): the model also answers to the alias
            from engine.backend import resolve_model_path

            return str(resolve_model_path(args.model)), (args.model, DEFAULT_ALIAS)
        aliases = [a for a, p in cfg.models.items() if Path(p).expanduser() == Path(args.model).expanduser()]
        return args.model, tuple(aliases) + (DEFAULT_ALIAS,)
    paths = {str(Path(p).expanduser()) for p in cfg.models.values()}
    if len(paths) > 1:
        raise ConfigError(
            "memra serves one model per process; the config/MEMRA_MODELS name several different paths "
            f"({', '.join(sorted(paths))}). Run one `memra serve` per model."
        )
    if paths:
        return paths.pop(), tuple(cfg.models) + (DEFAULT_ALIAS,)
    return None, (DEFAULT_ALIAS,)


def build_engine(
    model_arg: str | None,
    aliases: tuple[str, ...],
    cfg: ServerConfig,
    flags: StackFlags = StackFlags(),
    spec: Any = None,
    model_defaults: bool = True,
    hold_background: bool = False,
):
    """(Engine, Tokenizer, ModelInfo) ready to serve; used by `memra serve` and the server tests.
    ``flags``: backend, device and runner flags (``window_kv_blocks`` None: the window pool sized for
    ``cfg.max_running`` sequences and the profile's prefill chunk; ``overlap``: EngineConfig.overlap).
    ``spec``: an engine.spec.config.SpecConfig (speculative decoding) or None.
    ``model_defaults``: requests that omit a sampling parameter get the model's own value
    (generation_config.json / GGUF general.sampling.*). ``hold_background``: the runner's background
    work (graph captures, engine.runner_warm) waits for ``engine.start_background()``."""
    from engine.gen_defaults import model_generation_defaults
    from engine.loop import Engine, EngineConfig
    from engine.spec.build import build_speculator

    # (the CUDA runner's graph captures run on the engine thread after ready: engine.runner_warm)
    model, tokenizer, runner = load_stack(model_arg, flags, max_running=cfg.max_running, defer_warm_up=True)
    speculator = build_speculator(spec, model, runner, device_profile=flags.device_profile)
    keys = read_keys(cfg.keys_file) if cfg.keys_file else list(cfg.keys)
    limits = {k.tenant: k.max_concurrency for k in keys if k.max_concurrency > 0}
    profile = getattr(runner, "profile", None)  # the CUDA runner's device profile sets the prefill budget
    chunk = profile.prefill_chunk_tokens if profile is not None else EngineConfig.prefill_chunk_tokens
    engine = Engine(
        runner,
        tokenizer,
        EngineConfig(
            max_running=cfg.max_running,
            max_waiting=max(1, cfg.max_waiting + cfg.max_running),  # the HTTP layer sheds first
            prefill_chunk_tokens=chunk,
            max_step_tokens=max(EngineConfig.max_step_tokens, chunk + cfg.max_running),
            tenant_max_concurrency=limits,
            overlap=flags.overlap,
        ),
        speculator=speculator,
        hold_background=hold_background,
    )
    engine.start()
    model_id = model.path.stem if model.path.suffix == ".gguf" else model.path.name
    info = ModelInfo(
        id=model_id,
        context_length=int(runner.max_model_len),
        backend=runner.backend,
        created=int(time.time()),
        aliases=tuple(a for a in aliases if a != model_id),
        generation_defaults=tuple(sorted(model_generation_defaults(model.weights.metadata).items()))
        if model_defaults
        else (),
    )
    if info.generation_defaults:
        shown = ", ".join(f"{k}={v:g}" for k, v in info.generation_defaults)
        print(f"memra: the model's generation defaults apply where a request omits them: {shown}", file=sys.stderr)
    return engine, tokenizer, info


class _EarlyLoad:
    """``load()`` run in a thread from now on; calling the object waits for it (its exception re-raised):
    `memra serve` starts loading the model before it imports and builds the HTTP server, so the two
    overlap where loading leaves the GIL (the driver's init, the weight upload)."""

    def __init__(self, load: Any):
        import threading

        self._load, self._out, self._exc = load, None, None
        self.started = time.monotonic()  # (run_server's ready line counts from here)
        self._thread = threading.Thread(target=self._run, daemon=True, name="model-load-early")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = self._load()
        except BaseException as exc:  # (re-raised when called: in run_server's loader thread)
            self._exc = exc

    def __call__(self) -> Any:
        self._thread.join()
        if self._exc is not None:
            raise self._exc
        return self._out


def serve_from_cli(args: argparse.Namespace) -> int:
    from engine.spec.config import parse_speculative

    cfg = load_server_config(
        args.config,
        host=args.host,
        port=args.port,
        speculative=getattr(args, "speculative", None),
        spec_tokens=getattr(args, "spec_tokens", None),
    )
    try:
        spec = parse_speculative(cfg.speculative, cfg.spec_tokens)
    except ConfigError as exc:  # name the config file when the setting came from it
        where = f"{args.config} (server.speculative / server.spec_tokens) or the flags"
        raise ConfigError(f"{where}: {exc.message}" if args.config else exc.message) from None
    flags = StackFlags.of(args)  # flag errors before loading
    model_arg, aliases = _model_and_aliases(args, cfg)
    if model_arg is None:
        # fetch the default model before the server starts, so a download problem is a clear CLI error
        from engine.default_model import default_model_path

        model_arg = str(default_model_path())
    print(f"memra: serving on http://{cfg.host}:{cfg.port} (loading {model_arg})", file=sys.stderr)
    use_defaults = getattr(args, "generation_config", "auto") != "none"
    from engine.server.tokenize_pool import limit_malloc_arenas

    limit_malloc_arenas(cfg.malloc_arena_max)  # (before the loading starts threads: run_server's rule)
    early = _EarlyLoad(
        lambda: build_engine(model_arg, aliases, cfg, flags, spec, model_defaults=use_defaults, hold_background=True)
    )
    from engine.server.serve import run_server

    return run_server(
        cfg,
        early,  # (waits for the load; the background work starts once /ready answers: run_server)
        raise_load_error=True,  # a bad model: exit non-zero with the one-line error `memra run` gives
    )


def _keys_path(args: argparse.Namespace) -> Path:
    """The keys file that ``memra keys`` edits. ``--config`` names the server config; when that
    file does not exist yet it is created as ``[server] keys_file = "<name>.keys.toml"`` so that
    ``memra serve --config`` reads the keys written next to it. A file that already holds
    ``[[key]]`` tables is a keys file itself (older setups)."""
    cfg_path = Path(args.config)
    if cfg_path.exists():
        from engine.server_config import tomllib

        try:
            if "key" in tomllib.loads(cfg_path.read_text(encoding="utf-8")):
                return cfg_path
        except (OSError, tomllib.TOMLDecodeError):
            pass  # load_server_config reports it with the file name
        cfg = load_server_config(cfg_path)
        if cfg.keys_file:
            return Path(cfg.keys_file)
        raise ConfigError(f"{cfg_path}: set server.keys_file (the TOML file holding API keys) to manage keys")
    if args.action != "add":
        return cfg_path.with_name(cfg_path.stem + ".keys.toml")
    keys = cfg_path.with_name(cfg_path.stem + ".keys.toml")
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(f'[server]\nkeys_file = "{keys.name}"\n', encoding="utf-8")
    print(f"created {cfg_path} (server config; its API keys live in {keys})")
    return keys


_KEY_LIMITS = ("max_concurrency", "requests_per_minute", "tokens_per_minute")


def _key_limits(args: argparse.Namespace) -> dict[str, int]:
    """The per-key limit flags of ``memra keys add``, checked before any file is read or written."""
    limits = {}
    for name in _KEY_LIMITS:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            flag = "--" + name.replace("_", "-")
            raise MemraError(f"memra keys add: {flag} must be >= 0 (0: unlimited), got {value}", param=name)
        limits[name] = value or 0
    return limits


def keys_from_cli(args: argparse.Namespace) -> int:
    if args.action == "add":
        if not args.tenant:
            raise MemraError("memra keys add needs --tenant NAME", param="tenant")
        limits = _key_limits(args)
    elif any(getattr(args, n, None) is not None for n in _KEY_LIMITS):
        raise MemraError(f"memra keys {args.action}: the limit flags apply to `memra keys add` only")
    path = _keys_path(args)
    if args.action == "add":
        key, entry = add_key(path, args.tenant, **limits)
        print(f"added {entry.id} for tenant {entry.tenant} to {path}")
        print(f"key (shown once, store it now): {key}")
    elif args.action == "list":
        keys = read_keys(path)  # (a missing file: none)
        if not keys:
            print(f"no keys in {path}")
        for k in keys:
            shown = "  ".join(f"{n}={getattr(k, n) or 'unlimited'}" for n in _KEY_LIMITS)
            print(f"{k.id}  tenant={k.tenant}  {shown}  created={k.created}")
    else:
        if not args.name:
            raise MemraError("memra keys revoke needs --name KEY_ID (see `memra keys list`)", param="name")
        gone = revoke_key(path, args.name)
        print(f"revoked {gone.id} (tenant {gone.tenant})")
    return 0
