"""Errors answered by waitress itself are JSON in the API's shape; half-sent requests get a JSON 408
within request_timeout_s and never delay /health (a real waitress server on 127.0.0.1)."""

from __future__ import annotations

import json
import socket
import time

from server_fakes import FakeEngine, FakeTokenizer

from engine.server.app import create_app
from engine.server.model_info import ModelInfo
from engine.server.serve import BackgroundServer
from engine.server_config import ServerConfig


def _raw(port: int, data: bytes, timeout: float = 10.0, first: int = 0) -> tuple[int, dict, bytes]:
    """Send ``data`` (its first ``first`` bytes, a pause, then the rest: the server has read all of it
    when it answers, so closing does not reset the connection) and read the whole response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if first:
            s.sendall(data[:first])
            time.sleep(0.2)
            data = data[first:]
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), hdrs, body


def _server(**cfg):
    app = create_app(FakeEngine(), FakeTokenizer(), ModelInfo("m", 4096, "fake", 1), ServerConfig(**cfg))
    return BackgroundServer(app, ServerConfig(**cfg))


def test_waitress_errors_are_json_in_the_api_shape():
    with _server(max_body_bytes=1000) as srv:
        st, h, body = _raw(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        assert st == 400 and h["content-type"] == "application/json"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        st, h, body = _raw(srv.port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        err = json.loads(body)
        assert st == 413 and err["type"] == "error" and err["error"]["type"] == "request_too_large"
        st, h, body = _raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        assert st == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 262200 + b"\r\n\r\n"
        st, h, body = _raw(srv.port, big, first=262000)
        assert st == 431 and json.loads(body)["error"]["code"] == "request_too_large"


def test_half_sent_requests_time_out_and_do_not_starve_health():
    with _server(request_timeout_s=1.0) as srv:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)  # connects, sends nothing
        socks = []
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n{\"messages\":[")
            socks.append(s)
        time.sleep(0.2)
        worst = 0.0
        for path in ("/health", "/ready", "/metrics") * 3:
            t0 = time.monotonic()
            st, _, _ = _raw(srv.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            worst = max(worst, time.monotonic() - t0)
            assert st == 200
        assert worst < 0.1, f"health answered in {worst * 1000:.0f} ms under 200 slow connections"
        t0 = time.monotonic()
        for s in socks:
            data = s.recv(4096)
            assert data.startswith(b"HTTP/1.1 408") and b"application/json" in data
            body = data.partition(b"\r\n\r\n")[2]
            assert json.loads(body)["error"]["type"] == "invalid_request_error"  # Anthropic shape
            s.close()
        assert silent.recv(4096).startswith(b"HTTP/1.1 408")
        silent.close()
        assert time.monotonic() - t0 < 3.0
