"""Progress bars (tqdm) on stderr for the long start-up phases: weight loading, kernel compilation;
``process_age()``, the seconds since the process started, for the start-up log lines.

``bar(iterable, desc)`` wraps an iterable; it draws only when stderr is a terminal (logs and tests
stay clean). Must not import CUDA or other engine modules.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def _enabled(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def bar(iterable: Iterable[T], desc: str, total: int | None = None, unit: str = "it", file: Any = None) -> Iterable[T]:
    """``iterable`` with a tqdm bar on ``file`` (default: the current sys.stderr) when enabled."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    return tqdm(
        iterable, desc=desc, total=total, unit=unit, file=stream, disable=not _enabled(stream), leave=False,
        dynamic_ncols=True,
    )


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc, 10 ms steps), None where that is not known."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # (field 22, starttime)
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
