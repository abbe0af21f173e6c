"""`memra warmup` and `memra profiles` on a machine without a GPU (NVRTC only)."""

from __future__ import annotations

import pytest

from engine import cli

nvrtc = pytest.importorskip("engine.nvrtc")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    try:
        nvrtc.version()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC unavailable: {exc}")
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMRA_NO_COMPILE", raising=False)


ARGS = [
    "warmup",
    "--family",
    "qwen3",
    "--quant",
    "q4_k_m",
    "--size",
    "qwen3-0.6b",
    "--device-profile",
    "h200",
]


def test_warmup_then_all_hits_then_no_compile(capsys, monkeypatch, tmp_path):
    assert cli.main(ARGS) == 0
    first = capsys.readouterr()
    assert "0 hits" in first.out and "compiled" in first.out
    assert list((tmp_path / "cache" / "kernels" / "v1" / "sm_90a").glob("*.cubin"))
    assert cli.main(ARGS) == 0
    second = capsys.readouterr().out
    assert " 0 compiled" in second and "0 hits" not in second
    monkeypatch.setenv("MEMRA_NO_COMPILE", "1")
    assert cli.main(ARGS) == 0
    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path / "empty"))
    assert cli.main(ARGS) == 2
    err = capsys.readouterr().err
    assert "MEMRA_NO_COMPILE=1 forbids compiling" in err and "memra warmup" in err


def test_warmup_needs_a_target(capsys):
    assert cli.main(["warmup", "--device-profile", "h200"]) == 2
    assert "--family" in capsys.readouterr().err
    assert cli.main(["warmup", "--family", "nosuch", "--quant", "q8_0", "--device-profile", "h200"]) == 2
    assert "unknown model family 'nosuch'" in capsys.readouterr().err


def test_profiles_without_gpu_lists_profiles(capsys, monkeypatch):
    from engine import backend

    monkeypatch.setattr(backend, "detect", lambda: backend.Detected([], "no driver"))
    assert cli.main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device found" in out and "h200" in out and "generic-sm80" in out


def test_profiles_with_a_gpu_selects_h200(capsys, monkeypatch):
    from engine import backend
    from engine.types import DeviceInfo

    dev = DeviceInfo("NVIDIA H200", (9, 0), 132, 143 * 2**30)
    monkeypatch.setattr(backend, "detect", lambda: backend.Detected([dev]))
    assert cli.main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "-> profile h200 (sm_90a)" in out
    listed = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert listed["h100"].endswith("matches: H100  (tuning from h200)") and "tuning from" not in listed["h200"]
