"""The one gate of tests/gpu: every test under this directory is marked ``gpu`` and skipped when
``engine.cuda.detect_devices()`` finds no GPU (no driver, no device or no cuda-bindings), so the
suite collects and skips cleanly on a CPU-only machine. Fixtures: the device, its profile, the
primary context, and ``kernels`` (gpu_harness.Kernels: specs compiled for the device's profile
arch into a fresh cubin cache, launched through engine.cuda). Run on a GPU machine with
``python3 -m pytest -q -ra tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import cuda

HERE = Path(__file__).resolve().parent
DEVICES = cuda.detect_devices()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no CUDA GPU (engine.cuda.detect_devices() found none)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not DEVICES:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    return DEVICES[0]


@pytest.fixture(scope="session")
def profile(device):
    """The device profile memra selects for this GPU (its arch and tuning are what plans use)."""
    from engine.profile import select

    return select(device)


@pytest.fixture(scope="session")
def ctx():
    return cuda.Context(0)


@pytest.fixture(scope="session")
def kernels(ctx, profile, tmp_path_factory):
    from gpu_harness import Kernels

    return Kernels(ctx, profile.arch, tmp_path_factory.mktemp("kcache"))
