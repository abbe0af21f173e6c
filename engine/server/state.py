"""Shared server state: engine/tokenizer/model once loaded, keyring, metrics, draining flag, tenant counts.

Must not import falcon or waitress.
"""

from __future__ import annotations

import threading
from typing import Any

from engine.server_config import ServerConfig

from .auth import Keyring, Tenant
from .errors import from_code
from .metrics import Metrics
from .model_info import ModelInfo


class AppState:
    def __init__(
        self,
        config: ServerConfig,
        engine: Any = None,
        tokenizer: Any = None,
        model_info: ModelInfo | None = None,
    ):
        self.config = config
        self.keyring = Keyring(config)
        self.metrics = Metrics()
        if model_info is not None:
            self.metrics.model_name = model_info.id
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.draining = False
        self.load_error: str | None = None
        self._lock = threading.Lock()
        self._tenant_active: dict[str, int] = {}
        self.idle = threading.Condition(self._lock)
        self._in_flight = 0

    def attach(self, engine: Any, tokenizer: Any, model_info: ModelInfo) -> None:
        self.tokenizer, self.model_info = tokenizer, model_info
        self.metrics.model_name = model_info.id
        cfg = getattr(getattr(engine, "config", None), "enable_prefix_cache", None)
        self.metrics.prefix_caching = True if cfg is None else bool(cfg)
        self.engine = engine  # last: readiness is "engine is not None"

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    @property
    def alive(self) -> bool:
        return self.engine is not None and bool(getattr(self.engine, "alive", True))

    def require_ready(self) -> None:
        """Raise the 503 a generation request gets while loading, draining or after the engine died."""
        if self.draining:
            raise from_code("draining", "server is shutting down; retry on another replica")
        if self.engine is None:
            if self.load_error:
                raise from_code("engine_dead", f"model failed to load: {self.load_error}")
            raise from_code("loading", "model is still loading")
        if not self.alive:
            raise from_code("engine_dead", "the engine has stopped; the server needs a restart")

    def acquire(self, tenant: Tenant) -> None:
        with self._lock:
            n = self._tenant_active.get(tenant.name, 0)
            if tenant.max_concurrency and n >= tenant.max_concurrency:
                raise from_code(
                    "tenant_limit",
                    f"tenant {tenant.name!r} already has {n} requests in flight (limit {tenant.max_concurrency})",
                )
            self._tenant_active[tenant.name] = n + 1
            self._in_flight += 1

    def release(self, tenant: Tenant) -> None:
        with self._lock:
            self._tenant_active[tenant.name] = max(0, self._tenant_active.get(tenant.name, 1) - 1)
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self.idle.wait_for(lambda: self._in_flight == 0, timeout=timeout)
