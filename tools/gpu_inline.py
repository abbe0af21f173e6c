"""The GPU micro-benchmarks' shared start: compile an inline CUDA source for the device's profile
arch and load it (tools/gpu_handoff_bench.py, tools/gpu_l2_bench.py). Must not be imported by the
engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def inline_module(source: str, label: str) -> tuple[Any, Any, Any]:
    """(device info, context, module) of ``source`` compiled with NVRTC for device 0's profile arch
    (engine.profile.select), loaded in a new context on device 0; the caller closes the context."""
    from engine import cuda, nvrtc
    from engine.profile import select

    info = cuda.detect_devices()[0]
    ctx = cuda.Context(0)
    cubin, _ = nvrtc.compile_to_cubin(source, label, select(info).arch)
    return info, ctx, cuda.Module(cubin, label)
