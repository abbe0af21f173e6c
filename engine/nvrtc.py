"""The only module that calls NVRTC: CUDA C++ source -> cubin (or PTX) for one architecture.

CUDA headers (cuda_bf16.h, cuda_fp16.h ...) come from the nvidia-cuda-runtime wheel through
cuda.pathfinder, or from a toolkit ($CUDA_HOME/include, /usr/local/cuda/include). Needs no GPU.
Everything here raises NvrtcError (with the compiler log) or NvrtcUnavailable; nothing else in
memra imports cuda.bindings.nvrtc.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path


class NvrtcUnavailable(RuntimeError):
    """cuda-bindings' NVRTC (or the CUDA headers) cannot be loaded on this machine."""


class NvrtcError(RuntimeError):
    """A compile failed; ``log`` is NVRTC's log and ``source_path`` the rendered source on disk."""

    def __init__(self, message: str, log: str, source_path: Path | None = None):
        where = f"\n  rendered source: {source_path}" if source_path else ""
        super().__init__(f"{message}{where}\n--- NVRTC log ---\n{log.strip()}")
        self.log = log
        self.source_path = source_path


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except Exception as exc:  # ImportError, or the shared library failing to load
        raise NvrtcUnavailable(f"cuda-bindings NVRTC is not importable: {exc}") from exc
    return nvrtc


def _check(result, what: str) -> None:
    nvrtc = _nvrtc()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcUnavailable(f"{what} failed: {result}")


@lru_cache(maxsize=1)
def version() -> tuple[int, int]:
    """NVRTC (major, minor); part of every cubin cache key."""
    nvrtc = _nvrtc()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:
        raise NvrtcUnavailable(f"libnvrtc could not be loaded: {exc}") from exc
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


@lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_runtime.h / cuda_bf16.h, best first."""
    found: list[str] = []
    try:
        import cuda.pathfinder as pathfinder

        for lib in ("cudart", "nvrtc"):
            d = pathfinder.find_nvidia_header_directory(lib)
            if d and d not in found:
                found.append(d)
    except Exception:
        pass
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            d = os.path.join(root, "include")
            if os.path.isfile(os.path.join(d, "cuda_bf16.h")) and d not in found:
                found.append(d)
    usable = [d for d in found if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]
    if not usable:
        raise NvrtcUnavailable(
            "CUDA headers (cuda_bf16.h) not found: install the nvidia-cuda-runtime wheel "
            "(a dependency of memra) or set CUDA_HOME to a CUDA toolkit"
        )
    return tuple(usable)


def compile_to_cubin(
    source: str, name: str, arch: str, options: Sequence[str] = (), source_path: Path | None = None
) -> tuple[bytes, str]:
    """Compile ``source`` for ``arch`` (e.g. ``sm_90a``); returns (cubin, log).

    Raises NvrtcError carrying the log and ``source_path`` when compilation fails.
    """
    return _compile(source, name, arch, options, source_path, ptx=False)


def compile_to_ptx(source: str, name: str, arch: str, options: Sequence[str] = ()) -> str:
    """The PTX NVRTC makes of ``source`` for virtual ``arch`` (e.g. ``compute_90a``): what its
    front end emitted before ptxas (tests read which float operations it left unfused)."""
    return _compile(source, name, arch, options, None, ptx=True)[0].rstrip(b"\x00").decode()


def _compile(
    source: str, name: str, arch: str, options: Sequence[str], source_path: Path | None, ptx: bool
) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "--device-int128"]
        opts += [f"-I{d}" for d in include_dirs()]
        opts += list(options)
        encoded = [o.encode() for o in opts]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(err, "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer: it must be a fresh mutable one. (A `b" " * n` bytes object is
        # immutable, and for n == 1 it is CPython's shared b" " singleton: writing into it corrupts
        # every b" " in the process.)
        buf = bytearray(max(size, 1))
        (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\x00").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NvrtcError(f"NVRTC failed to compile {name} for {arch} ({result.name})", log, source_path)
        get_size, get = (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        err, size = get_size(prog)
        _check(err, get_size.__name__)
        out = bytearray(size)
        (err,) = get(prog, out)
        _check(err, get.__name__)
        return bytes(out), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
