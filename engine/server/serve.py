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

import waitress
from waitress.server import BaseWSGIServer

from engine.server_config import ServerConfig

from .app import build_app
from .state import AppState

log = logging.getLogger("memra.server")


def make_waitress(
    app, config: ServerConfig, *, host: str | None = None, port: int | None = None
) -> BaseWSGIServer:
    """A waitress server sized from the admission limit, with read-ahead so client disconnects are seen."""
    return waitress.create_server(
        app,
        host=host or config.host,
        port=config.port if port is None else port,
        threads=config.waitress_threads,
        channel_request_lookahead=1,
        max_request_body_size=2 * config.max_body_bytes + 65536,  # ours answers JSON 413 below this
        ident="memra",
        connection_limit=config.waitress_threads + 64,
        cleanup_interval=5,
        channel_timeout=120,
    )


def stop_waitress(server: BaseWSGIServer, thread: threading.Thread | None, timeout_s: float = 5.0) -> None:
    """Close every socket from inside waitress's own loop thread (so its select never sees a closed fd),
    wait for the loop to end, then stop the worker threads."""
    from waitress import wasyncore

    sock_map = server._map
    try:
        server.trigger.pull_trigger(lambda: wasyncore.close_all(sock_map))
    except Exception:  # trigger already gone: close from here
        wasyncore.close_all(sock_map)
    if thread is not None:
        thread.join(timeout_s)
    server.task_dispatcher.shutdown(timeout=timeout_s)


class BackgroundServer:
    """waitress in a daemon thread (tests, embedding). ``url`` is http://host:port."""

    def __init__(self, app, config: ServerConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.server = make_waitress(app, config or ServerConfig(), host=host, port=port)
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
    """Refuse new work, let in-flight requests finish for up to ``timeout_s``, then shut the engine down.

    Returns True when everything finished inside the bound.
    """
    state.draining = True
    eng = state.engine
    if eng is not None:
        try:
            eng.drain()
        except Exception as exc:
            log.warning("engine.drain failed: %s", exc)
    clean = state.wait_idle(timeout_s)
    if not clean:
        log.warning(
            "drain: %d request(s) still running after %.0f s; aborting them", state.in_flight, timeout_s
        )
    if eng is not None:
        try:
            eng.shutdown(timeout_s=10.0)
        except Exception as exc:
            log.warning("engine.shutdown failed: %s", exc)
        state.wait_idle(2.0)  # let aborted streams write their final chunk
    return clean


def run_server(
    config: ServerConfig,
    load_model: Callable[[], tuple[Any, Any, Any]],
    *,
    install_signals: bool = True,
    stop_event: threading.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop_event``). ``load_model() -> (engine, tokenizer, ModelInfo)``
    runs in a background thread while /health answers 503 {"status": "loading"}.
    Exit code: 0 after a clean drain, 1 if the model failed to load or the drain timed out.
    """
    state = AppState(config)
    app = build_app(state)
    if not state.keyring.enabled:
        log.warning(
            "no API keys configured: the server is open to anyone who can reach %s:%d",
            config.host,
            config.port,
        )
    server = make_waitress(app, config)
    stop = stop_event or threading.Event()
    result = {"code": 0}

    def load() -> None:
        t0 = time.monotonic()
        try:
            engine, tokenizer, info = load_model()
        except Exception as exc:
            log.exception("model load failed")
            state.load_error = str(exc) or type(exc).__name__
            result["code"] = 1
            return
        state.attach(engine, tokenizer, info)
        log.info("model %s ready in %.1f s (%s backend)", info.id, time.monotonic() - t0, info.backend)

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
    return result["code"]
