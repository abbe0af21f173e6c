"""Every kernel family against numpy on a real GPU (skipped without torch + a CUDA device).

Runs the checks of tools/gpu_kernels_check.py (which use torch as allocator and cuda.bindings to
load the cubins) without its timings, and fails on any mismatch or unwritten (NaN) output.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


@pytest.fixture(scope="module")
def gk():
    path = Path(__file__).resolve().parents[2] / "tools" / "gpu_kernels_check.py"
    spec = importlib.util.spec_from_file_location("gpu_kernels_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.zeros(1, device="cuda")
    mod.check(mod.drv.cuInit(0))
    return mod


@pytest.fixture(scope="module")
def kernels(gk, tmp_path_factory):
    return gk.Kernels(str(tmp_path_factory.mktemp("kcache")))


@pytest.mark.parametrize("name", ["rmsnorm", "embed", "rope", "silu", "sampling"])
def test_kernel_family(gk, kernels, name):
    gk.RESULTS.clear()
    fn = {
        "rmsnorm": gk.check_rmsnorm,
        "embed": gk.check_embed,
        "rope": gk.check_rope,
        "silu": gk.check_silu,
        "sampling": gk.check_sampling,
    }[name]
    fn(kernels, np.random.default_rng())
    bad = [r for r in gk.RESULTS if r.get("ok") is False]
    assert gk.RESULTS and not bad, bad


def test_gemv_attention_gemm(gk, kernels, monkeypatch):
    gk.RESULTS.clear()
    monkeypatch.setattr(gk, "bench", lambda fn, reps=0: (fn(), 1.0)[1])  # correctness only
    rng = np.random.default_rng()
    gk.check_gemv(kernels, rng, quick=True)
    gk.check_attention(kernels, rng, quick=True)
    gk.check_gemm(kernels, rng, quick=True)
    bad = [r for r in gk.RESULTS if r.get("ok") is False]
    assert not bad, bad
