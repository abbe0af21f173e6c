"""tools/loadgen.py against a fake-engine waitress server, and run_server's loading -> ready lifecycle."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from server_fakes import FakeEngine, FakeTokenizer

from engine.server.app import create_app
from engine.server.model_info import ModelInfo
from engine.server.serve import BackgroundServer, run_server
from engine.server_config import ServerConfig

_spec = importlib.util.spec_from_file_location("loadgen", Path(__file__).parents[1] / "tools" / "loadgen.py")
loadgen = importlib.util.module_from_spec(_spec)
sys.modules["loadgen"] = loadgen  # dataclasses look the module up while the class is built
_spec.loader.exec_module(loadgen)


def test_refuses_non_loopback():
    for url in ("http://10.1.2.3:8000", "http://8.8.8.8", "https://127.0.0.1:1", "ftp://127.0.0.1"):
        with pytest.raises(SystemExit):
            loadgen.check_loopback(url)
    assert loadgen.check_loopback("http://127.0.0.1:9") == ("127.0.0.1", 9)


@pytest.mark.parametrize("mode", [["--concurrency", "4"], ["--rate", "200"]])
def test_loadgen_reports_and_disconnects(mode, tmp_path, capsys):
    eng = FakeEngine(script=lambda r: ["tok "] * 40, delay_s=0.01)
    app = create_app(eng, FakeTokenizer(), ModelInfo("m", 4096, "fake", 1), ServerConfig())
    with BackgroundServer(app) as srv:
        out = tmp_path / "s.json"
        rc = loadgen.main(
            [
                "--url",
                srv.url,
                "--model",
                "m",
                "--requests",
                "24",
                "--prompt-words",
                "2,20",
                "--disconnect-fraction",
                "0.5",
                "--seed",
                "3",
                "--json",
                str(out),
                *mode,
            ]
        )
        s = json.loads(out.read_text())
        assert rc == 0 and s["requests"] == 24 and s["ok"] == 24 and s["errors"] == {}
        assert 0 < s["disconnected"] < 24 and s["ttft_p50_s"] is not None and s["itl_p99_s"] is not None
        t = time.monotonic() + 5
        while len(eng.aborted) < s["disconnected"] and time.monotonic() < t:
            time.sleep(0.05)
        assert len(eng.aborted) == s["disconnected"]
    assert "TTFT p50 / p99" in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_run_server_health_loading_then_ready():
    port = _free_port()
    gate = threading.Event()
    stop = threading.Event()

    def load():
        gate.wait(5)
        return FakeEngine(), FakeTokenizer(), ModelInfo("m", 4096, "fake", 1)

    rc = {}
    t = threading.Thread(
        target=lambda: rc.setdefault(
            "v", run_server(ServerConfig(port=port), load, install_signals=False, stop_event=stop)
        ),
        daemon=True,
    )
    t.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 5
    while True:
        try:
            status, body = _get(url + "/health")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert (status, body) == (503, {"status": "loading"})
    gate.set()
    deadline = time.monotonic() + 5
    while _get(url + "/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _get(url + "/ready")[0] == 200
    stop.set()
    t.join(5)
    assert rc["v"] == 0


def test_run_server_load_failure_exits_with_one_line():
    """A model that fails to load stops the server at once: exit code 1, or (as `memra serve` runs it)
    the error re-raised as a one-line MemraError."""
    from engine.types import MemraError

    def load():
        raise RuntimeError("no such model file\nsecond line")

    t0 = time.monotonic()
    assert run_server(ServerConfig(port=_free_port()), load, install_signals=False) == 1
    with pytest.raises(MemraError) as ei:
        run_server(ServerConfig(port=_free_port()), load, install_signals=False, raise_load_error=True)
    assert str(ei.value) == "cannot load the model: RuntimeError: no such model file"
    assert time.monotonic() - t0 < 8


def test_memra_serve_bad_model_exits_with_one_line(tmp_path):
    """`memra serve` on a broken model exits non-zero with one error line and no traceback, as `memra run` does."""
    import subprocess

    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}')
    p = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", str(bad), "--port", "0", "--backend", "reference"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert len(errors) == 1 and errors[0].startswith("memra: error: ") and str(bad) in errors[0], p.stderr
