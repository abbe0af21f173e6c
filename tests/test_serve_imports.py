"""`memra serve`'s way to the model load imports nothing heavy it does not need (issue #34: warm
HTTP-ready): the CLI, the server's imports and the loader thread up to ``load_model`` run in a
fresh interpreter, which reports the modules imported by then. Never torch / transformers (references
only), never the gguf package on a safetensors model (engine.storage's block table is written
out; engine.quant imports it when a GGUF tensor is dequantised), never cuda-python, the NVRTC
wrapper or the CUDA runner before the runner is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.storage import BLOCK_SIZES, FILE_TYPES, ggml_type

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "gguf", "cuda", "engine.cuda", "engine.nvrtc", "engine.runner_cuda",
         "engine.compile", "scipy", "sentencepiece")  # fmt: skip

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
