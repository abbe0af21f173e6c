"""engine.nccl without a GPU: it imports, loads the wheel's libnccl (skipped where the multigpu
extra is not installed) and reports its version, forces NVLS off, and a missing library is a clear
NcclUnavailable naming the extra."""

from __future__ import annotations

import os

import pytest

from engine import nccl


def _loadable() -> bool:
    try:
        nccl.library()
        return True
    except nccl.NcclUnavailable:
        return False


@pytest.mark.skipif(not _loadable(), reason="libnccl not installed (memra[multigpu])")
def test_loads_the_library_and_reports_its_version():
    major, minor, patch = nccl.version()
    assert major == 2 and minor >= 18, (major, minor, patch)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    from importlib.metadata import PackageNotFoundError, version

    try:  # the wheel's own version, where it is the wheel that was loaded
        wheel = version("nvidia-nccl-cu13")
    except PackageNotFoundError:
        return
    if "site-packages" in nccl._find():
        assert wheel.startswith(f"{major}.{minor}.{patch}")


def test_missing_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nccl, "_find", lambda: "/nonexistent/libnccl.so.2")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    nccl.library.cache_clear()
    try:
        with pytest.raises(nccl.NcclUnavailable, match=r"memra\[multigpu\]"):
            nccl.version()
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # forced before any load
    finally:
        nccl.library.cache_clear()


def test_unknown_dtype_is_refused_before_any_call():
    with pytest.raises(ValueError, match="NCCL dtype 'q4_k'"):
        nccl._dtype("q4_k")
