"""The Hopper prefill GEMM (kernels/gemm_wgmma.cu.j2) against numpy on a real sm_90 GPU.

Runs the correctness part of tools/gpu_check_gemm_wgmma.py (every tile config, M and N tails, the
residual aliasing out, f32 out, an A tensor map spanning NaN rows past M, rows past M untouched) on
fresh random inputs; skipped without torch, a CUDA device, or compute capability 9.0.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 (Hopper) GPU",
    ),
]


def test_gemm_wgmma_matches_numpy(tmp_path):
    tools = Path(__file__).resolve().parents[2] / "tools"
    sys.path.insert(0, str(tools))
    spec = importlib.util.spec_from_file_location("gpu_check_gemm_wgmma", tools / "gpu_check_gemm_wgmma.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.RESULTS.clear()
    mod.correctness(mod.Kernels(str(tmp_path / "kcache")), quick=True)
    checks = [r for r in mod.RESULTS if "ok" in r]
    bad = [r for r in checks if not r["ok"]]
    assert len(checks) >= 20 and not bad, bad
