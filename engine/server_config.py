"""HTTP server configuration from TOML (+ MEMRA_MODELS), and the API-key file (add/list/revoke).

Every ``[server]`` key is a ``ServerConfig`` field; the file formats (server TOML, keys file with
sha256 hashes only) are shown in docs/serving.md. Must not import the engine loop, falcon or waitress.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import tempfile
import time
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from engine import env
from engine.types import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class ApiKey:
    id: str
    sha256: str
    tenant: str
    max_concurrency: int = 0  # 0: unlimited (engine admission still applies)
    cache_salt: str = ""
    created: int = 0
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0  # prompt + generated tokens; 0: unlimited


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = 64
    keepalive_s: float = 5.0
    drain_timeout_s: float = 30.0
    max_running: int = 64
    max_waiting: int = 64  # requests queued beyond max_running before 429 overloaded
    threads: int = 0
    connection_limit: int = 4096  # open sockets (slow clients included) before accept pauses
    request_timeout_s: float = 10.0  # a request's headers + body must arrive within this
    idle_timeout_s: float = 30.0  # an idle keep-alive connection is closed after this
    max_prompt_bytes: int = 0  # prompt text bytes refused before tokenising; 0: 16 x context length
    tokenizer_threads: int = 1  # the dedicated pool that renders templates and tokenises prompts
    malloc_arena_max: int = 2  # glibc malloc arenas (set before threads start; 0: leave glibc's default)
    retry_after_s: int = 1
    keys_file: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    keys: tuple[ApiKey, ...] = ()  # used when keys_file is None (tests); else read from keys_file
    system_fingerprint: str = "fp_memra"
    speculative: str | None = None  # `--speculative`: ngram | draft:PATH | mtp (engine.spec.config)
    spec_tokens: int | None = None  # `--spec-tokens`

    @property
    def waitress_threads(self) -> int:
        """Enough for every admitted request plus spare threads that answer /health, /metrics and 429s."""
        return self.threads if self.threads > 0 else self.max_running + self.max_waiting + 16

    @property
    def max_in_flight(self) -> int:
        """Requests admitted at once (running + waiting); the next one gets 429 overloaded."""
        return self.max_running + self.max_waiting

    def load_keys(self) -> tuple[ApiKey, ...]:
        if self.keys_file:
            return tuple(read_keys(self.keys_file))
        return self.keys


def _kinds(cls) -> dict[str, type]:
    """Each scalar field of a config dataclass -> its type (``str | None`` -> str)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        t = hints[f.name]
        if isinstance(t, types.UnionType):
            t = next(a for a in typing.get_args(t) if a is not type(None))
        if t in (str, int, float):
            out[f.name] = t
    return out


_SERVER_TYPES = _kinds(ServerConfig)  # the [server] keys (models and keys come from elsewhere)
_AT_LEAST = {  # server.<name> must be >= the value
    **dict.fromkeys(("max_body_bytes", "max_json_depth", "max_running", "tokenizer_threads", "connection_limit"), 1),
    **dict.fromkeys(("max_waiting", "max_prompt_bytes", "malloc_arena_max", "threads"), 0),
}


def parse_models_env(value: str, source: str = "MEMRA_MODELS") -> dict[str, str]:
    """``alias=path,alias2=path2`` -> {alias: path}."""
    out: dict[str, str] = {}
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        alias, sep, path = part.partition("=")
        if not sep or not alias.strip() or not path.strip():
            raise ConfigError(f"{source}: entry {part!r} is not alias=path")
        out[alias.strip()] = path.strip()
    return out


def load_server_config(path: str | os.PathLike | None = None, **overrides) -> ServerConfig:
    """Read the TOML file (if given), then MEMRA_MODELS, then keyword overrides (CLI flags)."""
    values: dict = {}
    models: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read server config ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
        unknown = set(data) - {"server", "models"}
        if unknown:
            raise ConfigError(f"{p}: unknown table(s) {sorted(unknown)}; expected [server] and [models]")
        for key, v in (data.get("server") or {}).items():
            kind = _SERVER_TYPES.get(key)
            if kind is None:
                raise ConfigError(
                    f"{p}: server.{key} is not a known setting ({', '.join(sorted(_SERVER_TYPES))})"
                )
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ConfigError(f"{p}: server.{key} must be {kind.__name__}, got {v!r}")
            values[key] = v
        if "keys_file" in values and not os.path.isabs(values["keys_file"]):
            values["keys_file"] = str(p.parent / values["keys_file"])
        for alias, mp in (data.get("models") or {}).items():
            if not isinstance(mp, str):
                raise ConfigError(f"{p}: models.{alias} must be a path string")
            models[alias] = mp
    models.update(parse_models_env(env.MEMRA_MODELS.get()))
    values["models"] = models
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = ServerConfig(**values)
    _validate(cfg, str(path or "<defaults>"))
    return cfg


def _validate(cfg: ServerConfig, src: str) -> None:
    if not (0 <= cfg.port <= 65535):
        raise ConfigError(f"{src}: server.port {cfg.port} is not in 0..65535")
    for name, lo in _AT_LEAST.items():
        if getattr(cfg, name) < lo:
            raise ConfigError(f"{src}: server.{name} must be >= {lo}")
    if cfg.request_timeout_s <= 0 or cfg.idle_timeout_s <= 0:
        raise ConfigError(f"{src}: server.request_timeout_s and server.idle_timeout_s must be > 0")
    if 0 < cfg.threads <= cfg.max_in_flight:
        raise ConfigError(
            f"{src}: server.threads ({cfg.threads}) must exceed max_running + max_waiting "
            f"({cfg.max_in_flight}) so health checks and 429 answers always find a thread"
        )
    if cfg.keepalive_s <= 0 or cfg.drain_timeout_s < 0:
        raise ConfigError(f"{src}: server.keepalive_s must be > 0 and server.drain_timeout_s >= 0")


# ---------------------------------------------------------------- keys file


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


_KEY_TYPES = _kinds(ApiKey)  # every field of a [[key]] entry


def read_keys(path: str | os.PathLike) -> list[ApiKey]:
    """Parse the keys file; a missing file means no keys. Raises ConfigError naming the entry."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    out = []
    for i, e in enumerate(data.get("key") or []):
        try:  # id, sha256 and tenant are required (the fields without a default)
            k = ApiKey(**{f.name: _KEY_TYPES[f.name](e[f.name] if f.default is MISSING else e.get(f.name, f.default)) for f in fields(ApiKey)})
            k = replace(k, sha256=k.sha256.lower())
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{p}: key[{i}] is missing or has a bad field ({exc}); needs id, sha256, tenant"
            ) from None
        unknown = set(e) - set(_KEY_TYPES)
        if unknown:
            raise ConfigError(f"{p}: key[{i}] has unknown field(s) {sorted(unknown)}")
        if min(k.max_concurrency, k.requests_per_minute, k.tokens_per_minute) < 0:
            raise ConfigError(f"{p}: key[{i}]: limits must be >= 0 (0 = unlimited)")
        if len(k.sha256) != 64 or any(c not in "0123456789abcdef" for c in k.sha256):
            raise ConfigError(f"{p}: key[{i}].sha256 is not a 64-digit hex sha256")
        out.append(k)
    return out


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def write_keys(path: str | os.PathLike, keys: list[ApiKey]) -> None:
    """Atomically rewrite the keys file (temp file in the same folder, fsync, rename; mode 0600)."""
    p = Path(path)
    lines = ["# memra API keys: sha256 hashes only. Edit with `memra keys add/list/revoke`.", ""]
    for k in keys:
        values = ((name, getattr(k, name)) for name in _KEY_TYPES)
        lines += ["[[key]]", *(f"{n} = {_q(v) if isinstance(v, str) else int(v)}" for n, v in values), ""]
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=str(p.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def add_key(
    path: str | os.PathLike,
    tenant: str,
    *,
    max_concurrency: int = 0,
    cache_salt: str | None = None,
    key: str | None = None,
    requests_per_minute: int = 0,
    tokens_per_minute: int = 0,
) -> tuple[str, ApiKey]:
    """Create a key for ``tenant``; returns (plaintext key, shown once, and its stored entry)."""
    if not tenant or any(c in tenant for c in '"\\\n'):
        raise ConfigError(f"keys: tenant name {tenant!r} must be non-empty without quotes or newlines")
    if min(max_concurrency, requests_per_minute, tokens_per_minute) < 0:
        raise ConfigError("keys: max_concurrency, requests_per_minute and tokens_per_minute must be >= 0")
    key = key or "sk-memra-" + secrets.token_urlsafe(32)
    h = hash_key(key)
    keys = read_keys(path)
    if any(k.sha256 == h for k in keys):
        raise ConfigError(f"{path}: this key already exists")
    entry = ApiKey(
        id="key_" + h[:8],
        sha256=h,
        tenant=tenant,
        max_concurrency=max_concurrency,
        cache_salt=tenant if cache_salt is None else cache_salt,
        created=int(time.time()),
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
    )
    write_keys(path, keys + [entry])
    return key, entry


def revoke_key(path: str | os.PathLike, key_id: str) -> ApiKey:
    """Remove the entry whose id (or sha256) is ``key_id``; raises ConfigError when none matches."""
    keys = read_keys(path)
    keep = [k for k in keys if key_id not in (k.id, k.sha256)]
    if len(keep) == len(keys):
        raise ConfigError(f"{path}: no key with id {key_id!r} (see `memra keys list`)")
    gone = next(k for k in keys if key_id in (k.id, k.sha256))
    write_keys(path, keep)
    return gone
