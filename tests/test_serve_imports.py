"""`memra serve`'s way to the model load imports nothing heavy it does not need (issue #34: warm
HTTP-ready): the CLI, the server's imports and the loader thread up to ``load_model`` run in a
fresh interpreter, which reports the modules imported by then. Never torch / transformers (references
only), never the gguf package on a safetensors model (engine.storage's block table is written
out; engine.quant imports it when a GGUF tensor is dequantised), never the NVRTC wrapper, the kernel
builder or the CUDA runner before the runner is built (cuda-python itself is imported as loading
starts, by engine.backend.detect_soon's thread: the driver's init overlaps the model's metadata)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.storage import BLOCK_SIZES, FILE_TYPES, ggml_type
from engine.types import MemraError

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "gguf", "engine.nvrtc", "engine.runner_cuda", "engine.compile", "scipy",
         "sentencepiece")  # fmt: skip

_PROBE = """
import json, os, sys, threading
import engine.model
import engine.server.serve as srv
reached = threading.Event()
def load_model(path, *a, **k):  # (the loader thread, started before the server's import: park it)
    reached.set()
    threading.Event().wait()
def run_server(cfg, load, **k):  # (the server's modules are imported by now)
    assert reached.wait(60)
    print("MODULES " + json.dumps(sorted(sys.modules)), flush=True)
    os._exit(0)
engine.model.load_model, srv.run_server = load_model, run_server
from engine.cli import main
main(["serve", sys.argv[1], "--backend", "cuda", "--port", "0"])
"""


def test_serve_imports_nothing_heavy_before_the_model_loads(tmp_path):
    (tmp_path / "m").mkdir()
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "m")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    line = next((s for s in out.stdout.splitlines() if s.startswith("MODULES ")), None)
    assert line is not None, out.stderr[-2000:]
    modules = set(json.loads(line[len("MODULES ") :]))
    assert "engine.server.serve" in modules and "engine.loop" in modules  # (the probe reached the load)
    assert not [m for m in modules if m.split(".")[0] in HEAVY or m in HEAVY]


def test_the_written_out_block_table_is_gguf_s():
    from gguf.constants import GGML_QUANT_SIZES

    for t in FILE_TYPES:
        assert BLOCK_SIZES[t] == tuple(GGML_QUANT_SIZES[ggml_type(t)]), t


def test_load_stack_detects_devices_once_while_the_model_loads(monkeypatch, tmp_path):
    """load_stack begins the device detection (cuInit) before it reads the model and hands the
    result to create_runner, which does not detect again."""
    import threading

    from engine import backend
    from engine import model as model_mod

    calls, order = [], []
    started = threading.Event()

    def detect():
        calls.append(threading.current_thread().name)
        started.set()
        return backend.Detected([], "no driver")

    def load_model(path, quant=None):
        order.append(("model", started.wait(10)))  # (detection begun by now, in its own thread)
        raise RuntimeError("stop")

    monkeypatch.setattr(backend, "detect", detect)
    monkeypatch.setattr(model_mod, "load_model", load_model)
    (tmp_path / "m").mkdir()
    try:
        backend.load_stack(str(tmp_path / "m"))
    except RuntimeError:
        pass
    assert order == [("model", True)] and calls == ["cuda-detect"]
    monkeypatch.setattr(backend, "detect", lambda: calls.append("again") or backend.Detected([], "x"))
    with pytest.raises(MemraError, match=r"no CUDA device found \(found earlier\)"):
        backend.create_runner(None, "cuda", detected=lambda: backend.Detected([], "found earlier"))
    assert calls == ["cuda-detect"]  # (not detected again)
