"""waitress hardening: HTTP-layer errors as JSON in the API's shape, a deadline for receiving a whole
request (headers + body), an idle timeout for keep-alive connections, and a flush-then-close stop.

waitress parses requests in its event-loop thread and hands only complete requests to worker
threads, so slow or half-sent requests cost a socket, never a thread; this module makes sure they
cannot hold that socket for minutes either. Must not import falcon resources or the engine.
"""

from __future__ import annotations

import json
import threading
import time
import types
from collections.abc import Callable

import waitress
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer
from waitress.task import ErrorTask

from engine.server_config import ServerConfig

from .errors import ApiError

_CODES = {413: "request_too_large", 431: "request_too_large", 408: "request_timeout"}


def error_body(status: int, message: str, path: str) -> bytes:
    """The API's error JSON for a status answered outside the app (Anthropic shape under /v1/messages)."""
    code = _CODES.get(status, "invalid_request_error" if status < 500 else "server_error")
    atype = {413: "request_too_large", 431: "request_too_large"}.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    err = ApiError(
        status,
        message,
        code=code,
        err_type="invalid_request_error" if status < 500 else "server_error",
        anthropic_type=atype,
    )
    return json.dumps(err.body_for(path)).encode()


class JsonErrorTask(ErrorTask):
    """waitress's own 400/413/431/500 answers (bad or oversized Content-Length, huge headers...) as JSON."""

    def execute(self) -> None:
        e = self.request.error
        body = error_body(e.code, f"{e.reason}: {e.body}".strip(), getattr(self.request, "path", "") or "")
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class GuardedChannel(HTTPChannel):
    """Remembers when the request being received started (for a new connection: when it was
    accepted, so a socket that sends nothing is timed out too), so maintenance can time it out."""

    error_task_class = JsonErrorTask
    receiving_since: float | None = None
    _receiving: object = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.receiving_since = time.monotonic()

    def received(self, data: bytes) -> bool:
        out = super().received(data)
        req = self.request
        if req is None:
            self._receiving, self.receiving_since = None, None
        elif req is not self._receiving:
            self._receiving, self.receiving_since = req, time.monotonic()
        return out


def _timeout_response(path: str, seconds: float) -> bytes:
    body = error_body(408, f"the request was not received completely within {seconds:g} s", path)
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _maintenance(self: BaseWSGIServer, now: float) -> None:
    """Close idle keep-alive connections after ``idle_timeout_s`` and answer 408 to requests still
    incomplete after ``request_timeout_s`` (runs in waitress's loop thread every second)."""
    idle_cutoff = now - self.adj.channel_timeout
    mono = time.monotonic()
    limit = self.memra_request_timeout_s
    for ch in list(self.active_channels.values()):
        if ch.requests or ch.will_close or ch.close_when_flushed:
            continue  # a worker owns it (or it is closing already)
        since = getattr(ch, "receiving_since", None)
        if since is not None and mono - since > limit:
            path = getattr(ch.request, "path", "") or ""
            try:
                ch.write_soon(_timeout_response(path, limit))
                ch.close_when_flushed = True
            except Exception:  # the client is gone already; never let maintenance kill the loop
                ch.will_close = True
            ch.receiving_since = None
            on_timeout = getattr(self, "memra_on_timeout", None)
            if on_timeout is not None:
                try:
                    on_timeout()
                except Exception:  # a metrics hook must never stop the loop thread
                    pass
        elif ch.last_activity < idle_cutoff:
            ch.will_close = True


ACCEPT_BATCH = 64


def _handle_accept(self: BaseWSGIServer) -> None:
    """Accept up to ACCEPT_BATCH pending connections per loop turn (waitress takes one per poll of
    every socket, so a flood of connections would queue health checks behind it)."""
    for _ in range(ACCEPT_BATCH):
        if len(self._map) >= self.adj.connection_limit:
            return
        try:
            v = self.accept()
            if v is None:
                return
            conn, addr = v
            self.set_socket_options(conn)
        except OSError:  # a bogus or already-closed socket: skip it, as waitress does
            return
        self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)


def raise_fd_limit(want: int) -> int:
    """Raise the soft open-files limit towards ``want`` (capped by the hard limit); returns the soft limit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def make_waitress(
    app,
    config: ServerConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    on_timeout: Callable[[], None] | None = None,
):
    """A waitress server sized from the admission limit, with read-ahead so client disconnects are
    seen, poll() instead of select() (thousands of sockets), JSON errors and receive deadlines.
    ``on_timeout()`` is called (in waitress's loop thread) for every 408 sent."""
    raise_fd_limit(config.connection_limit + config.waitress_threads + 256)
    server = waitress.create_server(
        app,
        host=host or config.host,
        port=config.port if port is None else port,
        threads=config.waitress_threads,
        channel_request_lookahead=1,
        max_request_body_size=config.max_body_bytes,
        ident="memra",
        connection_limit=config.connection_limit,
        cleanup_interval=1,
        channel_timeout=int(max(1, round(config.idle_timeout_s))),
        asyncore_use_poll=True,
        backlog=min(4096, max(1024, config.connection_limit)),
    )
    server.channel_class = GuardedChannel
    server.memra_request_timeout_s = config.request_timeout_s
    server.memra_on_timeout = on_timeout
    server.maintenance = types.MethodType(_maintenance, server)
    server.handle_accept = types.MethodType(_handle_accept, server)
    return server


def _quiet(server: BaseWSGIServer) -> bool:
    """No worker is writing a response and every response byte has left the buffers."""
    for ch in list(server._map.values()):
        if isinstance(ch, HTTPChannel) and (ch.requests or ch.total_outbufs_len):
            return False
    return True


def stop_waitress(server: BaseWSGIServer, thread: threading.Thread | None, timeout_s: float = 5.0) -> None:
    """Let responses already produced reach their clients (up to 1 s: the chunked terminator is written
    after the app's iterator closes), then close every socket from inside waitress's own loop thread
    (so its poll never sees a closed fd), wait for the loop to end, then stop the worker threads."""
    from waitress import wasyncore

    deadline = time.monotonic() + min(1.0, timeout_s)
    while time.monotonic() < deadline and not _quiet(server):
        time.sleep(0.01)
    sock_map = server._map
    try:
        server.trigger.pull_trigger(lambda: wasyncore.close_all(sock_map))
    except Exception:  # trigger already gone: close from here
        wasyncore.close_all(sock_map)
    if thread is not None:
        thread.join(timeout_s)
    server.task_dispatcher.shutdown(timeout=timeout_s)
