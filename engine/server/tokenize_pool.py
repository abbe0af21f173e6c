"""Bounded-memory prompt work: a small dedicated thread pool renders chat templates and tokenises,
so allocator arenas stay with a fixed number of threads instead of every HTTP worker; and the glibc
malloc knobs (``M_ARENA_MAX`` before threads start, ``malloc_trim`` after a large prompt).

Prompt byte limits are checked by the callers *before* anything is submitted here. Must not import
falcon, waitress or the engine loop (only engine.types).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, TypeVar

from engine.types import MemraError

log = logging.getLogger("memra.server")
T = TypeVar("T")

_M_ARENA_MAX = -8  # glibc mallopt parameter
TRIM_AFTER_BYTES = 256 * 1024  # give freed memory back to the OS after a prompt this large


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 (glibc only; musl has neither mallopt nor malloc_trim)
        libc.malloc_trim  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def limit_malloc_arenas(n: int) -> bool:
    """Cap glibc malloc arenas at ``n`` (0: leave the default of 8 x cores). Call before worker
    threads start: arenas already created stay. Same effect as ``MALLOC_ARENA_MAX=n`` in the environment."""
    if n <= 0 or _LIBC is None:
        return False
    return bool(_LIBC.mallopt(_M_ARENA_MAX, int(n)))


def malloc_trim() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class TokenizePool:
    """``run(fn, *args, size=...)`` calls ``fn`` on one of ``threads`` dedicated threads and returns its
    result (exceptions propagate). ``size`` (bytes of text handled) above TRIM_AFTER_BYTES trims the heap."""

    def __init__(self, threads: int = 1):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="memra-tokenize")
            return self._pool

    def run(self, fn: Callable[..., T], *args: Any, size: int = 0) -> T:
        def job() -> T:
            try:
                return fn(*args)
            finally:
                if size >= TRIM_AFTER_BYTES:
                    malloc_trim()

        try:
            return self._executor().submit(job).result()
        except CancelledError:  # the pool was shut down by a drain while this request waited
            raise MemraError("the server is shutting down; retry on another replica", code="draining") from None

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
