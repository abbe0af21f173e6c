"""Production startup: waitress over the app, background model load (/health 503 until done), SIGTERM drain.

``run_server(config, load_model)`` blocks until the server has stopped and returns an exit code.
Must not import CUDA or numpy; the model is loaded only through the ``load_model`` callable.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.progress import process_age
from engine.server_config import ServerConfig
from engine.types import MemraError

from .app import _STATES, build_app
from .state import AppState
from .tokenize_pool import limit_malloc_arenas
from .waitress_guard import make_waitress, stop_waitress

__all__ = ["BackgroundServer", "drain_and_stop", "make_waitress", "run_server", "stop_waitress"]

log = logging.getLogger("memra.server")


class BackgroundServer:
    """waitress in a daemon thread (tests, embedding). ``url`` is http://host:port."""

    def __init__(self, app, config: ServerConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        state = _STATES.get(id(app))  # an app from create_app: its 408s count in its metrics
        on_timeout = (lambda: state.metrics.count_rejected("request_timeout")) if state is not None else None
        self.server = make_waitress(app, config or ServerConfig(), host=host, port=port, on_timeout=on_timeout)
        self.port = self.server.effective_port
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.run, daemon=True, name="waitress")

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            stop_waitress(self.server, self._thread)


def drain_and_stop(state: AppState, timeout_s: float) -> bool:
    """Refuse new work, let in-flight requests finish for up to ``timeout_s``, then abort the rest
    (their streams end with an error and the protocol's terminal event) and shut the engine down,
    all within ``timeout_s`` + 1 s unless one engine step is longer than that.

    Returns True when everything finished inside the bound.
    """
    t_end = time.monotonic() + timeout_s
    state.draining = True
    eng = state.engine
    if eng is not None:
        try:
            eng.drain()
        except Exception as exc:
            log.warning("engine.drain failed: %s", exc)
    clean = state.wait_idle(timeout_s)
    if not clean:
        runs = state.live_runs()
        log.warning("drain: %d request(s) still running after %.0f s; aborting them", len(runs), timeout_s)
        for run in runs:  # abort through the engine: each stream gets its final "abort" event
            run.abort()
    if eng is not None:
        try:
            eng.shutdown(timeout_s=max(0.2, min(0.5, t_end + 0.5 - time.monotonic())))
        except Exception as exc:
            log.warning("engine.shutdown failed: %s", exc)
    # let aborted streams write their final chunks; stop_waitress then waits for the bytes to leave
    state.wait_idle(max(0.1, t_end + 0.7 - time.monotonic()))
    state.tokenize_pool.shutdown()
    return clean


def _since_start(engine: Any) -> str:
    """The ready line's tail: the time since the process started (the part before loading is on
    the "memra: loading" line), and whether the runner's graph captures follow in the background."""
    age = process_age()
    out = f", {age:.2f} s after the process started" if age is not None else ""
    if getattr(engine, "warming_up", False):
        out += "; graph captures continue in the background, between requests"
    return out


def run_server(
    config: ServerConfig,
    load_model: Callable[[], tuple[Any, Any, Any]],
    *,
    install_signals: bool = True,
    stop_event: threading.Event | None = None,
    raise_load_error: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop_event``). ``load_model() -> (engine, tokenizer, ModelInfo)``
    runs in a background thread while /health answers 503 {"status": "loading"}.
    Exit code: 0 after a clean drain, 1 if the drain bound was hit (stragglers aborted) or the model
    failed to load: then the server stops at once and, with ``raise_load_error``, the load error is
    re-raised as a one-line MemraError (what `memra serve` prints).
    """
    limit_malloc_arenas(config.malloc_arena_max)  # before waitress and tokenizer threads exist
    state = AppState(config)
    app = build_app(state)
    if not state.keyring.enabled:
        log.warning(
            "no API keys configured: the server is open to anyone who can reach %s:%d",
            config.host,
            config.port,
        )
    server = make_waitress(app, config, on_timeout=lambda: state.metrics.count_rejected("request_timeout"))
    stop = stop_event or threading.Event()
    result: dict[str, Any] = {"code": 0, "error": None}

    def load() -> None:
        t0 = getattr(load_model, "started", None) or time.monotonic()  # (a load begun before: _EarlyLoad)
        try:
            engine, tokenizer, info = load_model()
        except Exception as exc:
            log.debug("model load failed", exc_info=True)
            state.load_error = (str(exc) or type(exc).__name__).splitlines()[0]
            result["code"], result["error"] = 1, exc
            stop.set()
            return
        state.attach(engine, tokenizer, info)
        start = getattr(engine, "start_background", None)
        if callable(start):  # (an engine built with hold_background: its captures run from now on)
            start()
        log.info("model %s ready in %.1f s (%s backend)%s", info.id, time.monotonic() - t0, info.backend,
                 _since_start(engine))  # fmt: skip

    def on_signal(signum, frame) -> None:
        if stop.is_set() or state.draining:
            log.warning("second signal: stopping now")
            stop.set()
            return
        log.info("signal %d: draining (up to %.0f s)", signum, config.drain_timeout_s)
        threading.Thread(target=drain_then_stop, daemon=True).start()

    def drain_then_stop() -> None:
        if not drain_and_stop(state, config.drain_timeout_s):
            result["code"] = 1
        stop.set()

    if install_signals:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=load, daemon=True, name="model-load").start()
    srv_thread = threading.Thread(target=server.run, daemon=True, name="waitress")
    srv_thread.start()
    log.info(
        "listening on http://%s:%s (%d threads)", config.host, server.effective_port, config.waitress_threads
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        stop_waitress(server, srv_thread)
    err = result["error"]
    if err is not None:
        if raise_load_error:
            if isinstance(err, MemraError):
                raise err
            raise MemraError(f"cannot load the model: {type(err).__name__}: {state.load_error}") from None
        log.error("model load failed: %s", state.load_error)
    return result["code"]
