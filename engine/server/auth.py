"""API-key authentication: bearer or x-api-key, sha256 + hmac.compare_digest, tenant resolution.

The key list is re-read when the keys file changes (checked at most once a second), so
``memra keys revoke`` takes effect without a restart. Must not import falcon or the engine loop.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass

from engine.server_config import ApiKey, ServerConfig

log = logging.getLogger("memra.server")


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrency: int = 0
    cache_salt: str = ""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0


OPEN_TENANT = Tenant("default")


class Keyring:
    def __init__(self, config: ServerConfig):
        self._config = config
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._checked = 0.0
        self._keys: tuple[ApiKey, ...] = config.load_keys()
        if config.keys_file and os.path.exists(config.keys_file):
            self._mtime = os.stat(config.keys_file).st_mtime_ns

    @property
    def enabled(self) -> bool:
        self._maybe_reload()
        return bool(self._keys)

    def _maybe_reload(self) -> None:
        path = self._config.keys_file
        if not path:
            return
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        with self._lock:
            self._checked = now
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                mtime = None
            if mtime != self._mtime:
                try:
                    self._keys = self._config.load_keys()
                    self._mtime = mtime
                    log.info("reloaded %d API key(s) from %s", len(self._keys), path)
                except Exception as exc:  # keep the old keys rather than opening the server
                    log.error("keys file %s not reloaded: %s", path, exc)

    def authenticate(self, presented: str | None) -> Tenant | None:
        """Return the tenant for a presented key, OPEN_TENANT when no keys exist, None when rejected."""
        self._maybe_reload()
        keys = self._keys
        if not keys:
            return OPEN_TENANT
        if not presented:
            return None
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).hexdigest()
        found = None
        for k in keys:  # compare against every key: timing does not reveal which one matched
            if hmac.compare_digest(digest, k.sha256):
                found = k
        if found is None:
            return None
        return Tenant(
            found.tenant,
            found.max_concurrency,
            found.cache_salt,
            found.requests_per_minute,
            found.tokens_per_minute,
        )


def presented_key(auth_header: str | None, x_api_key: str | None) -> str | None:
    if auth_header:
        scheme, _, token = auth_header.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    if x_api_key:
        return x_api_key.strip()
    return None
