"""Render -> cache key -> cubin pipeline: keys, atomicity, corruption, MEMRA_NO_COMPILE, NVRTC errors."""

from __future__ import annotations

import json

import pytest

from engine import compile as kcompile
from engine import render as krender
from engine.kcache import KernelCache, cache_key
from engine.kernel_spec import KernelSpec, entry_name

TEMPLATE = """// test kernel: out[i] = {{ scale }} * in[i]
extern "C" __global__ void {{ entry }}(float* out, const float* in, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = {{ scale }}f * in[i];
}
"""


@pytest.fixture
def kroot(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    root.mkdir()
    (root / "scale.cu.j2").write_text(TEMPLATE)
    (root / "broken.cu.j2").write_text('extern "C" __global__ void {{ entry }}() { this is not C++; }\n')
    (root / "needs.cu.j2").write_text('extern "C" __global__ void {{ entry }}() { int x = {{ missing }}; }\n')
    monkeypatch.setattr(krender.paths, "kernels_dir", lambda: root)
    return root


class FakeCompiler:
    def __init__(self):
        self.calls = 0

    def __call__(self, source, name, arch, options, source_path):
        self.calls += 1
        return f"CUBIN:{arch}:{name}:{len(source)}".encode(), ""


def spec(scale=2.0, template="scale"):
    return KernelSpec(template, entry_name(template, s=scale), {"scale": scale})


def test_entry_names_are_readable_identifiers():
    assert entry_name("gemv_q8_0", n=576, k=1536, t=256) == "gemv_q8_0__n576_k1536_t256"
    assert entry_name("x", eps=1e-5) == "x__eps1em05"
    with pytest.raises(ValueError):
        KernelSpec("x", "bad name")


def test_render_strict_and_entry_checked(kroot):
    assert "3.0f * in[i]" in krender.render(spec(3.0))
    with pytest.raises(krender.RenderError, match="'missing' is undefined"):
        krender.render(KernelSpec("needs", "needs__a"))
    with pytest.raises(krender.RenderError, match="not found"):
        krender.render(KernelSpec("nosuch", "nosuch__a"))


def test_cache_key_covers_every_input():
    base = cache_key("src", "sm_90a", ("-O3",), (13, 0))
    assert base != cache_key("src2", "sm_90a", ("-O3",), (13, 0))
    assert base != cache_key("src", "sm_120a", ("-O3",), (13, 0))
    assert base != cache_key("src", "sm_90a", ("-O2",), (13, 0))
    assert base != cache_key("src", "sm_90a", ("-O3",), (13, 1))
    assert cache_key("s", "a", ("-x", "-y"), (1, 0)) == cache_key("s", "a", ("-y", "-x"), (1, 0))


def test_second_build_is_all_hits(kroot, tmp_path):
    fake = FakeCompiler()
    b = kcompile.KernelBuilder("sm_90a", KernelCache(tmp_path / "c"), compiler=fake, compiler_version=(13, 0))
    specs = [spec(1.0), spec(2.0), spec(1.0)]
    s1 = b.build_all(specs, progress=None)
    assert (s1.hits, s1.compiled, fake.calls) == (0, 2, 2)
    s2 = b.build_all(specs, progress=None)
    assert (s2.hits, s2.compiled, fake.calls) == (2, 0, 2)
    assert s2.kernels[0].cubin == s1.kernels[0].cubin and s2.kernels[0].cached
    assert s1.kernels[0].source_path.read_text().startswith("// test kernel")


def test_corrupt_or_truncated_cubin_is_rebuilt(kroot, tmp_path):
    fake = FakeCompiler()
    b = kcompile.KernelBuilder("sm_90a", KernelCache(tmp_path / "c"), compiler=fake, compiler_version=(13, 0))
    k = b.get(spec())
    k.cubin_path.write_bytes(k.cubin[:-3])  # truncated
    assert not b.get(spec()).cached and fake.calls == 2
    k.cubin_path.write_bytes(b"X" * len(k.cubin))  # same size, wrong bytes
    assert not b.get(spec()).cached and fake.calls == 3
    k.cubin_path.with_suffix(".json").write_text("{not json")
    assert not b.get(spec()).cached and fake.calls == 4
    assert b.get(spec()).cached


def test_no_compile_turns_a_miss_into_an_error(kroot, tmp_path, monkeypatch):
    fake = FakeCompiler()
    cache = KernelCache(tmp_path / "c")
    monkeypatch.setenv("MEMRA_NO_COMPILE", "1")
    b = kcompile.KernelBuilder("sm_90a", cache, compiler=fake, compiler_version=(13, 0))
    with pytest.raises(kcompile.KernelCacheMiss, match="MEMRA_NO_COMPILE=1 forbids compiling: scale__s2p0"):
        b.get(spec())
    assert fake.calls == 0
    kcompile.KernelBuilder("sm_90a", cache, compiler=fake, compiler_version=(13, 0), no_compile=False).get(
        spec()
    )
    assert b.get(spec()).cached


def test_real_nvrtc_compiles_and_reports_errors(kroot, tmp_path):
    nvrtc = pytest.importorskip("engine.nvrtc")
    try:
        nvrtc.version()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC not available: {exc}")
    b = kcompile.KernelBuilder("sm_90a", KernelCache(tmp_path / "c"))
    k = b.get(spec())
    assert k.cubin[:4] == b"\x7fELF"
    with pytest.raises(nvrtc.NvrtcError) as info:
        b.get(KernelSpec("broken", "broken__x"))
    text = str(info.value)
    assert "NVRTC log" in text and "rendered source:" in text and "broken__x" in text


def test_nvrtc_does_not_corrupt_interned_bytes(kroot, tmp_path):
    """NVRTC writes its log and cubin into caller buffers; they must be fresh bytearrays. Writing into
    `b" " * 1` (CPython's shared single-byte object) once turned every b" " in the process into NUL."""
    nvrtc = pytest.importorskip("engine.nvrtc")
    try:
        nvrtc.version()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC not available: {exc}")
    cubin, log = nvrtc.compile_to_cubin('extern "C" __global__ void k() {}', "k", "sm_90a")
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    assert b" " == bytes([32]) and b"\x00" == bytes([0])


def test_build_progress_goes_to_the_stderr_of_the_call(tmp_path, monkeypatch):
    """The progress stream is sys.stderr as it is when build_all runs, not as it was at import (a
    replaced and closed stderr must not break a later build)."""
    import io
    import sys

    from engine.compile import KernelBuilder
    from engine.kcache import KernelCache
    from engine.kernel_catalog import spec

    old = io.StringIO()
    old.close()
    monkeypatch.setattr(sys, "stderr", old)
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    b = KernelBuilder(
        "sm_90a", KernelCache(tmp_path), compiler=lambda *a: (b"\0cubin", ""), compiler_version=(13, 0)
    )
    b.build_all([spec("rmsnorm", n=64, eps=1e-5, threads=64, residual=False)])
    assert "compiling kernels for sm_90a" in now.getvalue()


def test_cache_files_of_a_long_entry_name_fit_the_file_system(tmp_path):
    """Entry names grow with every non-default param (a q8x GEMV with a silu prologue, k chunks and
    early norm weights passed 230 characters, and its temp file name 255 bytes): the cache cuts
    the name in its file names, the key keeps entries apart, the JSON keeps the whole name."""
    cache = KernelCache(tmp_path / "c")
    entry = "gemv__" + "_".join(f"param{i}{i}" for i in range(40))
    assert len(entry) > 300
    keys = [cache_key(f"src {i}", "sm_90a", (), (13, 0)) for i in range(2)]
    for i, key in enumerate(keys):
        cache.write_source("sm_90a", entry, key, f"// {entry} {i}")
        path = cache.store("sm_90a", entry, key, bytes([i]) * 64)
        assert len(path.name) < 200
    assert [cache.load("sm_90a", entry, k) for k in keys] == [b"\x00" * 64, b"\x01" * 64]
    assert json.loads(path.with_suffix(".json").read_text())["entry"] == entry
