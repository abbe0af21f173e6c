"""KernelSpec -> rendered source -> cache key -> cubin (cache hit, or NVRTC compile + store).

``KernelBuilder.build_all`` compiles misses in parallel with a progress line on stderr;
``MEMRA_NO_COMPILE=1`` (or ``no_compile=True``) turns a miss into KernelCacheMiss, which proves a
warmup was complete. The compiler is injectable so the pipeline is testable without NVRTC. Must not
import CUDA directly (it goes through engine.nvrtc).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from engine import env
from engine.kcache import KernelCache, cache_key
from engine.kernel_spec import KernelSpec
from engine.render import render

# (source, name, arch, options, source_path) -> (cubin, log)
Compiler = Callable[[str, str, str, tuple[str, ...], Path], tuple[bytes, str]]


class KernelCacheMiss(RuntimeError):
    """A kernel was not in the cache while compiling was forbidden (MEMRA_NO_COMPILE=1)."""


@dataclass
class CompiledKernel:
    spec: KernelSpec
    arch: str
    key: str
    cubin: bytes
    cubin_path: Path
    source_path: Path
    cached: bool


@dataclass
class BuildStats:
    hits: int = 0
    compiled: int = 0
    seconds: float = 0.0
    kernels: list[CompiledKernel] = field(default_factory=list)

    def summary(self) -> str:
        total = self.hits + self.compiled
        pct = 100.0 * self.hits / total if total else 100.0
        return f"{total} kernels: {self.hits} cache hits ({pct:.0f}%), {self.compiled} compiled, {self.seconds:.2f} s"


def _nvrtc_compiler(source: str, name: str, arch: str, options: tuple[str, ...], source_path: Path):
    from engine import nvrtc

    return nvrtc.compile_to_cubin(source, name, arch, options, source_path=source_path)


# build_all's default progress stream: sys.stderr looked up per call (a default argument bound to
# sys.stderr at import goes stale once stderr is replaced, e.g. by a test's capture, then closed)
STDERR = object()


class KernelBuilder:
    """Builds kernels for one architecture (e.g. ``sm_90a``) through one cache."""

    def __init__(
        self,
        arch: str,
        cache: KernelCache | None = None,
        compiler: Compiler | None = None,
        compiler_version: tuple[int, int] | None = None,
        no_compile: bool | None = None,
    ):
        self.arch = arch
        self.cache = cache or KernelCache()
        self._compiler = compiler or _nvrtc_compiler
        self._version = compiler_version
        self.no_compile = env.MEMRA_NO_COMPILE.get() if no_compile is None else no_compile

    @property
    def compiler_version(self) -> tuple[int, int]:
        if self._version is None:
            from engine import nvrtc

            self._version = nvrtc.version()
        return self._version

    def _lookup(self, spec: KernelSpec, key: str) -> CompiledKernel | None:
        cubin = self.cache.load(self.arch, spec.entry, key)
        if cubin is None:
            return None
        return CompiledKernel(
            spec,
            self.arch,
            key,
            cubin,
            self.cache.cubin_path(self.arch, spec.entry, key),
            self.cache.source_path(self.arch, spec.entry, key),
            cached=True,
        )

    def _compile(self, spec: KernelSpec, source: str, key: str) -> CompiledKernel:
        src_path = self.cache.write_source(self.arch, spec.entry, key, source)
        t0 = time.perf_counter()
        cubin, log = self._compiler(source, spec.entry, self.arch, spec.options, src_path)
        dt = time.perf_counter() - t0
        path = self.cache.store(
            self.arch,
            spec.entry,
            key,
            cubin,
            {"template": spec.template, "compile_s": round(dt, 4), "log": log[-2000:]},
        )
        return CompiledKernel(spec, self.arch, key, cubin, path, src_path, cached=False)

    def get(self, spec: KernelSpec) -> CompiledKernel:
        """One kernel; compiles on a miss unless compiling is forbidden."""
        return self.build_all([spec], progress=None).kernels[0]

    def build_all(
        self, specs: Iterable[KernelSpec], jobs: int | None = None, progress: TextIO | None | object = STDERR
    ) -> BuildStats:
        """Every spec (deduplicated, order kept) from the cache or compiled in parallel; progress lines
        go to ``progress`` (default: the sys.stderr of the moment of the call; None: none)."""
        if progress is STDERR:
            progress = sys.stderr
        t0 = time.perf_counter()
        unique = list(dict.fromkeys(specs))
        stats = BuildStats()
        results: dict[KernelSpec, CompiledKernel] = {}
        misses: list[tuple[KernelSpec, str, str]] = []
        for spec in unique:
            source = render(spec)
            key = cache_key(source, self.arch, spec.options, self.compiler_version)
            hit = self._lookup(spec, key)
            if hit is not None:
                results[spec] = hit
            else:
                misses.append((spec, source, key))
        stats.hits = len(results)
        if misses and self.no_compile:
            names = ", ".join(s.entry for s, _, _ in misses[:5]) + (" ..." if len(misses) > 5 else "")
            raise KernelCacheMiss(
                f"{len(misses)} kernel(s) for {self.arch} not in the cache at {self.cache.root} and "
                f"MEMRA_NO_COMPILE=1 forbids compiling: {names}. Run `memra warmup` for this model and device."
            )
        if misses:
            workers = jobs or env.MEMRA_COMPILE_JOBS.get() or (os.cpu_count() or 1)
            from tqdm import tqdm

            # a live bar on a terminal; elsewhere tqdm's first and last lines only (mininterval)
            tty = bool(progress is not None and getattr(progress, "isatty", lambda: False)())
            pbar = tqdm(
                total=len(misses),
                desc=f"memra: compiling kernels for {self.arch}",
                unit="kernel",
                file=progress,
                disable=progress is None,
                mininterval=0.1 if tty else 1e9,
                leave=True,
            )

            def one(item: tuple[KernelSpec, str, str]) -> CompiledKernel:
                kernel = self._compile(*item)
                pbar.update(1)
                return kernel

            with pbar, ThreadPoolExecutor(max_workers=min(workers, len(misses))) as pool:
                results.update((k.spec, k) for k in pool.map(one, misses))
            stats.compiled = len(misses)
        stats.kernels = [results[s] for s in unique]
        stats.seconds = time.perf_counter() - t0
        return stats
