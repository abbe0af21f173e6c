"""Shared server state: engine/tokenizer/model once loaded, keyring, metrics, draining flag, tenant counts.

Must not import falcon or waitress.
"""

from __future__ import annotations

import threading
from typing import Any

from engine.server_config import ServerConfig

from .admission import Admission
from .auth import Keyring, Tenant
from .errors import from_code
from .metrics import Metrics
from .model_info import ModelInfo
from .tokenize_pool import TokenizePool


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
        self.admission = Admission(config.max_in_flight, config.retry_after_s)
        self.tokenize_pool = TokenizePool(config.tokenizer_threads)
        self._runs_lock = threading.Lock()
        self._runs: dict[int, Any] = {}  # live generation.Run objects (cancelled when a drain runs out)

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

    def require_ready(self, admit: bool = True) -> None:
        """Raise the 503 a generation request gets while loading, draining or after the engine died;
        with ``admit``, also the 429 when the server is full (before the body is even read)."""
        if self.draining:
            raise from_code("draining", "server is shutting down; retry on another replica")
        if self.engine is None:
            if self.load_error:
                raise from_code("engine_dead", f"model failed to load: {self.load_error}")
            raise from_code("loading", "model is still loading")
        if not self.alive:
            raise from_code("engine_dead", "the engine has stopped; the server needs a restart")
        if admit:
            self.admission.check_full()

    def acquire(self, tenant: Tenant, prompt_tokens: int = 0, run: Any = None, new_request: bool = True) -> None:
        """Admit one request for ``tenant`` or raise 429 (see admission.Admission.admit)."""
        self.admission.admit(tenant, prompt_tokens, new_request)
        if run is not None:
            with self._runs_lock:
                self._runs[id(run)] = run

    def release(self, tenant: Tenant, generated_tokens: int = 0, run: Any = None) -> None:
        if run is not None:
            with self._runs_lock:
                self._runs.pop(id(run), None)
        self.admission.done(tenant, generated_tokens)

    def live_runs(self) -> list[Any]:
        with self._runs_lock:
            return list(self._runs.values())

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def wait_idle(self, timeout: float) -> bool:
        return self.admission.wait_idle(timeout)
